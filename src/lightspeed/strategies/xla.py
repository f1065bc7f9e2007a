"""``xla_exact`` and ``single_xla_exact``: Lightning's XLA strategies with exact gradient accumulation,
lightspeed's casting ``XLAPrecision``, the recompilation alarm and a launcher that does not copy the model into each
worker.

Gradients on XLA are never reduced during backward; they are all-reduced (averaged over replicas) once per optimizer
step, inside the precision plugin's closure, i.e. only at accumulation window boundaries. The
:class:`~lightspeed.strategies.exact_accumulation.ExactAccumulationMixin` then scales them by ``W / T`` (one small
all-reduce of the window's item count per window) so the step equals the big-batch step, short last windows
included.

Notebook-friendly launching: torch_xla's ``xmp.spawn`` hands its arguments to the workers through a process pool,
which pickles them, so Lightning's XLA launcher copies the Trainer and the model into every worker. The launcher
here keeps them in a module-level table that the workers inherit through ``fork`` and passes only a key, so a model
built once outside the training function is shared copy-on-write with the workers instead of being copied. Every
launch forks, one device of several included (there ``xmp.spawn(nprocs=1)`` would run in the launching process and
start the XLA runtime in it), so the launching process can launch again.
"""

from __future__ import annotations

import functools
import itertools
import queue
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from lightning.pytorch.plugins.precision.xla import XLAPrecision as _LightningXLAPrecision
from lightning.pytorch.strategies.launchers.xla import _XLALauncher
from lightning.pytorch.strategies.single_xla import SingleDeviceXLAStrategy
from lightning.pytorch.strategies.xla import XLAStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightspeed.core.xla.recompilation import (
    DEFAULT_WARMUP_STEPS,
    RecompilationAlarm,
    XLARecompilationWarning,
    check_warmup_steps,
)
from lightspeed.core.xla.runtime import (
    check_bf16_supported,
    pjrt_device_count,
    torch_xla_installed,
    torch_xla_missing_message,
)
from lightspeed.plugins.precision.xla import XLAPrecision
from lightspeed.strategies.exact_accumulation import ExactAccumulationMixin
from lightspeed.strategies.mixin_bases import StrategyBase
from lightspeed.strategies.resumable_data import ResumableDataMixin

__all__ = ["SingleDeviceXLAExactStrategy", "XLAExactStrategy"]

# key -> (launcher, trainer, function, args, kwargs) while a launch is running; workers inherit it through fork
_LAUNCH_TABLE: dict[int, tuple[Any, ...]] = {}
_LAUNCH_KEYS = itertools.count()


def _run_from_launch_table(process_idx: int, key: int, return_queue: mp.SimpleQueue | queue.Queue) -> None:
    launcher, trainer, function, args, kwargs = _LAUNCH_TABLE[key]
    launcher._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue)


def _spawn_one_device(process_idx: int, key: int, return_queue: mp.SimpleQueue | queue.Queue) -> None:
    """In a forked worker: ``xmp.spawn(nprocs=1)`` sets up one device and calls the function in this (the worker's)
    process."""
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(_run_from_launch_table, args=(key, return_queue), nprocs=1)


class _XLAForkLauncher(_XLALauncher):
    """Lightning's XLA launcher, except that the Trainer, the model and the function reach the workers by ``fork``
    inheritance instead of pickling; and the parent's model gets the trained dtypes back, not only the values."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any | None = None, **kwargs: Any) -> Any:
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise NotImplementedError(
                "Calling `trainer.fit()` twice on the same Trainer instance with an XLA strategy is not supported."
                " Create a new Trainer and pass `fit(ckpt_path=...)` to continue training."
            )
        import torch_xla.distributed.xla_multiprocessing as xmp

        return_queue = mp.Manager().Queue()
        key = next(_LAUNCH_KEYS)
        _LAUNCH_TABLE[key] = (self, trainer, function, args, kwargs)
        try:
            if self._strategy.num_processes == pjrt_device_count():  # type: ignore[attr-defined]
                # every device: xmp.spawn forks the workers itself
                process_context = xmp.spawn(
                    _run_from_launch_table, args=(key, return_queue), start_method=self._start_method
                )
            else:
                # one device of several: xmp.spawn(nprocs=1) would run the function in this process and start the
                # XLA runtime here, after which this process could never launch again (notebooks); fork one worker
                # that makes that call instead
                process_context = mp.start_processes(
                    _spawn_one_device, args=(key, return_queue), nprocs=1, join=False, start_method=self._start_method
                )
            if process_context is not None:  # xmp.spawn joins its pool itself and returns None (torch_xla >= 2.1)
                self.procs = process_context.processes
                while not process_context.join():
                    pass
        finally:
            del _LAUNCH_TABLE[key]

        worker_output = return_queue.get()
        if trainer is None:
            return worker_output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        self._recover_results_in_main_process(worker_output, trainer)
        return worker_output.trainer_results

    @override
    def _wrapping_function(
        self,
        process_idx: int,
        trainer: Any | None,
        function: Callable,
        args: Any,
        kwargs: Any,
        return_queue: mp.SimpleQueue | queue.Queue,
        global_states: Any | None = None,
    ) -> None:
        """Lightning's, except that a one-device run trains the Trainer and the model themselves.

        Lightning deep-copies them whenever this process sees several devices, because each device then gets its
        own thread; with one device of several only one thread runs, and the copy would defeat the fork sharing
        (and fail for a model that cannot be copied).
        """
        if self._strategy.num_processes > 1:  # type: ignore[attr-defined]
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, global_states)
            return
        from lightning.fabric.strategies.launchers.xla import _rank_teardown
        from lightning.fabric.utilities import move_data_to_device

        results = function(*args, **kwargs)
        if trainer is not None:
            results = self._collect_rank_zero_results(trainer, results)
        return_queue.put(move_data_to_device(results, "cpu"))
        _rank_teardown(0)

    @override
    def _recover_results_in_main_process(self, worker_output: Any, trainer: Any) -> None:
        if worker_output.weights_path is not None:
            # the workers trained in the precision's dtypes; give the parent's module the same dtypes first
            self._strategy.precision_plugin.convert_module(trainer.lightning_module)
        super()._recover_results_in_main_process(worker_output, trainer)


def _check_bf16_in_worker(precision: Any, device_type: str | None) -> None:
    """Inside a worker the runtime runs, so the device can be asked whether it does bfloat16."""
    from torch_xla import runtime as xr

    check_bf16_supported(str(precision.precision), device_type, bool(xr.is_bf16_supported()))


def _require_torch_xla() -> None:
    if not torch_xla_installed():
        raise ModuleNotFoundError(torch_xla_missing_message())


def _passed_on(arguments: dict[str, Any]) -> dict[str, Any]:
    """A strategy's ``__init__`` arguments (its ``locals()``) as keywords for the classes after it, ``**kwargs``
    merged in."""
    named = {name: value for name, value in arguments.items() if name not in ("self", "__class__", "kwargs")}
    return {**named, **arguments.get("kwargs", {})}


def _default_precision() -> _LightningXLAPrecision:
    return XLAPrecision("32-true")


class _LightspeedXLAStrategyMixin(StrategyBase):  # only ever combined with Lightning's XLA strategies
    """What both strategies add to Lightning's: lightspeed's ``XLAPrecision`` as the default precision plugin, the
    bfloat16 check once the runtime runs, and the recompilation alarm.

    Args:
        recompilation_alarm: warn once (:class:`~lightspeed.xla.XLARecompilationWarning`, rank 0) when a training
            step after the warm-up makes torch_xla compile again because the batch's shapes or dtypes changed
            (:class:`~lightspeed.xla.RecompilationAlarm`). ``False`` turns it off.
        recompilation_warmup_steps: the first training steps of a fit, whose compilations are expected.
    """

    strategy_name: str
    _precision_plugin: _LightningXLAPrecision | None

    def __init__(
        self,
        *args: Any,
        recompilation_alarm: bool = True,
        recompilation_warmup_steps: int = DEFAULT_WARMUP_STEPS,
        **kwargs: Any,
    ) -> None:
        _require_torch_xla()
        super().__init__(*args, **kwargs)
        self.recompilation_alarm = bool(recompilation_alarm)
        self.recompilation_warmup_steps = check_warmup_steps(recompilation_warmup_steps)
        self._recompilation: RecompilationAlarm | None = None

    @property
    @override
    def precision_plugin(self) -> _LightningXLAPrecision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = _default_precision()
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Any) -> None:
        # Lightning's setter (it rejects anything but an XLAPrecision)
        super(_LightspeedXLAStrategyMixin, type(self)).precision_plugin.fset(self, precision_plugin)  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        _check_bf16_in_worker(self.precision_plugin, getattr(self.accelerator, "device_type", None))

    # ---- the recompilation alarm: one per fit, fed at every training batch's start --------------------------
    @property
    def recompilation(self) -> RecompilationAlarm | None:
        """The running (or last) fit's recompilation alarm; ``None`` when it is off or before the first fit."""
        return self._recompilation

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._recompilation = None
        if self.recompilation_alarm:
            self._recompilation = RecompilationAlarm(
                self.recompilation_warmup_steps,
                warn=functools.partial(rank_zero_warn, category=XLARecompilationWarning),
            )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._recompilation is not None:
            self._recompilation.observe(batch)

    @override
    def on_validation_start(self) -> None:
        # the validation loop compiles its own graphs: not the training steps'
        if self._recompilation is not None:
            self._recompilation.pause()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        if self._recompilation is not None:
            self._recompilation.close()
        super().on_train_end()


class XLAExactStrategy(_LightspeedXLAStrategyMixin, ResumableDataMixin, ExactAccumulationMixin, XLAStrategy):
    """Multi-device XLA (``xmp.spawn``) with exact gradient accumulation and lightspeed's ``XLAPrecision``.

    Also runs on one device of a host's several, which Lightning's ``XLAStrategy`` refuses; like every launch it
    trains in a forked worker, so the launching process never starts the XLA runtime and can launch again.
    Accepts ``XLAStrategy``'s arguments plus ``sync_with_dataloader`` (see the accumulation mixin),
    ``recompilation_alarm`` and ``recompilation_warmup_steps`` (see :class:`_LightspeedXLAStrategyMixin`).

    Args:
        accelerator: Lightning's accelerator (set by the Trainer from ``Trainer(accelerator="xla")``).
        parallel_devices: the XLA devices of this host (set by the Trainer from ``Trainer(devices=...)``).
        checkpoint_io: how checkpoints are written (Lightning's ``XLACheckpointIO`` by default).
        precision_plugin: the precision plugin; ``None``: lightspeed's ``XLAPrecision("32-true")``.
        debug: torch_xla's debug mode (``PT_XLA_DEBUG``).
        sync_module_states: broadcast rank 0's weights to every replica when the model is set up.
        sync_with_dataloader: ``True`` (default) steps the short last window of an epoch with its real size; ``False``
            makes a short window an error.
        recompilation_alarm: ``False`` turns the warning about recompiling steps off (see
            :class:`~lightspeed.xla.RecompilationAlarm`).
        recompilation_warmup_steps: the first training steps of a fit, whose compilations are expected.
        **kwargs: passed on to Lightning's ``XLAStrategy``, which ignores keywords it does not know.
    """

    strategy_name = "xla_exact"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: _LightningXLAPrecision | None = None,
        debug: bool = False,
        sync_module_states: bool = True,
        *,
        sync_with_dataloader: bool = True,
        recompilation_alarm: bool = True,
        recompilation_warmup_steps: int = DEFAULT_WARMUP_STEPS,
        **kwargs: Any,
    ) -> None:
        super().__init__(**_passed_on(locals()))

    @override
    def _configure_launcher(self) -> None:
        self._launcher = _XLAForkLauncher(self)

    @override
    def setup_distributed(self) -> None:
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _exact_all_reduce_sum(self, tensor: Tensor) -> Tensor:
        import torch_xla.core.xla_model as xm

        return xm.all_reduce(xm.REDUCE_SUM, tensor)


class SingleDeviceXLAExactStrategy(
    _LightspeedXLAStrategyMixin, ResumableDataMixin, ExactAccumulationMixin, SingleDeviceXLAStrategy
):
    """One XLA device in this process, with exact gradient accumulation and lightspeed's ``XLAPrecision``.

    What ``accelerator="xla", devices=1`` picks; also ``strategy="single_xla_exact"``. Takes the same extra arguments
    as :class:`XLAExactStrategy`, e.g. ``SingleDeviceXLAExactStrategy(recompilation_alarm=False)``.

    Args:
        device: the XLA device (its index, or a ``torch.device``).
        accelerator: Lightning's accelerator (set by the Trainer from ``Trainer(accelerator="xla")``).
        checkpoint_io: how checkpoints are written (Lightning's ``XLACheckpointIO`` by default).
        precision_plugin: the precision plugin; ``None``: lightspeed's ``XLAPrecision("32-true")``.
        debug: torch_xla's debug mode (``PT_XLA_DEBUG``).
        sync_with_dataloader: as for :class:`XLAExactStrategy`.
        recompilation_alarm: as for :class:`XLAExactStrategy`.
        recompilation_warmup_steps: as for :class:`XLAExactStrategy`.
    """

    strategy_name = "single_xla_exact"

    def __init__(
        self,
        device: Any = 0,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: _LightningXLAPrecision | None = None,
        debug: bool = False,
        *,
        sync_with_dataloader: bool = True,
        recompilation_alarm: bool = True,
        recompilation_warmup_steps: int = DEFAULT_WARMUP_STEPS,
    ) -> None:
        super().__init__(**_passed_on(locals()))
