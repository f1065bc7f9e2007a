"""``ZeroFabricStrategy``: the Trainer's ZeRO strategies (on CUDA and on the CPU) for Lightning Fabric loops.

Lightning Fabric's ``DeepSpeedStrategy`` with lightspeed's ZeRO core, the same the Trainer's
:class:`~lightspeed.strategies.ZeroStrategy` calls (:mod:`lightspeed.core.zero`, :mod:`lightspeed.core.reliability`):

* runs on ``accelerator="cpu"`` too (DeepSpeed's CPU accelerator over gloo);
* the DeepSpeed config comes from a named preset plus ``config=``, checked for unknown keys, ``"auto"`` values
  resolved from Fabric (world size, precision) and the model's hidden size at ``fabric.setup``;
* ``torch.optim.Adam``/``AdamW``/``Adagrad`` become DeepSpeed's CPU versions under optimizer offload;
* lightspeed's process group (per-restart store prefix under ``torchrun --max-restarts``, heartbeat, named hangs);
* ``fabric.clip_gradients(max_norm=...)`` clips inside DeepSpeed's next step (where the partitioned gradients are)
  and returns the total norm, filled in by that step;
* ``fabric.save``/``fabric.load`` write and read the Trainer strategy's checkpoint layout through a staging directory
  committed only when every rank finished, so ``lightspeed export`` reads it; loading checks the checkpoint first
  (truncated shard, another model: one error on every rank) and reshards one written by another number of processes;
  ``node_local_storage=True`` keeps each node's files on its own disk;
* the optimizer ``fabric.setup`` returns is a ``torch.optim.Optimizer``, so torch schedulers built on it afterwards
  (``StepLR(optimizer)``) set the learning rate the ZeRO step uses;
* HuggingFace models: ``from_pretrained`` under ``fabric.init_module()`` loads into ZeRO-3 partitions, and ``generate``
  keeps the ranks in step (:mod:`lightspeed.fabric.zero_models`);
* one optimizer, clipping by norm only, and unknown keywords are errors that say what to change;
* ``compile=True``, or a model compiled with ``torch.compile`` before ``fabric.setup`` (which Fabric would otherwise
  re-apply around the whole engine), compiles through DeepSpeed's own ``engine.compile()``
  (see :mod:`lightspeed.core.zero.compile`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from typing_extensions import override

from lightspeed.core.zero.compile import CompileRequest
from lightspeed.core.zero.config import AUTO
from lightspeed.core.zero.config.keywords import refuse_unknown_keywords
from lightspeed.core.zero.config.model_recipe import ModelRecipe, arguments_outside_recipe
from lightspeed.core.zero.parameter_checks import check_parameters_for_zero
from lightspeed.core.zero.runtime import zero_device_kind
from lightspeed.core.zero.session import ZeroConfigProperties, ZeroSession
from lightspeed.fabric.compile_takeover import FabricCompileTakeover
from lightspeed.fabric.process_group import ProcessGroupMixin
from lightspeed.fabric.sequence_parallel import SequenceParallelMixin
from lightspeed.fabric.zero_checkpoints import ZeroCheckpointsMixin
from lightspeed.fabric.zero_engine import ZeroEngineMixin
from lightspeed.fabric.zero_models import ZeroModelsMixin
from lightspeed.fabric.zero_step import ZeroBackwardSyncControl, ZeroStepMixin

__all__ = ["ZeroFabricStrategy"]


def _check_parameters_before_conversion(precision: Precision) -> None:
    """Make ``precision.convert_module`` (Fabric calls it in ``fabric.setup`` before the strategy sees the module)
    check the parameters first: a float64 parameter is still float64 there, not yet cast to float32."""
    convert = precision.convert_module
    if getattr(convert, "_lightspeed_checked", False):
        return

    def convert_module(module: Module) -> Module:
        check_parameters_for_zero(module)
        return convert(module)

    convert_module._lightspeed_checked = True  # type: ignore[attr-defined]
    precision.convert_module = convert_module  # type: ignore[method-assign]


class ZeroFabricStrategy(  # type: ignore[misc]  # `config`: the session's, never None (Lightning's may be)
    ZeroEngineMixin,
    ZeroConfigProperties,
    ProcessGroupMixin,
    SequenceParallelMixin,
    ZeroModelsMixin,
    ZeroStepMixin,
    ZeroCheckpointsMixin,
    DeepSpeedStrategy,
):
    """DeepSpeed ZeRO for Lightning Fabric, on ``accelerator="cuda"`` (nccl) and ``accelerator="cpu"`` (gloo).

    ``import lightspeed`` registers it for Fabric under the Trainer strategies' names (``zero1`` ... ``zero3_nvme``):
    ``Fabric(strategy="zero3_offload", accelerator="cpu", devices=2)``.

    Args:
        stage: ZeRO stage 0-3.
        offload_optimizer: ``"none"``, ``"cpu"`` or ``"nvme"`` (``True`` means ``"cpu"``).
        offload_parameters: ``"none"``, ``"cpu"`` or ``"nvme"``; stage 3 only.
        nvme_path: directory for NVMe offload; defaults to ``$LIGHTSPEED_NVME_PATH``.
        pin_memory: as for the Trainer's :class:`~lightspeed.strategies.ZeroStrategy`.
        reduce_bucket_size: as for the Trainer's :class:`~lightspeed.strategies.ZeroStrategy`.
        allgather_bucket_size: as for the Trainer's :class:`~lightspeed.strategies.ZeroStrategy`.
        prefetch_bucket_size: as for the Trainer's :class:`~lightspeed.strategies.ZeroStrategy`.
        param_persistence_threshold: as for the Trainer's :class:`~lightspeed.strategies.ZeroStrategy`.
        sub_group_size: as for the Trainer's :class:`~lightspeed.strategies.ZeroStrategy`.
        activation_checkpointing_policy: module classes (a set, e.g. ``{Block}``) whose instances' forward runs under
            ``deepspeed.checkpointing.checkpoint`` in training, applied at ``fabric.setup`` before the engine is built.
        partition_activations: DeepSpeed's ``activation_checkpointing`` section, as for the Trainer's
            :class:`~lightspeed.strategies.ZeroStrategy` (``"auto"`` resolved the same way).
        cpu_checkpointing: DeepSpeed's ``activation_checkpointing`` section, as for the Trainer's
            :class:`~lightspeed.strategies.ZeroStrategy` (``"auto"`` resolved the same way).
        contiguous_memory_optimization: DeepSpeed's ``activation_checkpointing`` section, as for the Trainer's
            :class:`~lightspeed.strategies.ZeroStrategy` (``"auto"`` resolved the same way).
        number_checkpoints: DeepSpeed's ``activation_checkpointing`` section, as for the Trainer's
            :class:`~lightspeed.strategies.ZeroStrategy` (``"auto"`` resolved the same way).
        synchronize_checkpoint_boundary: DeepSpeed's ``activation_checkpointing`` section, as for the Trainer's
            :class:`~lightspeed.strategies.ZeroStrategy` (``"auto"`` resolved the same way).
        profile: DeepSpeed's ``activation_checkpointing`` section, as for the Trainer's
            :class:`~lightspeed.strategies.ZeroStrategy` (``"auto"`` resolved the same way).
        bf16_master_weights_and_grads: keep the master weights and their gradients in bf16 instead of fp32
            (DeepSpeed's low-memory states; needs precision="bf16-mixed" or "bf16-true"): 4 bytes less per trained
            parameter, at a cost in accuracy measured in ``bench/low_memory_states.py``.
        bf16_optimizer_states: also keep the optimizer moments in bf16 (needs ``bf16_master_weights_and_grads``):
            another 4 bytes less per trained parameter with Adam.
        config: DeepSpeed config dict or JSON path merged over the preset (its values win); unknown keys and values
            that contradict Fabric's settings are errors.
        accelerator: Fabric's accelerator (set by Fabric from ``Fabric(accelerator=...)``).
        parallel_devices: the devices of this node (set by Fabric from ``Fabric(devices=...)``).
        cluster_environment: Lightning's cluster environment (torchrun, SLURM, ...; set by Fabric).
        precision: Fabric's precision plugin (set by Fabric from ``Fabric(precision=...)``).
        process_group_backend: ``"nccl"`` or ``"gloo"``; ``None``: ``"nccl"`` on CUDA, ``"gloo"`` on the CPU.
        timeout: how long a collective may wait for the other ranks before a ``CollectiveTimeoutError`` names the
            collective and the rank that stopped answering.
        logging_level: the level of DeepSpeed's logger.
        exclude_frozen_parameters: leave parameters with ``requires_grad=False`` out of checkpoints. ``"auto"``
            (default): when the model holds a PEFT model (``peft.get_peft_model``), whose frozen base comes back from
            the pretrained files; the save records a fingerprint of them, and resuming with other frozen weights is an
            error.
        load_full_weights: ``fabric.load`` reads a single consolidated weights file under ZeRO-3.
        node_local_storage: for clusters whose nodes share no filesystem: each node writes its own ranks' shards (and
            the files every node needs) into its own local checkpoint directory (as the Trainer's).
        compile: compile the model with DeepSpeed's ``engine.compile()`` at ``fabric.setup``. A model compiled with
            ``torch.compile`` before ``fabric.setup`` is compiled the same way, with its ``torch.compile``
            arguments, instead of Fabric compiling the whole engine.
        compile_kwargs: ``torch.compile`` arguments for ``engine.compile()``; given alone, it asks for compilation
            too.
        leaf_modules: the modules ZeRO-3 gathers whole when they are called, marked at ``fabric.setup`` before the
            engine is built: ``"auto"``, the model's mixture-of-experts blocks (ranks whose tokens reach different
            experts stay in step), else module classes, class names or ends of module names, or ``None``; as for the
            Trainer's :class:`~lightspeed.strategies.ZeroStrategy`.
        sequence_parallel_size: split every sequence over groups of this many ranks, as for the Trainer's
            :class:`~lightspeed.strategies.ZeroStrategy`: the loaders of ``fabric.setup_dataloaders`` yield each
            rank's slice, and the loop calls ``model(**batch)`` with it. 1 (default): off.
        tiled_mlp: as for the Trainer's :class:`~lightspeed.strategies.ZeroStrategy`.
        tiled_logits_loss: as for the Trainer's :class:`~lightspeed.strategies.ZeroStrategy`.
        unused_parameters: what a step does to the parameters no rank used in it, as for the Trainer's
            :class:`~lightspeed.strategies.ZeroStrategy`: ``"skip"`` (default, as one process) or ``"zero_gradient"``.
        **unsupported: none is taken: a keyword the Fabric strategy does not take (e.g. ``sync_with_dataloader``,
            ``offload_params_device``) is a ``TypeError`` saying what to use instead.
    """

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
        activation_checkpointing_policy: Collection[type[Module]] | type[Module] | None = None,
        partition_activations: bool | str = "auto",
        cpu_checkpointing: bool | str = "auto",
        contiguous_memory_optimization: bool | str = "auto",
        number_checkpoints: int | None = None,
        synchronize_checkpoint_boundary: bool = False,
        profile: bool = False,
        bf16_master_weights_and_grads: bool = False,
        bf16_optimizer_states: bool = False,
        config: _PATH | dict[str, Any] | None = None,
        accelerator: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any | None = None,
        precision: Any | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        logging_level: int = logging.WARN,
        exclude_frozen_parameters: bool | str = "auto",
        load_full_weights: bool = False,
        node_local_storage: bool = False,
        compile: bool = False,
        compile_kwargs: dict[str, Any] | None = None,
        leaf_modules: Collection[type[Module] | str] | type[Module] | str | None = "auto",
        sequence_parallel_size: int = 1,
        tiled_mlp: bool = False,
        tiled_logits_loss: bool | int = False,
        unused_parameters: str = "skip",
        **unsupported: Any,
    ) -> None:
        refuse_unknown_keywords(type(self).__name__, unsupported, ZeroFabricStrategy, "Fabric")
        recipe_of_models = ModelRecipe.from_arguments(locals(), front_end="Fabric")
        recipe = recipe_of_models.config()
        self._init_lightning(recipe, {**locals(), "activation_checkpointing_policy": recipe_of_models.tuning.policy})
        self._init_several_models(recipe_of_models.for_model)

    @property
    @override
    def precision(self) -> Precision:
        return DeepSpeedStrategy.precision.fget(self)  # type: ignore[attr-defined]

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        if precision is not None:
            _check_parameters_before_conversion(precision)
        DeepSpeedStrategy.precision.fset(self, precision)  # type: ignore[attr-defined]

    def _init_lightning(self, recipe: dict[str, Any], arguments: Mapping[str, Any]) -> None:
        """Lightning Fabric's ``DeepSpeedStrategy`` set-up around an already built config (``"auto"`` values kept
        until the process group exists; ``arguments``: those of ``__init__`` by name, the parsed policy)."""
        self._session = ZeroSession.from_arguments(recipe, arguments, type(self).__name__, "Fabric", rank_zero_info)
        strategy_kwargs = arguments_outside_recipe(arguments, DeepSpeedStrategy.__init__)
        self._compile_takeover = FabricCompileTakeover()  # catches Fabric re-applying torch.compile
        super().__init__(config=recipe, **strategy_kwargs)
        self._backward_sync_control = ZeroBackwardSyncControl()  # Lightning's is None: the call would be ignored
        self._recipe = recipe  # unresolved: resolved again at setup once the model is known
        self._sharded_init = False  # init_module() built the model under this config (ZeRO-3 partitioned)
        self._config_scheduler: Any = None  # the DeepSpeed config's scheduler, under config_optimizer()
        self._init_several_models(None)  # ZeroFabricStrategy gives each model's recipe; zero_auto has none

    @property
    def accumulation_steps_in_config(self) -> int | None:
        """``gradient_accumulation_steps`` as written in the user's config (None: ``"auto"`` or absent)."""
        value = self._recipe.get("gradient_accumulation_steps", AUTO)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def _device_kind(self) -> str:
        return zero_device_kind(self.accelerator)

    # ------------------------------------------------------------------ before any process starts
    @override
    def _configure_launcher(self) -> None:
        # Runs in Fabric.__init__, before launching: checks that must fail early, environment the ranks inherit.
        self._session.check_before_launch(self._device_kind(), self.precision.precision, self)
        super()._configure_launcher()

    # ------------------------------------------------------------------ process setup
    @override
    def setup_environment(self) -> None:
        kind = self._device_kind()
        self._session.start_process(kind, self)
        if kind == "cuda":
            super().setup_environment()  # Lightning's CUDA check, device selection and process group
            return
        DDPStrategy.setup_environment(self)  # device set-up, then our _setup_distributed

    @override
    def _set_main_address(self) -> None:
        self._set_node_environment_variables()  # DeepSpeed's rank variables too

    @override
    def _setup_distributed(self) -> None:
        if self._device_kind() == "cuda":
            super()._setup_distributed()  # lightspeed's group (ProcessGroupMixin), then Lightning's CUDA set-up
            return
        # CPU devices carry no index, so Lightning's CUDA index check does not apply; DeepSpeed adopts the group.
        with self._lightspeed_process_group():
            reset_seed()
            self._set_world_ranks()
            self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True

    @override
    def teardown(self) -> None:
        self._compile_takeover.drop()
        try:
            super().teardown()
        finally:
            self._session.end_process()

    # ------------------------------------------------------------------ torch.compile
    @property
    def compile_request(self) -> CompileRequest | None:
        """What ``engine.compile()`` was called with at the last ``fabric.setup`` (the strategy's arguments, or those
        of a model compiled with ``torch.compile``), else what it will be called with (None: not compiled)."""
        return self._session.compiled_with or self._session.compile_request

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._compile_takeover.drop()  # fabric.setup is over
        try:
            result = super().optimizer_step(optimizer, **kwargs)
        finally:
            self._session.undo_step_overrides()
        # what engine.step() does and Fabric's optimizer.step() bypasses (the step count, the gradient norm)
        self._session.count_step(self._engine_stepping(optimizer), optimizer, self._config_scheduler)
        return result
