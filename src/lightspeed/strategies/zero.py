"""``ZeroStrategy``: DeepSpeed ZeRO stages 0-3 with CPU/NVMe offload, on CUDA and on CPU.

Built on Lightning's ``DeepSpeedStrategy`` (launchers, engine wiring, checkpoint hooks) with these changes:

* runs on ``accelerator="cpu"`` too (DeepSpeed's CPU accelerator over gloo), choosing DeepSpeed's accelerator itself;
* the DeepSpeed config comes from a named preset plus the user's ``config=``, validated for unknown keys and with
  every ``"auto"`` resolved from the Trainer and the model (see :mod:`lightspeed.core.deepspeed_config`);
* ``torch.optim.Adam``/``AdamW`` become DeepSpeed's CPU Adam (``Adagrad``: CPU Adagrad) when the optimizer is
  offloaded; any other torch optimizer runs as it is on the offloaded weights;
* evaluation after ``fit`` reuses the training engine instead of building a second one;
* evaluation from a checkpoint (``validate/test/predict(ckpt_path=...)``) in a fresh process loads the weights of
  any stage and world size into the (partitioned) inference model itself, tensor by tensor;
* checkpoints are written to a staging directory and committed only after every rank finished;
* the process group lightspeed created is destroyed when the interpreter exits (never mid-teardown), and known
  third-party deprecation floods are filtered while the strategy runs.
"""

from __future__ import annotations

import argparse
import logging
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from typing_extensions import override

from lightspeed.core import atomic_dir
from lightspeed.core.checkpoint.errors import CheckpointError
from lightspeed.core.checkpoint.staged_save import StagedCheckpointSaver
from lightspeed.core.cpu_optimizer import prepare_offloaded_optimizer, retarget_lr_scheduler
from lightspeed.core.deepspeed_config import (
    DeepSpeedConfigError,
    ZeroTuning,
    build_zero_config,
    config_offloads_optimizer,
    config_stage,
    config_uses_nvme,
    describe_config,
    resolve_config_with_notes,
)
from lightspeed.core.deepspeed_runtime import (
    async_io_problem,
    check_precision_supported,
    deepspeed_device_rank,
    export_deepspeed_accelerator,
    use_deepspeed_accelerator,
)
from lightspeed.core.distributed import raise_on_every_rank
from lightspeed.core.zero_weights import load_zero_weights, read_client_state, read_structure
from lightspeed.strategies import _process_group, _third_party_warnings
from lightspeed.strategies._training_facts import collect_training_facts
from lightspeed.strategies.exact_accumulation import DeepSpeedExactAccumulationMixin

if TYPE_CHECKING:
    import deepspeed
    import lightning.pytorch as pl

__all__ = ["ZeroStrategy"]

log = logging.getLogger(__name__)

#: file written next to DeepSpeed's files in every checkpoint directory
RESOLVED_CONFIG_FILENAME = "ds_config.json"


class ZeroStrategy(DeepSpeedExactAccumulationMixin, DeepSpeedStrategy):
    """DeepSpeed ZeRO for Lightning, on ``accelerator="cuda"`` (nccl) and ``accelerator="cpu"`` (gloo).

    Args:
        stage: ZeRO stage 0-3 (0: plain data parallel through DeepSpeed).
        offload_optimizer: ``"none"``, ``"cpu"`` or ``"nvme"`` (``True`` means ``"cpu"``): where optimizer states live
            and the optimizer step runs.
        offload_parameters: ``"none"``, ``"cpu"`` or ``"nvme"``; stage 3 only.
        nvme_path: directory for NVMe offload; defaults to ``$LIGHTSPEED_NVME_PATH``.
        pin_memory: page-lock offloaded CPU buffers (faster host-device copies on CUDA; no effect on CPU).
        reduce_bucket_size, allgather_bucket_size, prefetch_bucket_size, param_persistence_threshold: ZeRO bucket
            sizes in elements; ``"auto"`` derives them from the model's hidden size.
        sub_group_size: ZeRO-3 optimizer sub-group size (elements), None for DeepSpeed's default.
        config: DeepSpeed config dict or JSON path merged over the preset (its values win). ``"auto"`` is allowed
            wherever HF-style configs use it. Unknown keys and values that contradict Trainer arguments are errors.
        sync_with_dataloader: exact gradient accumulation (see ``DeepSpeedExactAccumulationMixin``): ``True`` steps
            the short last window of an epoch with its gradient scaled to its real size; ``False`` requires full
            windows.
    """

    strategy_name = "zero"
    config: dict[str, Any]  # always built (Lightning's attribute may be None; ours never is)

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: str | bool | None = "none",
        offload_parameters: str | bool | None = "none",
        nvme_path: _PATH | None = None,
        pin_memory: bool = True,
        reduce_bucket_size: int | str = "auto",
        allgather_bucket_size: int | str = "auto",
        prefetch_bucket_size: int | str = "auto",
        param_persistence_threshold: int | str = "auto",
        sub_group_size: int | None = None,
        config: _PATH | dict[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any | None = None,
        precision_plugin: Any | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        logging_level: int = logging.WARN,
        exclude_frozen_parameters: bool = False,
        load_full_weights: bool = False,
        sync_with_dataloader: bool = True,
    ) -> None:
        deepspeed_config = build_zero_config(
            stage,
            offload_optimizer,
            offload_parameters,
            nvme_path=nvme_path,
            user_config=config,
            tuning=ZeroTuning(
                pin_memory=pin_memory,
                reduce_bucket_size=reduce_bucket_size,
                allgather_bucket_size=allgather_bucket_size,
                prefetch_bucket_size=prefetch_bucket_size,
                param_persistence_threshold=param_persistence_threshold,
                sub_group_size=sub_group_size,
            ),
        )
        self._init_lightning(
            deepspeed_config,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            logging_level=logging_level,
            exclude_frozen_parameters=exclude_frozen_parameters,
            load_full_weights=load_full_weights,
            sync_with_dataloader=sync_with_dataloader,
        )

    def _init_lightning(self, deepspeed_config: dict[str, Any], **strategy_kwargs: Any) -> None:
        """Lightning's ``DeepSpeedStrategy`` set-up (``strategy_kwargs``: the Lightning arguments of ``__init__``)
        around an already built DeepSpeed config, whose ``"auto"`` values stay until setup."""
        super().__init__(config=deepspeed_config, **strategy_kwargs)
        self.config = deepspeed_config
        self._train_engine: deepspeed.DeepSpeedEngine | None = None
        self._config_logged = False
        self._saver = StagedCheckpointSaver()
        self._failed = False  # set by on_exception, read by teardown

    # ------------------------------------------------------------------ properties
    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError("The ZeRO strategy has no LightningModule yet; it is attached by the Trainer.")
        return module

    @property
    def stage(self) -> int:
        """The ZeRO stage of the config in force."""
        return config_stage(self.config)

    @property
    def uses_nvme(self) -> bool:
        """Whether anything is offloaded to NVMe."""
        return config_uses_nvme(self.config)

    @property
    def offloads_optimizer(self) -> bool:
        """True when the optimizer step runs on the CPU/NVMe (DeepSpeed CPU Adam)."""
        return config_offloads_optimizer(self.config)

    @property
    def resolved_config(self) -> dict[str, Any]:
        """The DeepSpeed config in force (all ``"auto"`` values resolved once setup ran)."""
        return self.config

    def _device_kind(self) -> str:
        if isinstance(self.accelerator, CUDAAccelerator):
            return "cuda"
        if isinstance(self.accelerator, CPUAccelerator):
            return "cpu"
        raise DeepSpeedConfigError(
            f"ZeRO strategies run on `accelerator='cuda'` or `accelerator='cpu'`, not on "
            f"`{type(self.accelerator).__name__}`."
        )

    # ------------------------------------------------------------------ before any process starts
    @override
    def _configure_launcher(self) -> None:
        # Runs in Trainer.__init__, before launching: the right place for checks that must fail early and for the
        # environment every rank inherits.
        kind = self._device_kind()
        check_precision_supported(kind, self.precision_plugin.precision)
        export_deepspeed_accelerator(kind)
        super()._configure_launcher()

    # ------------------------------------------------------------------ process setup
    @override
    def setup_environment(self) -> None:
        _third_party_warnings.install()
        kind = self._device_kind()
        use_deepspeed_accelerator(kind)
        if self.uses_nvme:
            problem = async_io_problem()
            if problem is not None:
                raise DeepSpeedConfigError(f"NVMe offload cannot run here: {problem}")
        if kind == "cuda":
            super().setup_environment()  # Lightning's checks and CUDA device selection
            return
        assert self.accelerator is not None  # set by the Trainer before setup_environment
        self.accelerator.setup_device(self.root_device)
        self.setup_distributed()

    @override
    def setup_distributed(self) -> None:
        existed = _process_group.group_is_initialized()
        if self._device_kind() == "cuda":
            super().setup_distributed()
        else:
            # CPU devices carry no index, so Lightning's CUDA index check does not apply.
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()
        if not existed and _process_group.group_is_initialized():
            _process_group.take_ownership()

    # ------------------------------------------------------------------ config resolution
    @override
    def _format_config(self) -> None:
        resolved, notes = resolve_config_with_notes(
            self.config,
            collect_training_facts(
                self.lightning_module, self.world_size, self.precision_plugin.precision, self.config
            ),
        )
        self.config = resolved
        if not self._config_logged:
            for note in notes:
                rank_zero_info(f"lightspeed: {note}")
            rank_zero_info(f"lightspeed: resolved DeepSpeed config\n{describe_config(resolved)}")
            self._config_logged = True

    # ------------------------------------------------------------------ engine construction
    @override
    def _init_optimizers(self) -> tuple[torch.optim.Optimizer, LRSchedulerConfig | None]:
        try:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(self._module())
        except RuntimeError as err:
            # Lightning's own message suggests manual optimization, which does not help under ZeRO either
            if "multiple optimizers" not in str(err):
                raise
            raise _one_optimizer_error("several optimizers") from None
        if len(optimizers) != 1:
            raise _one_optimizer_error(f"{len(optimizers)} optimizers")
        if len(schedulers) > 1:
            raise DeepSpeedConfigError(
                f"ZeRO strategies support one LR scheduler, but `configure_optimizers` returned {len(schedulers)}. "
                "Combine them, e.g. with `torch.optim.lr_scheduler.SequentialLR`."
            )
        optimizer = optimizers[0]
        scheduler = schedulers[0] if schedulers else None
        if self.offloads_optimizer:
            converted, message = prepare_offloaded_optimizer(optimizer, self.config)
            if message is not None:
                rank_zero_info(message)
            if converted is not optimizer and scheduler is not None:
                retarget_lr_scheduler(scheduler.scheduler, converted)
            optimizer = converted
        return optimizer, scheduler

    @override
    def _setup_model_and_optimizer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[deepspeed.DeepSpeedEngine, torch.optim.Optimizer]:
        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=deepspeed_device_rank(self.root_device.index, self.local_rank)),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer

    @override
    def init_deepspeed(self) -> None:
        trainer = self._module().trainer
        reusable = self._train_engine is not None and self._train_engine.module is self.lightning_module
        if not trainer.training and reusable:
            # validate/test/predict after fit: the training engine already holds the (sharded) weights
            self.model = self._train_engine
            return
        super().init_deepspeed()
        if trainer.training:
            self._train_engine = self.model

    @override
    def _initialize_deepspeed_inference(self, model: torch.nn.Module) -> None:
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config["zero_allow_untested_optimizer"] = self.config.get("zero_allow_untested_optimizer", True)
            inference_config["zero_optimization"] = self.config["zero_optimization"]
            if "aio" in self.config:
                inference_config["aio"] = self.config["aio"]
        remove_module_hooks(model)
        engine, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=deepspeed_device_rank(self.root_device.index, self.local_rank)),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )
        self.model = engine

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        failed, self._failed = self._failed, False
        if failed:
            self._train_engine = None  # the engine of a failed run is not reused for evaluation
        try:
            self._teardown_lightning()
        finally:
            _third_party_warnings.uninstall()
        # The process group lightspeed created stays up until the interpreter exits (an ``atexit`` hook destroys it
        # then, while the interpreter is intact): the training engine kept for evaluation after ``fit``, ZeRO-3
        # partitioned modules and the user's own ``torch.distributed`` calls after a run (even a failed one) use it.

    def _teardown_lightning(self) -> None:
        if self._train_engine is None or self._device_kind() == "cpu":
            super().teardown()
            return
        # CUDA with the training engine kept for evaluation after `fit`: everything Lightning's teardown does except
        # moving the module and optimizer states to the CPU, which would break the engine's (sharded) weights.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Any | None = None) -> None:
        """Save through DeepSpeed into a staging directory; commit it only when every rank has finished."""
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by ZeRO strategies: DeepSpeed "
                "writes the checkpoint files itself."
            )
        filepath = self.broadcast(str(filepath))

        def write(staging: Path) -> None:
            client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            self.deepspeed_engine.save_checkpoint(
                str(staging),
                client_state=client_state,
                tag="checkpoint",
                exclude_frozen_parameters=self.exclude_frozen_parameters,
            )

        self._saver.save(
            filepath,
            write,
            manifest={
                "writer": "lightspeed",
                "world_size": self.world_size,
                "zero_stage": self.stage,
                "tag": "checkpoint",
                "global_step": checkpoint.get("global_step"),
                "epoch": checkpoint.get("epoch"),
            },
            extra_files={RESOLVED_CONFIG_FILENAME: describe_config(self.config)},
        )

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if not path.exists():
            atomic_dir.require_complete(path)  # explains a save interrupted mid-swap, or that nothing is there
        if path.is_dir() and not atomic_dir.is_complete(path):
            if atomic_dir.staging_path(path).exists() or not (path / "latest").is_file():
                atomic_dir.require_complete(path)  # raises with the explanation
            rank_zero_warn(
                f"Checkpoint {str(path)!r} was not written by lightspeed (no completion marker); loading it as a "
                "plain DeepSpeed checkpoint."
            )
        fitting = self._module().trainer.state.fn == TrainerFn.FITTING
        if not fitting and not (self.load_full_weights and self.zero_stage_3):
            return self._load_weights_for_evaluation(path)
        return super().load_checkpoint(checkpoint_path, weights_only)

    def _load_weights_for_evaluation(self, path: Path) -> dict[str, Any]:
        """validate/test/predict from a ZeRO checkpoint: its weights, read from the rank files of any stage and world
        size, go straight into the (possibly partitioned) model, tensor by tensor; returns Lightning's client state.

        DeepSpeed's inference engine has no ZeRO optimizer to restore shards into, so its ``load_checkpoint`` cannot
        be used; every rank reads the checkpoint's layout, so a missing rank file is an error on every rank.
        """
        what = f"Loading checkpoint {str(path)!r}"
        error: CheckpointError | None = None
        try:
            structure = read_structure(path)
            client_state = read_client_state(structure)
        except CheckpointError as err:
            error = err
        raise_on_every_rank(error, what, error_type=CheckpointError)
        module = self._module()
        try:
            load_zero_weights(module, structure, rank=self.global_rank, strict=module.strict_loading)
        except CheckpointError as err:
            error = err
        raise_on_every_rank(error, what, error_type=CheckpointError)
        return client_state


def _one_optimizer_error(returned: str) -> DeepSpeedConfigError:
    return DeepSpeedConfigError(
        f"ZeRO strategies train with exactly one optimizer, but `configure_optimizers` returned {returned}. Use one "
        "optimizer with several param groups (each group can have its own lr and weight_decay)."
    )
