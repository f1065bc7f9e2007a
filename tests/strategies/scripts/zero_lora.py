"""Worker: LoRA on a pretrained Llama built in ``configure_model`` under the Trainer's ZeRO-3 (2 ranks).

usage: zero_lora.py OUT   (OUT/pretrained: the pretrained files, written by the test)

* ``zero3``: 2 steps saving a checkpoint (OUT/ck_first), then a new Trainer resumes from it to step 4 saving again
  (OUT/ck_last) with ``ZeroExport(OUT/export_zero3)``; ``zero3_offload``: 4 steps with
  ``ZeroExport(OUT/export_zero3_offload)`` and ``ZeroExport(OUT/export_merged, peft="merged")``; ``zero3_nvme``: 2
  steps saving OUT/ck_nvme, resumed to step 4 by a new Trainer;
* ``changed_base``: resuming from OUT/ck_first with one frozen base weight changed;
* ``bad_target``: a LoRA target module the model does not have.

Each rank writes OUT/result_<rank>.pt: the PEFT model's gathered state after each run, and the errors.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lightspeed
from _support import lora
from _support.outcomes import error_text
from _support.trainers import quiet_trainer


class LoraModule(L.LightningModule):
    def __init__(self, pretrained: Path, targets: tuple[str, ...] = ("q_proj", "v_proj"), change_base: bool = False):
        super().__init__()
        self.pretrained, self.targets, self.change_base = pretrained, targets, change_base

    def configure_model(self) -> None:
        self.model = lora.lora_model(self.pretrained, self.targets)
        if self.change_base:
            import deepspeed

            weight = self.model.base_model.model.model.layers[0].mlp.up_proj.weight
            with deepspeed.zero.GatheredParameters([weight], modifier_rank=0), torch.no_grad():
                weight.mul_(1.001)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return lora.lm_loss(self.model, batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return lora.optimizer(self)


def gathered_state(module: LoraModule) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(module.model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {key: value.detach().clone() for key, value in module.model.state_dict().items()}


def fit(
    out: Path, strategy: str, steps: int, callbacks: list[Any], ckpt_path: Path | None = None, **module: Any
) -> LoraModule:
    model = LoraModule(out / "pretrained", **module)
    trainer = quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=lora.WORLD,
        max_steps=steps,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )
    data = DataLoader(TensorDataset(lora.tokens()), batch_size=lora.BATCH, shuffle=True)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model


def checkpoint_every_2(folder: Path) -> ModelCheckpoint:
    return ModelCheckpoint(folder, filename="step{step}", every_n_train_steps=2, save_top_k=-1)


def main(out: Path) -> None:
    result: dict[str, Any] = {}
    fit(out, "zero3", 2, [checkpoint_every_2(out / "ck_first")])
    first = next((out / "ck_first").iterdir())
    resumed = fit(
        out,
        "zero3",
        lora.STEPS,
        [checkpoint_every_2(out / "ck_last"), lightspeed.callbacks.ZeroExport(out / "export_zero3")],
        ckpt_path=first,
    )
    result["zero3"] = gathered_state(resumed)
    exports = [
        lightspeed.callbacks.ZeroExport(out / "export_zero3_offload"),
        lightspeed.callbacks.ZeroExport(out / "export_merged", peft="merged"),
    ]
    offloaded = fit(out, "zero3_offload", lora.STEPS, exports)
    result["zero3_offload"] = gathered_state(offloaded)
    os.environ["LIGHTSPEED_NVME_PATH"] = str(out / "nvme")
    fit(out, "zero3_nvme", 2, [checkpoint_every_2(out / "ck_nvme")])
    nvme_first = next((out / "ck_nvme").iterdir())
    result["zero3_nvme"] = gathered_state(fit(out, "zero3_nvme", lora.STEPS, [], ckpt_path=nvme_first))
    result["changed_base"] = error_text(lambda: fit(out, "zero3", lora.STEPS, [], ckpt_path=first, change_base=True))
    result["bad_target"] = error_text(lambda: fit(out, "zero3", 1, [], targets=("q_proj", "not_a_layer")))
    torch.save(result, out / f"result_{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
