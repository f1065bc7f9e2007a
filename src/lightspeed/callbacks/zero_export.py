"""``ZeroExport``: write consolidated safetensors straight from the live ZeRO-sharded model.

```python
trainer = L.Trainer(strategy="zero3_offload", callbacks=[ZeroExport("export/", dtype="bf16")])
trainer.fit(model)                                  # export/ holds model.safetensors (+ index when sharded)
lightspeed.export.load_exported(fresh_model, "export/")
```

At the end of ``fit`` (and, with ``on_checkpoint=True``, whenever a checkpoint is saved) every rank walks the
model parameter by parameter: trainable weights are assembled from DeepSpeed's fp32 master partitions, frozen ZeRO-3
weights are gathered one at a time, and rank 0 writes each tensor and drops it. No rank holds the full model. The
output equals exporting the checkpoint the engine would save at that moment (``lightspeed export``).

When the exported module (the LightningModule, or its submodule at ``strip_prefix``) is a Hugging Face model, its
``config.json`` (and ``generation_config.json``) are written beside the weights, so ``from_pretrained(dirpath)``
loads the export:

```python
class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(...))

trainer = L.Trainer(strategy="zero3_offload", callbacks=[ZeroExport("export/", strip_prefix="model.")])
GPT2LMHeadModel.from_pretrained("export/")
```
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightspeed.core.checkpoint.exporter import ExportResult
from lightspeed.core.checkpoint.hf_config import find_hf_config
from lightspeed.core.checkpoint.live import export_engine
from lightspeed.core.checkpoint.options import ExportOptions, exclude_frozen_choice
from lightspeed.core.errors import ExportError
from lightspeed.core.reliability.staging import check_output_dir_on_every_rank

__all__ = ["ZeroExport"]


class ZeroExport(Callback):
    """Export the model of a DeepSpeed/ZeRO strategy to safetensors in ``dirpath``.

    Args:
        dirpath: output directory (replaced atomically by every export). With several models
            (``ZeroStrategy(models=...)``) each trained model goes to ``dirpath/<name>/`` (each replaced atomically);
            frozen models are not written.
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"`` for floating tensors.
        max_shard_size: largest shard, e.g. ``"2GB"``; None writes one file.
        exclude_frozen_parameters: leave out parameters with ``requires_grad=False`` (as the strategy's
            ``exclude_frozen_parameters`` leaves them out of checkpoints).
        strip_prefix: export only the keys under this prefix, without it (``"model."`` for a wrapped HF model).
        on_checkpoint: also export whenever a checkpoint is saved, so ``dirpath`` follows the latest checkpoint.
        overwrite: replace a non-empty ``dirpath`` that this run did not write (checked before training starts).
        hf_config: the Hugging Face ``config.json`` written beside the weights. None (default): the exported
            module's own ``.config`` (and ``.generation_config``) when it has one with ``to_json_file`` /
            ``save_pretrained``, nothing otherwise; a config object or a ``config.json`` path / directory: that one;
            False: never.
        exclude_frozen: deprecated name of ``exclude_frozen_parameters`` (works, with a ``FutureWarning``).
        peft: for a model holding a PEFT model (``peft.get_peft_model``): ``"adapter"`` (default) writes PEFT's
            layout, ``adapter_model.safetensors`` + ``adapter_config.json`` (the trained adapter only), which
            ``PeftModel.from_pretrained(base, dirpath)`` loads; ``"merged"`` the base model with the LoRA adapters
            folded into its weights, named as the base model, with its ``config.json`` (``from_pretrained(dirpath)``
            loads it without peft); ``"full"`` the whole ``state_dict``.

    The export options are validated here (``self.options``), so a typo fails at construction, not after training.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike,
        dtype: str | torch.dtype = "fp32",
        max_shard_size: int | str | None = "5GB",
        exclude_frozen_parameters: bool = False,
        strip_prefix: str | None = None,
        on_checkpoint: bool = False,
        overwrite: bool = False,
        hf_config: Any = None,
        exclude_frozen: bool | None = None,
        peft: str = "adapter",
    ) -> None:
        self.dirpath = Path(dirpath)
        self.options = ExportOptions(
            dtype=dtype,
            max_shard_size=max_shard_size,
            exclude_frozen_parameters=exclude_frozen_choice("ZeroExport", exclude_frozen_parameters, exclude_frozen),
            strip_prefix=strip_prefix,
            overwrite=overwrite,
            hf_config=None if hf_config is False else hf_config,
            peft=peft,
        )
        self._hf_config_from_model = hf_config is None  # found on the exported module at each export
        self.on_checkpoint = on_checkpoint
        self._written = False
        self.export_count = 0  # exports written by this callback (per process; every rank takes part)
        self.last_result: ExportResult | None = None
        self.last_results: dict[str, ExportResult | None] = {}  # per model ("" for the one model of one engine)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not hasattr(trainer.strategy, "deepspeed_engine"):
            raise ExportError(
                f"ZeroExport needs a DeepSpeed strategy (strategy='zero1' ... 'zero3_nvme' or DeepSpeedStrategy); "
                f"the trainer uses {type(trainer.strategy).__name__}. For other strategies save the state_dict "
                "with safetensors directly"
            )
        self._written = False  # a new fit must not replace an earlier fit's export unless overwrite=True
        # every rank raises rank 0's verdict (the other ranks would otherwise wait in deepspeed.initialize)
        check_output_dir_on_every_rank(self.dirpath, self.options.overwrite)

    def _export(self, trainer: pl.Trainer, pl_module: pl.LightningModule, reason: str) -> None:
        strategy = trainer.strategy
        # several models, one engine each (ZeroStrategy(models=...)): every trained model into its own folder
        engines: dict[str, Any] = dict(getattr(strategy, "trained_models", {}))
        if not getattr(strategy, "several_models", False):
            engines = {"": strategy.deepspeed_engine}  # type: ignore[attr-defined]  # checked in setup
        if any(engine is None for engine in engines.values()):
            raise ExportError("ZeroExport: the DeepSpeed engine is not set up; the export runs during fit only")
        source = {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "reason": reason}
        results = {}
        for name, engine in engines.items():
            options = self.options
            if self._hf_config_from_model:
                model = engine.module if name else pl_module
                options = dataclasses.replace(options, hf_config=find_hf_config(model, options.strip_prefix))
            if self._written:  # once this run has written dirpath, later exports replace it
                options = dataclasses.replace(options, overwrite=True)
            results[name] = export_engine(engine, self.dirpath / name, options, source=source)
        self.last_results = results
        self.last_result = results[next(iter(results))]
        self._written = True
        self.export_count += 1
        for name, result in results.items():
            if trainer.is_global_zero and result is not None:
                rank_zero_info(
                    f"ZeroExport: wrote {result.num_tensors} tensors ({result.total_bytes / 1e6:.1f} MB) "
                    f"to {self.dirpath / name} at step {trainer.global_step}"
                )

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.on_checkpoint and trainer.state.fn == "fit":
            self._export(trainer, pl_module, "checkpoint")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the end of fit, while the engine and process group are still fully set up (on_fit_end runs after teardown)
        self._export(trainer, pl_module, "fit_end")
