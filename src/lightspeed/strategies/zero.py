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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import Unpack, override

from lightspeed.core.zero.config.arguments import strategy_arguments
from lightspeed.core.zero.config.model_recipe import arguments_outside_recipe
from lightspeed.core.zero.runtime import zero_device_kind
from lightspeed.core.zero.session import ZeroConfigProperties, ZeroSession
from lightspeed.core.zero.several_models import parse_model_options
from lightspeed.strategies.compile_takeover import CompileTakeoverMixin
from lightspeed.strategies.exact_accumulation import DeepSpeedExactAccumulationMixin
from lightspeed.strategies.launchers import check_start_method, fork_launcher_if_wanted
from lightspeed.strategies.process_group import ProcessGroupMixin
from lightspeed.strategies.resumable_data import ResumableDataMixin
from lightspeed.strategies.sequence_parallel import SequenceParallelMixin
from lightspeed.strategies.zero_checkpoints import ZeroCheckpointsMixin
from lightspeed.strategies.zero_engine import ZeroEngineMixin
from lightspeed.strategies.zero_keywords import TRAINER_DEFAULTS, TrainerZeroKeywords
from lightspeed.strategies.zero_models import ZeroModelsMixin

if TYPE_CHECKING:
    import deepspeed

__all__ = ["ZeroStrategy"]


class ZeroStrategy(  # type: ignore[misc]  # `config`: the session's, never None (Lightning's may be)
    ZeroEngineMixin,
    ZeroConfigProperties,
    CompileTakeoverMixin,
    ProcessGroupMixin,
    ResumableDataMixin,
    SequenceParallelMixin,
    DeepSpeedExactAccumulationMixin,
    ZeroModelsMixin,
    ZeroCheckpointsMixin,
    DeepSpeedStrategy,
):
    """DeepSpeed ZeRO for Lightning, on ``accelerator="cuda"`` (nccl) and ``accelerator="cpu"`` (gloo).

    Args:
        **arguments: :class:`~lightspeed.strategies.zero_keywords.TrainerZeroKeywords`, each with its default when
            left out: the ZeRO arguments every front end takes
            (:class:`~lightspeed.core.zero.config.arguments.ZeroKeywords`: ``stage``,
            ``offload_optimizer``, ``offload_parameters``, ``nvme_path``, ``config``, bucket sizes, activation
            checkpointing, low-memory states, ``leaf_modules``, checkpoint options, ``compile``, sequence parallelism
            and tiling, ``unused_parameters``, ``timeout``, ...) and the Trainer's own (``sync_with_dataloader``,
            ``start_method``, ``models``, ``precision_plugin``). A keyword of Lightning's ``DeepSpeedStrategy`` that
            lightspeed does not take (e.g. ``offload_params_device``, ``logging_batch_size_per_gpu``) is a
            ``TypeError`` saying what to use instead.
    """

    strategy_name = "zero"
    _rank_variables = True  # DeepSpeed reads RANK, WORLD_SIZE and LOCAL_RANK

    def __init__(self, **arguments: Unpack[TrainerZeroKeywords]) -> None:
        recipe, given = strategy_arguments(arguments, ZeroStrategy, type(self).__name__, "Trainer", TRAINER_DEFAULTS)
        options = parse_model_options(given["models"], "ZeroStrategy(models=...)")
        not_with_several_models = {
            "compile": given["compile"] or given["compile_kwargs"],
            "load_full_weights": given["load_full_weights"],
            "node_local_storage": given["node_local_storage"],
            "activation_checkpointing_policy": given["activation_checkpointing_policy"],
        }
        self._init_lightning(recipe.config(), given)
        self._init_several_models(options, recipe, not_with_several_models)

    def _init_lightning(self, deepspeed_config: dict[str, Any], arguments: Mapping[str, Any]) -> None:
        """Lightning's ``DeepSpeedStrategy`` set-up around an already built DeepSpeed config, whose ``"auto"`` values
        stay until setup (``arguments``: those of ``__init__`` by name, the parsed activation-checkpointing policy)."""
        check_start_method(arguments.get("start_method"))
        self._session = ZeroSession.from_arguments(
            deepspeed_config, arguments, type(self).__name__, "Trainer", rank_zero_info
        )
        strategy_kwargs = arguments_outside_recipe(
            arguments, DeepSpeedStrategy.__init__, DeepSpeedExactAccumulationMixin.__init__
        )
        super().__init__(config=deepspeed_config, **strategy_kwargs)
        self._start_method_choice = arguments.get("start_method")
        self._train_engine: deepspeed.DeepSpeedEngine | None = None
        self._failed = False  # set by on_exception, read by teardown
        self._init_several_models({}, None, {})

    def _device_kind(self) -> str:
        return zero_device_kind(self.accelerator)

    # ------------------------------------------------------------------ before any process starts
    @override
    def _configure_launcher(self) -> None:
        # Runs in Trainer.__init__, before launching: the right place for checks that must fail early and for the
        # environment every rank inherits.
        self._session.check_before_launch(self._device_kind(), self.precision_plugin.precision, self)
        launcher = fork_launcher_if_wanted(self, self._start_method_choice)
        if launcher is not None:
            self._launcher = launcher
            return
        super()._configure_launcher()

    # ------------------------------------------------------------------ process setup
    @override
    def setup_environment(self) -> None:
        assert self.accelerator is not None  # set by the Trainer before setup_environment
        self.accelerator.setup_device(self.root_device)
        # Lightning's DeepSpeed set-up refuses the CPU; the session does its steps for CUDA and the CPU alike
        steps = (reset_seed, self.set_world_ranks, self._init_deepspeed_distributed)
        group = self._lightspeed_process_group()
        self._session.start_process(self._device_kind(), self, process_group=group, steps=steps)

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
            self._session.end_process()
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
