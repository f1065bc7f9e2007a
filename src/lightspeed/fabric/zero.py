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

from collections.abc import Mapping
from typing import Any

from lightning.fabric.plugins import Precision
from lightning.fabric.strategies import DeepSpeedStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.seed import reset_seed
from torch.nn import Module
from typing_extensions import Unpack, override

from lightspeed.core.zero.compile import CompileRequest
from lightspeed.core.zero.config import AUTO
from lightspeed.core.zero.config.arguments import strategy_arguments
from lightspeed.core.zero.config.model_recipe import arguments_outside_recipe
from lightspeed.core.zero.parameter_checks import check_parameters_for_zero
from lightspeed.core.zero.runtime import zero_device_kind
from lightspeed.core.zero.session import ZeroConfigProperties, ZeroSession
from lightspeed.fabric.compile_takeover import FabricCompileTakeover
from lightspeed.fabric.process_group import ProcessGroupMixin
from lightspeed.fabric.sequence_parallel import SequenceParallelMixin
from lightspeed.fabric.zero_checkpoints import ZeroCheckpointsMixin
from lightspeed.fabric.zero_engine import ZeroEngineMixin
from lightspeed.fabric.zero_keywords import FABRIC_DEFAULTS, FabricZeroKeywords
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
        **arguments: :class:`~lightspeed.fabric.zero_keywords.FabricZeroKeywords`, each with its default when left
            out: the ZeRO arguments of every front end, as for the Trainer's
            :class:`~lightspeed.strategies.ZeroStrategy` (:class:`~lightspeed.core.zero.config.arguments.ZeroKeywords`:
            ``stage``, ``offload_optimizer``, ``offload_parameters``, ``nvme_path``, ``config``, bucket sizes,
            activation checkpointing, low-memory states, ``leaf_modules``, checkpoint options, ``compile``, sequence
            parallelism and tiling, ``unused_parameters``, ``timeout``, ...; applied at ``fabric.setup``, where the
            loaders of ``fabric.setup_dataloaders`` yield each rank's sequence slice) and ``precision``, set by
            Fabric. A keyword the Fabric strategy does not take (e.g. ``sync_with_dataloader``,
            ``offload_params_device``) is a ``TypeError`` saying what to use instead.
    """

    _rank_variables = True  # DeepSpeed reads RANK, WORLD_SIZE and LOCAL_RANK

    def __init__(self, **arguments: Unpack[FabricZeroKeywords]) -> None:
        owner = type(self).__name__
        recipe, given = strategy_arguments(arguments, ZeroFabricStrategy, owner, "Fabric", FABRIC_DEFAULTS)
        self._init_lightning(recipe.config(), given)
        self._init_several_models(recipe.for_model)

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
        # Lightning's DeepSpeed set-up refuses the CPU: the device, then the session's steps for CUDA and the CPU
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        steps = (reset_seed, self._set_world_ranks, self._init_deepspeed_distributed, self._init_config_if_needed)
        group = self._lightspeed_process_group()
        self._session.start_process(self._device_kind(), self, process_group=group, steps=steps)

    def _init_config_if_needed(self) -> None:
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
