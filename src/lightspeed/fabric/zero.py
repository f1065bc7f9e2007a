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

import inspect
import logging
import os
import weakref
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.fabric.plugins import Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.fabric.strategies.deepspeed import _get_deepspeed_engines_from_state, _validate_state_keys
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.fabric.wrappers import _FabricModule
from torch._dynamo import OptimizedModule
from torch.nn import Module
from torch.nn.modules.module import register_module_module_registration_hook
from torch.optim import Optimizer
from typing_extensions import override

from lightspeed.core.checkpoint.loading import is_export, read_exported
from lightspeed.core.errors import CheckpointError, DeepSpeedConfigError
from lightspeed.core.reliability.launched_world import check_launched_world, external_launcher
from lightspeed.core.reliability.node_local import describe_position, node_local_path
from lightspeed.core.reliability.staged_saver import StagedCheckpointSaver
from lightspeed.core.zero import load_policy
from lightspeed.core.zero import third_party_warnings as _third_party_warnings
from lightspeed.core.zero.accumulation import (
    clip_norm_at_step,
    scale_deepspeed_gradients_at_step,
    set_deepspeed_boundary,
)
from lightspeed.core.zero.activation_checkpointing import apply_policy, configure_deepspeed_checkpointing
from lightspeed.core.zero.compile import (
    CompileRequest,
    check_compile_supported,
    check_zero3_module_compiles,
    compile_engine,
    compile_request,
    prepare_zero3_for_compile,
    request_from_kwargs,
)
from lightspeed.core.zero.config import (
    AUTO,
    TrainingFacts,
    ZeroConfigProperties,
    describe_config,
    find_hidden_size,
    resolve_config_with_notes,
)
from lightspeed.core.zero.config.activation import Policy
from lightspeed.core.zero.config.model_recipe import ModelRecipe
from lightspeed.core.zero.engine import (
    initialize_engine,
    one_optimizer_error,
    prepare_deepspeed_process,
    prepare_optimizer,
    save_zero_checkpoint,
)
from lightspeed.core.zero.generation import keep_generation_in_step
from lightspeed.core.zero.parameter_checks import check_parameters_for_zero, check_partitions_kept
from lightspeed.core.zero.runtime import check_precision_supported, export_deepspeed_accelerator, zero_device_kind
from lightspeed.core.zero.schedulable import make_schedulable
from lightspeed.core.zero.weights import load_full_state_dict
from lightspeed.fabric.process_group import ProcessGroupMixin
from lightspeed.fabric.several_models import SeveralModelsMixin
from lightspeed.fabric.zero_models import ZeroModelsMixin

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.utils.hooks import RemovableHandle

__all__ = ["ConfigOptimizer", "ZeroFabricStrategy", "config_optimizer", "named_arguments", "unknown_keywords_error"]

#: how this front end trains several models, each with its own optimizer (for the one-optimizer error)
_SEVERAL_MODELS = (
    "set each up with its own optimizer: `fabric.setup(generator, opt_g)`, `fabric.setup(discriminator, opt_d)`"
)


class ConfigOptimizer:
    """Stands for the optimizer the DeepSpeed config's ``"optimizer"`` section describes (see
    :func:`config_optimizer`)."""


def config_optimizer() -> ConfigOptimizer:
    """Pass to ``fabric.setup`` for the optimizer (and scheduler) of the DeepSpeed config::

        model, optimizer = fabric.setup(model, lightspeed.fabric.config_optimizer())

    DeepSpeed builds them from the config's ``"optimizer"``/``"scheduler"`` sections; ``optimizer.step()`` then
    steps the config's scheduler too, as ``engine.step()`` does (a scheduler ``"auto"`` peak LR is the config
    optimizer's ``lr``)."""
    return ConfigOptimizer()


# Keywords of Lightning Fabric's own DeepSpeedStrategy (or of lightspeed's Trainer strategy) that this strategy does
# not take, with what to do instead.
_CONFIG_HINT = "write it into the DeepSpeed config instead: ZeroFabricStrategy(config={...})"
_REFUSED_KEYWORDS: dict[str, str] = {
    "sync_with_dataloader": "it is how the Trainer's loop ends an epoch; in a Fabric loop use "
    "`lightspeed.fabric.accumulate(fabric, model, loader, steps=N)`, which steps the short last window of an epoch "
    "with its gradient scaled to its real size",
    "precision_plugin": "pass the precision to Fabric: Fabric(precision='bf16-mixed')",
    "zero_optimization": "pick the stage with the strategy name (zero1 ... zero3) or `stage=`",
    "remote_device": "offload parameters with `offload_parameters='cpu'` or `'nvme'`",
    "offload_params_device": "use `offload_parameters='cpu'` or `offload_parameters='nvme'`",
    "offload_optimizer_device": "use `offload_optimizer='cpu'` or `offload_optimizer='nvme'`",
    "logging_batch_size_per_gpu": "set `train_micro_batch_size_per_gpu` in the DeepSpeed config",
}
_CONFIG_KEYWORDS = (
    "params_buffer_count",
    "params_buffer_size",
    "max_in_cpu",
    "optimizer_buffer_count",
    "block_size",
    "queue_depth",
    "single_submit",
    "overlap_events",
    "thread_count",
    "contiguous_gradients",
    "overlap_comm",
    "allgather_partitions",
    "reduce_scatter",
    "zero_allow_untested_optimizer",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
)


def unknown_keywords_error(cls_name: str, keywords: dict[str, Any]) -> TypeError:
    """The error for keywords a Fabric ZeRO strategy does not take, each with what to do instead."""
    lines = []
    for name in sorted(keywords):
        if name in _REFUSED_KEYWORDS:
            lines.append(f"`{name}`: {_REFUSED_KEYWORDS[name]}")
        elif name in _CONFIG_KEYWORDS:
            lines.append(f"`{name}`: {_CONFIG_HINT}")
        else:
            lines.append(f"`{name}`: not a keyword of {cls_name}")
    return TypeError(
        f"{cls_name} does not take "
        + ", ".join(f"`{name}`" for name in sorted(keywords))
        + ".\n  - "
        + "\n  - ".join(lines)
        + f"\n{cls_name} takes: {', '.join(named_arguments(ZeroFabricStrategy))}."
    )


def named_arguments(cls: type) -> list[str]:
    """The keyword arguments ``cls(...)`` declares by name, in order (from its signature: never a hand-kept list)."""
    return [
        name
        for name, parameter in inspect.signature(cls).parameters.items()
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


_ZERO3_LATE_COMPILE = (
    "Hand `fabric.setup` the model uncompiled, with `ZeroFabricStrategy(stage=3, ..., compile=True)` (lightspeed marks "
    "them before building the engine), or mark them yourself before `fabric.setup`: "
    "`deepspeed.utils.set_z3_leaf_modules(model, [torch.nn.MultiheadAttention])`."
)


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled=...)`` under ZeRO: the engine learns that the backward passes inside
    the block do not close the accumulation window, so every stage accumulates them and the first backward outside
    reduces the whole window (Lightning's DeepSpeed strategy ignores the call, which leaves ZeRO-1/2 about 1e-2 off
    the big-batch step)."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return _inside_the_window(module) if enabled else nullcontext()


@contextmanager
def _inside_the_window(engine: Any) -> Iterator[None]:
    set_deepspeed_boundary(engine, False)
    try:
        yield
    finally:
        set_deepspeed_boundary(engine, True)


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


class ZeroFabricStrategy(
    ZeroConfigProperties, ProcessGroupMixin, ZeroModelsMixin, SeveralModelsMixin, DeepSpeedStrategy
):
    """DeepSpeed ZeRO for Lightning Fabric, on ``accelerator="cuda"`` (nccl) and ``accelerator="cpu"`` (gloo).

    ``import lightspeed`` registers it for Fabric under the Trainer strategies' names (``zero1`` ... ``zero3_nvme``):
    ``Fabric(strategy="zero3_offload", accelerator="cpu", devices=2)``.

    Args:
        stage: ZeRO stage 0-3.
        offload_optimizer: ``"none"``, ``"cpu"`` or ``"nvme"`` (``True`` means ``"cpu"``).
        offload_parameters: ``"none"``, ``"cpu"`` or ``"nvme"``; stage 3 only.
        nvme_path: directory for NVMe offload; defaults to ``$LIGHTSPEED_NVME_PATH``.
        pin_memory, reduce_bucket_size, allgather_bucket_size, prefetch_bucket_size, param_persistence_threshold,
            sub_group_size: as for the Trainer's :class:`~lightspeed.strategies.ZeroStrategy`.
        activation_checkpointing_policy: module classes (a set, e.g. ``{Block}``) whose instances' forward runs under
            ``deepspeed.checkpointing.checkpoint`` in training, applied at ``fabric.setup`` before the engine is built.
        partition_activations, cpu_checkpointing, contiguous_memory_optimization, number_checkpoints,
            synchronize_checkpoint_boundary, profile: DeepSpeed's ``activation_checkpointing`` section, ``"auto"``
            resolved as for the Trainer's :class:`~lightspeed.strategies.ZeroStrategy`.
        config: DeepSpeed config dict or JSON path merged over the preset (its values win); unknown keys and values
            that contradict Fabric's settings are errors.
        exclude_frozen_parameters: leave frozen parameters out of checkpoints.
        load_full_weights: ``fabric.load`` reads a single consolidated weights file under ZeRO-3.
        node_local_storage: for clusters whose nodes share no filesystem: each node writes its own ranks' shards (and
            the files every node needs) into its own local checkpoint directory (as the Trainer's).
        compile: compile the model with DeepSpeed's ``engine.compile()`` at ``fabric.setup``. A model compiled with
            ``torch.compile`` before ``fabric.setup`` is compiled the same way, with its ``torch.compile``
            arguments, instead of Fabric compiling the whole engine.
        compile_kwargs: ``torch.compile`` arguments for ``engine.compile()``; given alone, it asks for compilation
            too.
        Other arguments: Fabric's (set by Fabric itself when the strategy is chosen by name).
    """

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
        activation_checkpointing_policy: Collection[type[Module]] | type[Module] | None = None,
        partition_activations: bool | str = "auto",
        cpu_checkpointing: bool | str = "auto",
        contiguous_memory_optimization: bool | str = "auto",
        number_checkpoints: int | None = None,
        synchronize_checkpoint_boundary: bool = False,
        profile: bool = False,
        config: _PATH | dict[str, Any] | None = None,
        accelerator: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any | None = None,
        precision: Any | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        logging_level: int = logging.WARN,
        exclude_frozen_parameters: bool = False,
        load_full_weights: bool = False,
        node_local_storage: bool = False,
        compile: bool = False,
        compile_kwargs: dict[str, Any] | None = None,
        **unsupported: Any,
    ) -> None:
        if unsupported:
            raise unknown_keywords_error(type(self).__name__, unsupported)
        recipe_of_models = ModelRecipe.from_arguments(locals(), front_end="Fabric")
        recipe = recipe_of_models.config()
        self._init_lightning(
            recipe,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            logging_level=logging_level,
            exclude_frozen_parameters=exclude_frozen_parameters,
            load_full_weights=load_full_weights,
            node_local_storage=node_local_storage,
            compile=compile,
            compile_kwargs=compile_kwargs,
            activation_checkpointing_policy=recipe_of_models.tuning.policy,
        )
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

    def _init_lightning(
        self,
        recipe: dict[str, Any],
        *,
        node_local_storage: bool = False,
        compile: bool = False,
        compile_kwargs: dict[str, Any] | None = None,
        activation_checkpointing_policy: Policy | None = None,
        **strategy_kwargs: Any,
    ) -> None:
        """Lightning Fabric's ``DeepSpeedStrategy`` set-up around an already built config (``"auto"`` values kept
        until the process group exists)."""
        self._compile_request = compile_request(compile, compile_kwargs, type(self).__name__)
        self.activation_checkpointing_policy = activation_checkpointing_policy  # applied before the engine is built
        self._compiled_with: CompileRequest | None = None  # what the last engine was compiled with
        self._compile_hook: RemovableHandle | None = None  # catches Fabric re-applying torch.compile, see below
        if node_local_storage:
            recipe.setdefault("checkpoint", {})["use_node_local_storage"] = True
        super().__init__(config=recipe, **strategy_kwargs)
        self._backward_sync_control = _ZeroBackwardSyncControl()  # Lightning's is None: the call would be ignored
        self._recipe = recipe  # unresolved: resolved again at setup once the model is known
        self.config = recipe
        self._saver = StagedCheckpointSaver()
        self._sharded_init = False  # init_module() built the model under this config (ZeRO-3 partitioned)
        self._config_logged = False
        self._step_restores: list[Callable[[], None]] = []  # undo per-step overrides after the next step
        self._pending_norm: torch.Tensor | None = None  # returned by clip_gradients, filled by the next step
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
        kind = self._device_kind()
        check_precision_supported(kind, self.precision.precision)
        if self._compile_request is not None:
            check_compile_supported(self._compile_request, self.config, kind)
        export_deepspeed_accelerator(kind)
        check_launched_world(
            *external_launcher(self.cluster_environment), self.num_nodes, self.num_processes, front_end="Fabric"
        )
        super()._configure_launcher()

    # ------------------------------------------------------------------ process setup
    @override
    def setup_environment(self) -> None:
        _third_party_warnings.install()
        kind = self._device_kind()
        prepare_deepspeed_process(kind, self.uses_nvme)
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
        self._drop_compile_hook()
        try:
            super().teardown()
        finally:
            _third_party_warnings.uninstall()

    # ------------------------------------------------------------------ torch.compile
    @property
    def compile_request(self) -> CompileRequest | None:
        """What ``engine.compile()`` was called with at the last ``fabric.setup`` (the strategy's arguments, or those
        of a model compiled with ``torch.compile``), else what it will be called with (None: not compiled)."""
        return self._compiled_with or self._compile_request

    def _prepare_compile(self, module: Module) -> None:
        """Before the engine is built, under ``compile=True``: refuse what DeepSpeed cannot compile, mark ZeRO-3 leaf
        modules."""
        if self._compile_request is None:
            return
        check_compile_supported(self._compile_request, self.config, self._device_kind())
        marked = prepare_zero3_for_compile(module, self.config)
        if marked:
            rank_zero_info(
                f"lightspeed: ZeRO-3 leaf modules for the compiled forward (all their parameters gathered on entry): "
                f"{', '.join(marked)}"
            )

    def _compile(self, engine: DeepSpeedEngine, request: CompileRequest) -> None:
        rank_zero_info(f"lightspeed: {request.source} runs as DeepSpeed's {request.describe()}")
        compile_engine(engine, request)
        self._compiled_with = request

    def _compile_set_up(self, engine: DeepSpeedEngine) -> None:
        """Compile the new engine as the strategy's arguments ask, and catch Fabric re-applying ``torch.compile``
        to it.

        ``fabric.setup`` unwraps a model compiled with ``torch.compile`` before handing it to the strategy, then
        compiles what the strategy returned (``torch.compile(engine, **kwargs)``: DeepSpeed's whole forward, hooks
        included) and wraps that in its ``_FabricModule``, all after this strategy returns. A one-shot module
        registration hook sees the ``_FabricModule`` take the compiled engine, compiles the engine with
        ``engine.compile()`` and the same ``torch.compile`` arguments instead (the strategy's own, when it has
        them), and hands Fabric the engine itself.
        """
        if self._compile_request is not None:
            self._compile(engine, self._compile_request)
        self._drop_compile_hook()
        armed = True
        strategy, set_up = weakref.ref(self), weakref.ref(engine)  # an armed hook keeps neither alive

        def take_over_fabric_compile(parent: Module, name: str, submodule: Module | None) -> Module | None:
            nonlocal armed
            if not armed or name != "_forward_module" or not isinstance(parent, _FabricModule):
                return None
            armed = False  # the first _FabricModule after this setup; the hook itself goes at the next step
            engine, owner = set_up(), strategy()
            if engine is None or owner is None:
                return None
            if not (isinstance(submodule, OptimizedModule) and submodule._orig_mod is engine):
                return None
            # (Lightning's torch.compile records its arguments as `_compile_kwargs` on the module it compiled, i.e.
            # on the engine, where DeepSpeed keeps those of engine.compile(): read them, then compile over them)
            request = request_from_kwargs(getattr(submodule, "_compile_kwargs", None), "torch.compile(model)")
            if engine.is_compiled and owner._compiled_with is not None:  # compiled by the strategy's arguments
                cast(Any, engine)._compile_kwargs = dict(owner._compiled_with.kwargs)
                return engine
            check_compile_supported(request, owner.config, owner._device_kind())
            wrapped = engine.module
            assert isinstance(wrapped, Module)
            check_zero3_module_compiles(request, wrapped, owner.config, instead=_ZERO3_LATE_COMPILE)
            owner._compile(engine, request)
            return engine

        # (a hook cannot remove itself: torch is iterating over the hooks while it runs). torch types the hook as
        # returning None, but uses a returned module in place of the one assigned
        self._compile_hook = register_module_module_registration_hook(take_over_fabric_compile)  # type: ignore[arg-type]

    def _drop_compile_hook(self) -> None:
        if self._compile_hook is not None:
            self._compile_hook.remove()
            self._compile_hook = None

    # ------------------------------------------------------------------ config resolution
    def _resolve(self, module: Module | None) -> list[str]:
        """Resolve the recipe's ``"auto"`` values from Fabric's settings (and the model's hidden size when
        ``module`` is given) into ``self.config``; returns the notes to log."""
        self.config, notes = self._resolved(self._recipe, module)
        return notes

    def _resolved(self, recipe: dict[str, Any], module: Module | None) -> tuple[dict[str, Any], list[str]]:
        """``recipe`` with its ``"auto"`` values resolved from Fabric's settings and ``module``, and the notes."""
        accumulation = self.accumulation_steps_in_config or 1
        facts = TrainingFacts(
            world_size=self.world_size,
            micro_batch_size=None,  # Fabric does not tell the strategy its loaders; DeepSpeed uses it for logs only
            accumulate_grad_batches=accumulation,
            gradient_clip_val=None,  # fabric.clip_gradients clips per step
            precision=self.precision.precision,
            hidden_size=find_hidden_size(module) if module is not None else None,
            front_end="Fabric",
        )
        return resolve_config_with_notes(recipe, facts)

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
        if not self._sharded_init:
            notes = self._resolve(module)
        else:
            notes = []
        if not self._config_logged:
            for note in notes:
                if "train_micro_batch_size_per_gpu" not in note:  # DeepSpeed only logs throughput with it
                    rank_zero_info(f"lightspeed: {note}")
            rank_zero_info(f"lightspeed: resolved DeepSpeed config\n{describe_config(self.config)}")
            self._config_logged = True

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
            raise one_optimizer_error(f"{len(optimizers)} optimizers", "`fabric.setup` got", _SEVERAL_MODELS)
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
            optimizer, message = prepare_optimizer(optimizers[0], scheduler, self.config)
            if message is not None:
                rank_zero_info(message)
        message = apply_policy(module, self.activation_checkpointing_policy)
        if message is not None:
            rank_zero_info(message)
        self._prepare_compile(module)
        engine, deepspeed_optimizer, deepspeed_scheduler = self._initialize_engine(module, optimizer, scheduler)
        if optimizer is None and scheduler is None:
            # the config's scheduler: stepped with every optimizer step, as engine.step() would; not handed to Fabric,
            # so `fabric.setup` returns (model, optimizer) as asked
            self._config_scheduler, deepspeed_scheduler = deepspeed_scheduler, None
        self._deepspeed_engine = self._with_named_hangs(engine)
        self._set_deepspeed_activation_checkpointing()
        keep_generation_in_step(module)
        self._compile_set_up(engine)
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
            self._prepare_compile(module)
            engine, _, _ = self._initialize_engine(module)
            self._deepspeed_engine = self._with_named_hangs(engine)
            keep_generation_in_step(module)
            self._compile_set_up(engine)
            self._record_engine(module, engine, None)
        return self._deepspeed_engine

    @override
    def _initialize_engine(
        self, model: Module, optimizer: Optimizer | None = None, scheduler: Any | None = None
    ) -> tuple[DeepSpeedEngine, Optimizer, Any]:
        return initialize_engine(self.config, model, optimizer, scheduler, self.root_device.index, self.local_rank)

    # ------------------------------------------------------------------ clipping and the step
    @override
    def clip_gradients_norm(
        self,
        module: DeepSpeedEngine,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip the gradient norm to ``max_norm`` in DeepSpeed's next ``optimizer.step()`` (ZeRO clips there, on the
        partitioned gradients). Returns the total norm of the gradients before clipping, as Lightning's strategies
        do: a scalar tensor that the next ``optimizer.step()`` fills in (ZeRO measures the norm of the partitioned
        gradients during the step; NaN until then)."""
        if float(norm_type) != 2.0:
            raise DeepSpeedConfigError(
                f"DeepSpeed clips by the 2-norm only, but `fabric.clip_gradients(norm_type={norm_type})` was called. "
                "Drop norm_type."
            )
        configured = self.config.get("gradient_clipping", 0.0) or 0.0
        if configured and float(configured) != float(max_norm):
            raise DeepSpeedConfigError(
                f"gradient_clipping={configured} in the DeepSpeed config, but "
                f'`fabric.clip_gradients(max_norm={max_norm})`. Make them agree: set gradient_clipping to "auto" '
                "(or remove it) to clip per call, or call clip_gradients with the configured value."
            )
        self._step_restores.append(clip_norm_at_step(self._engine_for(module), float(max_norm)))
        if self._pending_norm is None:
            self._pending_norm = torch.full((), float("nan"))
        return self._pending_norm

    @override
    def clip_gradients_value(self, module: DeepSpeedEngine, optimizer: Optimizer, clip_val: float | int) -> None:
        raise DeepSpeedConfigError(
            f"`fabric.clip_gradients(clip_val={clip_val})` clips each gradient element by value, which DeepSpeed's "
            "ZeRO optimizers cannot do (they only clip the norm of the partitioned gradients). Use "
            f"`fabric.clip_gradients(model, optimizer, max_norm={clip_val})`."
        )

    def scale_next_step(self, factor: float, engine: Any = None) -> None:
        """Multiply the gradients the next ``optimizer.step()`` of ``engine`` (default: the last one used) uses by
        ``factor`` (inside the ZeRO optimizer, before clipping); used by :func:`lightspeed.fabric.accumulate` to close
        an exact accumulation window."""
        self._step_restores.append(scale_deepspeed_gradients_at_step(engine or self.model, factor))

    @property
    def step_pending(self) -> bool:
        """True while a per-step override (window factor, clipping) waits for ``optimizer.step()``."""
        return bool(self._step_restores)

    def _engine_for(self, module: Any) -> Any:
        return module if hasattr(module, "set_gradient_accumulation_boundary") else self.model

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._drop_compile_hook()  # fabric.setup is over
        try:
            result = super().optimizer_step(optimizer, **kwargs)
        finally:
            restores, self._step_restores = self._step_restores, []
            for restore in reversed(restores):
                restore()
        self._record_norm(optimizer)
        self._count_step(optimizer)
        return result

    def _count_step(self, optimizer: Any) -> None:
        """What ``engine.step()`` does and Fabric's ``optimizer.step()`` bypasses: count the step (a skipped one too, on
        fp16 overflow) and the samples, so checkpoints, their markers and a resumed engine know the step, and step the
        config's scheduler under :func:`config_optimizer`."""
        engine = self._engine_stepping(optimizer)
        if engine is None:
            return
        if getattr(optimizer, "overflow", False):
            engine.skipped_steps += 1
        elif self._config_scheduler is not None:
            self._config_scheduler.step()
        engine.global_steps += 1
        engine.global_samples += engine.train_batch_size()

    def _record_norm(self, optimizer: Any) -> None:
        """The total gradient norm the ZeRO optimizer measured in this step, into the engine (so
        ``engine.get_global_grad_norm()`` answers as after ``engine.step()``) and into the tensor ``clip_gradients``
        returned."""
        measured = getattr(optimizer, "_global_grad_norm", None)  # DeepSpeed's ZeRO optimizer, as Fabric passes it
        pending, self._pending_norm = self._pending_norm, None
        if measured is None:
            return
        value = float(measured)
        engine = self._engine_stepping(optimizer)
        if engine is not None:
            engine._global_grad_norm = value
        if pending is not None:
            pending.fill_(value)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save through DeepSpeed into a staging directory; commit it only when every rank has finished."""
        if storage_options is not None:
            raise TypeError(
                "`fabric.save(..., storage_options=...)` is not supported by ZeRO strategies: DeepSpeed writes the "
                "checkpoint files itself."
            )
        if filter is not None:
            raise TypeError(
                "`fabric.save(..., filter=...)` is not supported by ZeRO strategies: DeepSpeed saves the whole "
                "(sharded) model and optimizer. Export the weights you need with `lightspeed export` afterwards."
            )
        engines = _get_deepspeed_engines_from_state(state)
        if not engines:
            raise ValueError(
                "`fabric.save` under ZeRO needs the model set up by `fabric.setup` in the state: pass it as e.g. "
                "`fabric.save(path, {'model': model, 'optimizer': optimizer})`."
            )
        if len(engines) > 1:
            self._save_models(self._named_engines(state), self._several_models_target(path), state)
            return
        engine = engines[0]
        target = self.broadcast(str(path))
        node = None
        if self.node_local_storage:
            target = node_local_path(target, self.broadcast(os.getcwd()))
            node = describe_position(self.node_rank, self.local_rank)
        excluded = (engine, engine.optimizer) if engine.optimizer is not None else (engine,)
        client_state = {k: v for k, v in state.items() if not any(v is obj for obj in excluded)}
        _validate_state_keys(client_state)
        client_state = self._convert_stateful_objects_in_state(client_state, filter={})
        save_zero_checkpoint(
            self._saver,
            engine,
            target,
            client_state,
            world_size=self.world_size,
            config=self.config,
            exclude_frozen_parameters=self.exclude_frozen_parameters,
            manifest_extra={"global_step": int(engine.global_steps)},
            node=node,
        )

    def _load_full_weights(
        self, target: str, state: dict[str, Any] | None, strict: bool, weights_only: bool | None
    ) -> dict[str, Any]:
        """``load_full_weights=True``: a consolidated file (``fabric.save`` of a plain strategy, ``torch.save`` of a
        state dict, a Lightning checkpoint, or lightspeed's safetensors export) into the (partitioned) model, tensor
        by tensor, then into the optimizer's fp32 master copies; the rest of ``state`` as Lightning restores it."""
        engines = _get_deepspeed_engines_from_state(state) if state else []
        if state is None or len(engines) != 1:
            raise ValueError(
                "`fabric.load` with `load_full_weights=True` needs exactly one model set up by `fabric.setup` in the "
                f"state, found {len(engines)}: pass it as e.g. `fabric.load(path, {{'model': model}})`."
            )
        engine = engines[0]
        model_key = next(name for name, value in state.items() if value is engine)
        checkpoint: dict[str, Any]
        if is_export(target):
            weights, checkpoint = read_exported(target), {}
        else:
            checkpoint = self.checkpoint_io.load_checkpoint(target, weights_only=weights_only)
            if isinstance(checkpoint.get(model_key), dict):
                weights = checkpoint.pop(model_key)
            elif isinstance(checkpoint.get("state_dict"), dict):
                weights = checkpoint.pop("state_dict")  # a Lightning checkpoint
            elif checkpoint and all(isinstance(value, torch.Tensor) for value in checkpoint.values()):
                weights, checkpoint = checkpoint, {}  # torch.save(model.state_dict())
            else:
                raise CheckpointError(
                    f"{target!r} holds no model weights: expected them under {model_key!r} (as `fabric.save` writes "
                    "them), under 'state_dict' (a Lightning checkpoint), or a plain state dict of tensors."
                )
        # as Fabric's own load: with strict, every other entry of `state` must be in the file (named if not)
        others = [name for name, value in state.items() if value is not engine and not isinstance(value, Optimizer)]
        _validate_keys_for_strict_loading(others, checkpoint, strict)
        missing, unexpected = load_full_state_dict(
            engine.module,
            weights,
            rank=self.global_rank,
            optimizer=engine.optimizer,
            strict=strict,
            source=f"checkpoint {target!r}",
        )
        if missing or unexpected:
            rank_zero_warn(
                f"lightspeed: `fabric.load(..., strict=False)` loaded {target!r} into the model without "
                f"{len(missing)} tensor(s) the file lacks ({', '.join(missing) or 'none'}) and skipped "
                f"{len(unexpected)} the model lacks ({', '.join(unexpected) or 'none'})."
            )
        for name, value in list(state.items()):
            if value is engine or name not in checkpoint or isinstance(value, (Module, Optimizer)):
                continue
            state[name] = checkpoint.pop(name)
        return checkpoint

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Check the checkpoint first (one error on every rank before anything is loaded), then load it through
        DeepSpeed; one written by another number of processes is resharded on the way."""
        if isinstance(state, (Module, Optimizer)):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        target = self.broadcast(str(path))
        if self.load_full_weights and (is_export(target) or Path(target).is_file()):
            return self._load_full_weights(target, state, strict, weights_only)
        if self.node_local_storage:
            target = node_local_path(target, self.broadcast(os.getcwd()))
        engines = _get_deepspeed_engines_from_state(state) if state else []
        if len(engines) > 1 and state is not None:
            return self._load_models(self._named_engines(state), self._several_models_target(path), state, strict)
        engine = engines[0] if len(engines) == 1 else None
        load_policy.check_before_loading(
            target,
            module=engine.module if engine is not None else None,  # node-local parts are checked, not their shapes
            strict=strict,
            node_rank=self.node_rank if self.node_local_storage else None,
            warn=rank_zero_warn,
        )
        if engine is None or self.node_local_storage:
            return super().load_checkpoint(target, state, strict=strict, weights_only=weights_only)
        with load_policy.checkpoint_to_load(engine, target, self.world_size, info=rank_zero_info) as load_path:
            return super().load_checkpoint(load_path, state, strict=strict, weights_only=weights_only)
