"""How the Fabric ZeRO strategy builds its engines: the config resolved from Fabric's settings and the model (once
``fabric.init_module()`` built it partitioned, the config it was built under), the optimizer made ready for the
config (or the config's own, :func:`~lightspeed.fabric.config_optimizer`), the engine built by the session, and a
model set up without an optimizer."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.activation_checkpointing import configure_deepspeed_checkpointing
from lightspeed.core.zero.config import TrainingFacts, find_hidden_size
from lightspeed.core.zero.engine import one_optimizer_error
from lightspeed.core.zero.generation import keep_generation_in_step
from lightspeed.core.zero.parameter_checks import check_partitions_kept
from lightspeed.core.zero.schedulable import make_schedulable
from lightspeed.fabric.config_optimizer import ConfigOptimizer
from lightspeed.fabric.keywords import SEVERAL_MODELS
from lightspeed.fabric.zero_base import ZeroStrategyBase

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from lightspeed.fabric.compile_takeover import FabricCompileTakeover

__all__ = ["ZeroEngineMixin"]


class ZeroEngineMixin(ZeroStrategyBase):
    """The engine construction of :class:`~lightspeed.fabric.ZeroFabricStrategy` (its first base)."""

    _recipe: dict[str, Any]
    _sharded_init: bool
    _config_scheduler: Any
    _compile_takeover: FabricCompileTakeover

    if TYPE_CHECKING:  # the strategy's own

        def _device_kind(self) -> str: ...

        @property
        def accumulation_steps_in_config(self) -> int | None: ...

    # ------------------------------------------------------------------ config resolution
    def _resolve(self, module: Module | None) -> list[str]:
        """Resolve the recipe's ``"auto"`` values from Fabric's settings (and the model's hidden size when
        ``module`` is given) into ``self.config``; returns the notes to log."""
        return self._session.resolve(self._recipe, self._facts(module))

    def _facts(self, module: Module | None) -> TrainingFacts:
        """What the ``"auto"`` values are resolved from: Fabric's settings, and ``module``'s hidden size if given."""
        accumulation = self.accumulation_steps_in_config or 1
        return TrainingFacts(
            world_size=self.world_size,
            micro_batch_size=None,  # Fabric does not tell the strategy its loaders; DeepSpeed uses it for logs only
            accumulate_grad_batches=accumulation,
            gradient_clip_val=None,  # fabric.clip_gradients clips per step
            precision=self.precision.precision,
            hidden_size=find_hidden_size(module) if module is not None else None,
            front_end="Fabric",
        )

    @override
    def _format_config(self) -> None:
        # At launch: the config ``fabric.init_module()`` (``deepspeed.zero.Init``) builds the model with. The model's
        # hidden size is not known yet; ``fabric.setup`` resolves again with it unless init_module already used it.
        self._resolve(None)

    def _check_sharded_init(self, module: Module) -> None:
        """Refuse parameters that ``fabric.init_module()`` under ZeRO-3 left unpartitioned and empty."""
        if self._sharded_init and self.zero_stage_3:
            check_partitions_kept(module, "`fabric.init_module()`", "outside `fabric.init_module()`")

    def _final_config(self, module: Module) -> None:
        self._check_sharded_init(module)
        notes = [] if self._sharded_init else self._resolve(module)
        # (Fabric gives no micro-batch size; DeepSpeed only logs throughput with it)
        self._session.log_config([note for note in notes if "train_micro_batch_size_per_gpu" not in note])

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        if self.zero_stage_3:
            self._sharded_init = True
        return super().module_sharded_context()

    # ------------------------------------------------------------------ engine construction
    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[DeepSpeedEngine, list[Optimizer], Any]:
        with self._engine_config(module):
            engine, returned, deepspeed_scheduler = self._setup_engine(module, optimizers, scheduler)
            self._record_engine(module, engine, returned[0])
        return engine, returned, deepspeed_scheduler

    def _setup_engine(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None
    ) -> tuple[DeepSpeedEngine, list[Optimizer], Any]:
        if len(optimizers) != 1:
            raise one_optimizer_error(f"{len(optimizers)} optimizers", "`fabric.setup` got", SEVERAL_MODELS)
        self._final_config(module)
        optimizer: Optimizer | None
        if isinstance(optimizers[0], ConfigOptimizer):
            if not isinstance(self.config.get("optimizer"), dict):
                raise DeepSpeedConfigError(
                    "`lightspeed.fabric.config_optimizer()` stands for the optimizer of the DeepSpeed config, but the "
                    'config has no "optimizer" section. Add one, or pass a torch optimizer to `fabric.setup`.'
                )
            optimizer = None
        else:
            optimizer = self._session.prepare_optimizer(optimizers[0], scheduler)
        engine, deepspeed_optimizer, deepspeed_scheduler = self._session.build_engine(module, optimizer, scheduler)
        if optimizer is None and scheduler is None:
            # the config's scheduler: stepped with every optimizer step, as engine.step() would; not handed to Fabric,
            # so `fabric.setup` returns (model, optimizer) as asked
            self._config_scheduler, deepspeed_scheduler = deepspeed_scheduler, None
        self._deepspeed_engine = self._with_named_hangs(engine)
        self._set_deepspeed_activation_checkpointing()
        keep_generation_in_step(module)
        self._compile_takeover.arm(self._session, engine, self._device_kind())
        # torch schedulers built on the returned optimizer (`StepLR(optimizer)`) need a torch.optim.Optimizer
        return engine, [make_schedulable(deepspeed_optimizer)], deepspeed_scheduler

    @override
    def _set_deepspeed_activation_checkpointing(self) -> None:
        # Lightning's passes 4 of the section's 6 keys to deepspeed.checkpointing.configure, which resets the others
        configure_deepspeed_checkpointing(self.config)

    @override
    def setup_module(self, module: Module) -> DeepSpeedEngine:
        with self._engine_config(module):
            self._final_config(module)
            engine, _, _ = self._session.build_engine(module, None, None, training=False)
            self._deepspeed_engine = self._with_named_hangs(engine)
            keep_generation_in_step(module)
            self._compile_takeover.arm(self._session, engine, self._device_kind())
            self._record_engine(module, engine, None)
        return self._deepspeed_engine

    @override
    def _initialize_engine(
        self, model: Module, optimizer: Optimizer | None = None, scheduler: Any | None = None
    ) -> tuple[DeepSpeedEngine, Optimizer, Any]:
        return self._session.build_engine(model, optimizer, scheduler)
