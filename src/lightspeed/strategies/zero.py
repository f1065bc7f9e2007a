"""``ZeroStrategy``: DeepSpeed ZeRO stages 0-3 with CPU/NVMe offload, on CUDA and on CPU.

Built on Lightning's ``DeepSpeedStrategy`` (launchers, engine wiring, checkpoint hooks) with these changes:

* runs on ``accelerator="cpu"`` too (DeepSpeed's CPU accelerator over gloo), choosing DeepSpeed's accelerator itself;
* the DeepSpeed config comes from a named preset plus the user's ``config=``, validated for unknown keys and with
  every ``"auto"`` resolved from the Trainer and the model (see :mod:`lightspeed.core.zero.config`);
* ``torch.optim.Adam``/``AdamW`` become DeepSpeed's CPU Adam (``Adagrad``: CPU Adagrad) when the optimizer is
  offloaded; any other torch optimizer runs as it is on the offloaded weights;
* evaluation after ``fit`` reuses the training engine instead of building a second one;
* evaluation from a checkpoint (``validate/test/predict(ckpt_path=...)``) in a fresh process loads the weights of
  any stage and world size into the (partitioned) inference model itself, tensor by tensor;
* checkpoints are written to a staging directory and committed only after every rank finished;
* the process group lightspeed created is destroyed when the interpreter exits (never mid-teardown), and known
  third-party deprecation floods are filtered while the strategy runs;
* ``compile=True`` (or a LightningModule compiled with ``torch.compile``, which Lightning refuses under DeepSpeed)
  compiles through DeepSpeed's own ``engine.compile()`` (see :mod:`lightspeed.core.zero.compile`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.compile import to_uncompiled
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from typing_extensions import override

from lightspeed.core.errors import CheckpointError, DeepSpeedConfigError
from lightspeed.core.reliability.launched_world import check_launched_world, external_launcher
from lightspeed.core.reliability.node_local import describe_position, node_local_path
from lightspeed.core.reliability.staged_saver import StagedCheckpointSaver
from lightspeed.core.zero import load_policy
from lightspeed.core.zero import third_party_warnings as _third_party_warnings
from lightspeed.core.zero.activation_checkpointing import apply_policy, configure_deepspeed_checkpointing
from lightspeed.core.zero.compile import (
    CompileRequest,
    check_compile_supported,
    compile_engine,
    compile_request,
    prepare_zero3_for_compile,
    request_from_dynamo_context,
)
from lightspeed.core.zero.config import (
    ZeroConfigProperties,
    describe_config,
    resolve_config_with_notes,
)
from lightspeed.core.zero.config.activation import Policy
from lightspeed.core.zero.config.model_recipe import ModelRecipe, model_recipes
from lightspeed.core.zero.engine import (
    initialize_engine,
    one_optimizer_error,
    prepare_deepspeed_process,
    prepare_optimizer,
    save_models_checkpoint,
    save_zero_checkpoint,
)
from lightspeed.core.zero.generation import keep_generation_in_step
from lightspeed.core.zero.parameter_checks import check_parameters_for_zero, check_partitions_kept
from lightspeed.core.zero.runtime import (
    check_precision_supported,
    export_deepspeed_accelerator,
    zero_device_kind,
)
from lightspeed.core.zero.several_models import parse_model_options
from lightspeed.core.zero.weights import load_full_state_dict
from lightspeed.strategies._training_facts import collect_training_facts
from lightspeed.strategies.exact_accumulation import DeepSpeedExactAccumulationMixin
from lightspeed.strategies.launchers import check_start_method, fork_launcher_if_wanted
from lightspeed.strategies.process_group import ProcessGroupMixin
from lightspeed.strategies.resumable_data import ResumableDataMixin
from lightspeed.strategies.several_models import SeveralModelsMixin
from lightspeed.strategies.zero_models import ZeroModelsMixin

if TYPE_CHECKING:
    import deepspeed
    import lightning.pytorch as pl

__all__ = ["ZeroStrategy"]

#: how this front end trains several models, each with its own optimizer (for the one-optimizer error)
_SEVERAL_MODELS = (
    "give each its own engine: `ZeroStrategy(models=['generator', 'discriminator'])` with the attributes that hold them"
)


class ZeroStrategy(
    ZeroConfigProperties,
    ProcessGroupMixin,
    ResumableDataMixin,
    DeepSpeedExactAccumulationMixin,
    ZeroModelsMixin,
    SeveralModelsMixin,
    DeepSpeedStrategy,
):
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
        activation_checkpointing_policy: module classes (a set, e.g. ``{Block}``) whose instances' forward runs under
            ``deepspeed.checkpointing.checkpoint`` during training: only their inputs are kept for the backward pass,
            which runs their forward again. Applied before the engine is built; the model's code stays as it is.
        partition_activations, cpu_checkpointing, contiguous_memory_optimization, number_checkpoints,
            synchronize_checkpoint_boundary, profile: DeepSpeed's ``activation_checkpointing`` section, for the policy
            and for ``deepspeed.checkpointing.checkpoint`` calls in the model. ``"auto"``: ``partition_activations``
            and ``contiguous_memory_optimization`` off (no model parallelism to partition across),
            ``cpu_checkpointing`` on when parameters are offloaded and the device is CUDA. The section is written only
            when the policy or one of these asks for it (or ``config=`` has it).
        config: DeepSpeed config dict or JSON path merged over the preset (its values win). ``"auto"`` is allowed
            wherever HF-style configs use it. Unknown keys and values that contradict Trainer arguments are errors.
        sync_with_dataloader: exact gradient accumulation (see ``DeepSpeedExactAccumulationMixin``): ``True`` steps
            the short last window of an epoch with its gradient scaled to its real size; ``False`` requires full
            windows.
        node_local_storage: for clusters whose nodes share no filesystem: each node writes its own ranks' shards (and
            the files every node needs) into its own local checkpoint directory; a checkpoint counts as complete once
            every node committed its part (same as ``config={"checkpoint": {"use_node_local_storage": True}}``).
        start_method: ``"fork"`` starts the worker processes by forking (as Lightning's ``ddp_notebook``); ``None``
            (default) forks in an interactive session (Jupyter, Colab) and otherwise re-runs the script per process.
        compile: compile the model with DeepSpeed's ``engine.compile()`` (``torch.compile`` of the module the engine
            wraps). A LightningModule compiled with ``torch.compile`` before ``fit`` is compiled the same way, with
            its backend, mode and options.
        compile_kwargs: ``torch.compile`` arguments for ``engine.compile()`` (``backend``, ``mode``, ``options``,
            ``fullgraph``, ``dynamic``, ...); given alone, it asks for compilation too.
        models: several models in one LightningModule, each with its own engine: the attribute names of the models
            mapped to their own options (``stage``, ``offload_optimizer``, ``offload_parameters``; left out: the
            strategy's), e.g. ``{"generator": {}, "discriminator": {}}`` or ``{"student": {}, "teacher": {"stage":
            3, "offload_parameters": "cpu"}}``. Each optimizer of ``configure_optimizers`` trains one model; a model
            without one is frozen (under ZeRO-3 partitioned, forward only). Checkpoints hold each trained model's
            engine in its own folder; exports write each trained model to ``<dirpath>/<name>/``.
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
        activation_checkpointing_policy: Collection[type[torch.nn.Module]] | type[torch.nn.Module] | None = None,
        partition_activations: bool | str = "auto",
        cpu_checkpointing: bool | str = "auto",
        contiguous_memory_optimization: bool | str = "auto",
        number_checkpoints: int | None = None,
        synchronize_checkpoint_boundary: bool = False,
        profile: bool = False,
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
        node_local_storage: bool = False,
        start_method: str | None = None,
        compile: bool = False,
        compile_kwargs: dict[str, Any] | None = None,
        models: Mapping[str, Mapping[str, Any]] | Sequence[str] | None = None,
    ) -> None:
        recipe = ModelRecipe.from_arguments(locals(), front_end="Trainer")
        deepspeed_config = recipe.config()
        options = parse_model_options(models, "ZeroStrategy(models=...)")
        recipes = model_recipes(options, recipe, "ZeroStrategy(models=...)")
        if options:
            refused = [
                name
                for name, given in (
                    ("compile", compile or compile_kwargs),
                    ("load_full_weights", load_full_weights),
                    ("node_local_storage", node_local_storage),
                    ("activation_checkpointing_policy", activation_checkpointing_policy),
                )
                if given
            ]
            if refused:
                raise DeepSpeedConfigError(
                    f"ZeroStrategy(models=...) cannot be combined with {', '.join(refused)} yet: train the models "
                    "with one engine (leave out models=) or drop these arguments."
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
            node_local_storage=node_local_storage,
            start_method=start_method,
            compile=compile,
            compile_kwargs=compile_kwargs,
            activation_checkpointing_policy=recipe.tuning.policy,
        )
        self._init_several_models(options, recipes)

    def _init_lightning(
        self,
        deepspeed_config: dict[str, Any],
        *,
        node_local_storage: bool = False,
        start_method: str | None = None,
        compile: bool = False,
        compile_kwargs: dict[str, Any] | None = None,
        activation_checkpointing_policy: Policy | None = None,
        **strategy_kwargs: Any,
    ) -> None:
        """Lightning's ``DeepSpeedStrategy`` set-up (``strategy_kwargs``: the Lightning arguments of ``__init__``)
        around an already built DeepSpeed config, whose ``"auto"`` values stay until setup."""
        check_start_method(start_method)
        self._compile_request = compile_request(compile, compile_kwargs, type(self).__name__)
        self.activation_checkpointing_policy = activation_checkpointing_policy  # applied before the engine is built
        if node_local_storage:
            deepspeed_config.setdefault("checkpoint", {})["use_node_local_storage"] = True
        super().__init__(config=deepspeed_config, **strategy_kwargs)
        self._start_method_choice = start_method
        self.config = deepspeed_config
        self._train_engine: deepspeed.DeepSpeedEngine | None = None
        self._config_logged = False
        self._saver = StagedCheckpointSaver()
        self._failed = False  # set by on_exception, read by teardown
        self._init_several_models({}, {})

    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError("The ZeRO strategy has no LightningModule yet; it is attached by the Trainer.")
        return module

    def _device_kind(self) -> str:
        return zero_device_kind(self.accelerator)

    # ------------------------------------------------------------------ torch.compile
    @property
    @override
    def _lightning_module(self) -> pl.LightningModule | None:
        return self.__dict__.get("_zero_lightning_module")

    @_lightning_module.setter
    def _lightning_module(self, module: pl.LightningModule | None) -> None:
        # The Trainer assigns the module it was given here (unwrapped from torch.compile by `from_compiled`, which
        # compiles its step methods) and then refuses a compiled module under any DeepSpeed strategy: take the
        # compilation over instead, undo Lightning's per-method wrapping, and let the engine compile the module.
        ctx = getattr(module, "_compiler_ctx", None) if module is not None else None
        if module is not None and ctx is not None:
            request = request_from_dynamo_context(ctx["dynamo_ctx"], "torch.compile(model)")
            to_uncompiled(module)
            if self._compile_request is None:
                self._compile_request = request
            if self.accelerator is not None:
                check_compile_supported(self._compile_request, self.config, self._device_kind())
        self.__dict__["_zero_lightning_module"] = module

    @property
    def compile_request(self) -> CompileRequest | None:
        """What ``engine.compile()`` is called with (None: the model is not compiled)."""
        return self._compile_request

    def _prepare_compile(self, model: torch.nn.Module, config: dict[str, Any]) -> None:
        """Before the engine is built: refuse what DeepSpeed cannot compile, mark ZeRO-3 leaf modules."""
        if self._compile_request is None:
            return
        check_compile_supported(self._compile_request, config, self._device_kind())
        marked = prepare_zero3_for_compile(model, config)
        if marked:
            rank_zero_info(
                f"lightspeed: ZeRO-3 leaf modules for the compiled forward (all their parameters gathered on entry): "
                f"{', '.join(marked)}"
            )

    def _compile(self, engine: deepspeed.DeepSpeedEngine) -> None:
        request = self._compile_request
        if request is None:
            return
        rank_zero_info(f"lightspeed: {request.source} runs as DeepSpeed's {request.describe()}")
        compile_engine(engine, request)

    # ------------------------------------------------------------------ before any process starts
    @override
    def _configure_launcher(self) -> None:
        # Runs in Trainer.__init__, before launching: the right place for checks that must fail early and for the
        # environment every rank inherits.
        kind = self._device_kind()
        check_precision_supported(kind, self.precision_plugin.precision)
        if self._compile_request is not None:
            check_compile_supported(self._compile_request, self.config, kind)
        export_deepspeed_accelerator(kind)
        check_launched_world(*external_launcher(self.cluster_environment), self.num_nodes, self.num_processes)
        launcher = fork_launcher_if_wanted(self, self._start_method_choice)
        if launcher is not None:
            self._launcher = launcher
            return
        super()._configure_launcher()

    # ------------------------------------------------------------------ process setup
    @override
    def setup_environment(self) -> None:
        _third_party_warnings.install()
        kind = self._device_kind()
        prepare_deepspeed_process(kind, self.uses_nvme)
        if kind == "cuda":
            super().setup_environment()  # Lightning's checks and CUDA device selection
            return
        assert self.accelerator is not None  # set by the Trainer before setup_environment
        self.accelerator.setup_device(self.root_device)
        self.setup_distributed()

    @override
    def _set_main_address(self) -> None:
        self._set_node_environment_variables()  # DeepSpeed's rank variables too

    @override
    def setup_distributed(self) -> None:
        if self._device_kind() == "cuda":
            super().setup_distributed()  # lightspeed's group (ProcessGroupMixin), then Lightning's CUDA set-up
            return
        # CPU devices carry no index, so Lightning's CUDA index check does not apply; DeepSpeed adopts the group.
        with self._lightspeed_process_group():
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

    # ------------------------------------------------------------------ config resolution
    def _trained_micro_batch(self) -> int | None:
        """The micro-batch size training uses when it is not the training DataLoader's (``zero_auto``'s tuner)."""
        return None

    @override
    def _format_config(self) -> None:
        resolved, notes = resolve_config_with_notes(
            self.config,
            collect_training_facts(
                self.lightning_module,
                self.world_size,
                self.precision_plugin.precision,
                self.config,
                micro_batch_size=self._trained_micro_batch(),
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
            raise one_optimizer_error(
                "several optimizers", "`configure_optimizers` returned", _SEVERAL_MODELS
            ) from None
        if len(optimizers) != 1:
            raise one_optimizer_error(
                f"{len(optimizers)} optimizers", "`configure_optimizers` returned", _SEVERAL_MODELS
            )
        if len(schedulers) > 1:
            raise DeepSpeedConfigError(
                f"ZeRO strategies support one LR scheduler, but `configure_optimizers` returned {len(schedulers)}. "
                "Combine them, e.g. with `torch.optim.lr_scheduler.SequentialLR`."
            )
        optimizer = optimizers[0]
        scheduler = schedulers[0] if schedulers else None
        optimizer, message = prepare_optimizer(optimizer, scheduler.scheduler if scheduler else None, self.config)
        if message is not None:
            rank_zero_info(message)
        return optimizer, scheduler

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # before Lightning's precision plugin casts the module: a float64 parameter is still float64 here
        check_parameters_for_zero(self._module())
        if self.zero_stage_3 and is_overridden("configure_model", self._module()):
            check_partitions_kept(self._module(), "`configure_model`", "in `__init__`")
        super().setup(trainer)

    @override
    def _setup_model_and_optimizer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[deepspeed.DeepSpeedEngine, torch.optim.Optimizer]:
        message = apply_policy(model, self.activation_checkpointing_policy)
        if message is not None:
            rank_zero_info(message)
        self._prepare_compile(model, self.config)
        engine, deepspeed_optimizer, _ = initialize_engine(
            self.config, model, optimizer, lr_scheduler, self.root_device.index, self.local_rank
        )
        self._compile(engine)
        return engine, deepspeed_optimizer

    @override
    def _set_deepspeed_activation_checkpointing(self) -> None:
        # Lightning's passes 4 of the section's 6 keys to deepspeed.checkpointing.configure, which resets the others
        configure_deepspeed_checkpointing(self.config)

    @override
    def init_deepspeed(self) -> None:
        trainer = self._module().trainer
        if self.several_models:
            self._build_model_engines(training=trainer.training)
            keep_generation_in_step(self._module())
            return
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
        self._prepare_compile(model, inference_config)
        engine, _, _ = initialize_engine(inference_config, model, None, None, self.root_device.index, self.local_rank)
        self._compile(engine)
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
            self._drop_model_engines()
        try:
            self._teardown_lightning()
        finally:
            _third_party_warnings.uninstall()
        # The process group lightspeed created stays up until the interpreter exits (an ``atexit`` hook destroys it
        # then, while the interpreter is intact): the training engine kept for evaluation after ``fit``, ZeRO-3
        # partitioned modules and the user's own ``torch.distributed`` calls after a run (even a failed one) use it.

    def _teardown_lightning(self) -> None:
        if (self._train_engine is None and not self.model_engines) or self._device_kind() == "cpu":
            super().teardown()
            return
        # CUDA with the training engine kept for evaluation after `fit`: everything Lightning's teardown does except
        # moving the module and optimizer states to the CPU, which would break the engine's (sharded) weights.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @override
    def _engines_in_window(self) -> list[Any]:
        return list(self.trained_models.values()) if self.several_models else [self.model]

    @override
    def _engine_stepping(self, optimizer: Any) -> Any:
        return self._engine_for_optimizer(optimizer) if self.several_models else self.model

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
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        progress = {"global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}
        if self.several_models:
            save_models_checkpoint(
                self._saver,
                self.trained_models,
                self.model_configs,
                filepath,
                client_state,
                world_size=self.world_size,
                frozen=self.frozen_models,
                exclude_frozen_parameters=self.exclude_frozen_parameters,
                manifest_extra=progress,
            )
            return
        node = None
        if self.node_local_storage:
            filepath = self._node_local_path(filepath)
            node = describe_position(self.node_rank, self.local_rank)
        save_zero_checkpoint(
            self._saver,
            self.deepspeed_engine,
            filepath,
            client_state,
            world_size=self.world_size,
            config=self.config,
            exclude_frozen_parameters=self.exclude_frozen_parameters,
            manifest_extra=progress,
            node=node,
        )

    def _node_local_path(self, path: str) -> str:
        """Rank 0's checkpoint path as this node's path (a collective; see :func:`node_local_path`)."""
        return node_local_path(path, self.broadcast(os.getcwd()))

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Node-local storage: every node's local rank 0 removes its own copy; otherwise Lightning's (rank 0)."""
        if not self.node_local_storage:
            super().remove_checkpoint(filepath)
            return
        path = self._node_local_path(str(filepath))
        if self.local_rank == 0:
            self.checkpoint_io.remove_checkpoint(path)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # DeepSpeed's engine loaded sharded checkpoints in load_checkpoint; a consolidated file (load_full_weights)
        # goes into the partitioned model tensor by tensor, then into the optimizer's fp32 master copies, which
        # Lightning's own restore leaves stale (the first step would start from the weights before loading)
        if not (self.load_full_weights and self.zero_stage_3):
            return
        self.model_to_device()
        module = self._module()
        load_full_state_dict(
            module,
            dict(checkpoint["state_dict"]),
            rank=self.global_rank,
            optimizer=getattr(self.model, "optimizer", None),
            strict=strict,
            source="the checkpoint",
        )

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        module = self._module()
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        full_weights = self.load_full_weights and self.zero_stage_3
        if self.node_local_storage and not fitting:
            raise CheckpointError(
                f"Loading node-local checkpoint {str(path)!r}: evaluating from a node-local checkpoint needs every "
                "node's files in one place. Export it first (`lightspeed export node0/<ckpt> node1/<ckpt> OUT`) and "
                "load the export with `lightspeed.export.load_exported`, or resume training from it."
            )
        if self.several_models:
            return self._load_models_checkpoint(path, fitting)
        load_policy.check_before_loading(
            path,
            module=module if fitting and not self.load_full_weights else None,
            strict=module.strict_loading,
            node_rank=self.node_rank if self.node_local_storage else None,
            warn=rank_zero_warn,
        )
        if not fitting and not full_weights:
            return load_policy.load_weights_for_evaluation(
                module, path, rank=self.global_rank, strict=module.strict_loading
            )
        if self.load_full_weights or self.node_local_storage:
            return super().load_checkpoint(checkpoint_path, weights_only)
        engine = self.deepspeed_engine
        with load_policy.checkpoint_to_load(engine, path, self.world_size, info=rank_zero_info) as load_path:
            return super().load_checkpoint(load_path, weights_only)

    def _load_models_checkpoint(self, path: Path, fitting: bool) -> dict[str, Any]:
        """A several-model checkpoint: every trained model's engine from its own folder (checked first, one error on
        every rank), or for evaluation its weights into the (partitioned) model; returns the Trainer's state."""
        module = self._module()
        models = self._named_models()
        return load_policy.load_models(
            path,
            models,
            {name: self.model_engines[name] for name in models} if fitting else None,
            trained=list(self.trained_models) if fitting else [],
            world_size=self.world_size if fitting else None,  # evaluation reads any world size
            strict=module.strict_loading,
            rank=self.global_rank,
            warn=rank_zero_warn,
        )
