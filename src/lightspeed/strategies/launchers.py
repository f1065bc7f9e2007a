"""How lightspeed strategies start their processes: forked workers in notebooks, and the checks that must fail
before any process starts.

* In an interactive session (Jupyter, Colab, ``python -i``) or with ``start_method="fork"``, every lightspeed
  strategy starts its workers with :class:`LightspeedForkLauncher`, Lightning's ``_MultiProcessingLauncher``
  (``ddp_notebook``'s launcher) with fork, extended so that after a ZeRO-3 ``fit`` the notebook's model receives the
  consolidated full weights (a partitioned module's ``state_dict()`` is empty), the process group a worker created
  is destroyed before the worker exits, and CUDA initialised before the fork is refused with advice.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info
from typing_extensions import override

from lightspeed.core.errors import CudaInitializedError
from lightspeed.core.reliability import process_group as _process_group

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "LightspeedForkLauncher",
    "check_cuda_not_initialized",
    "is_interactive",
    "wants_fork",
]

log = logging.getLogger(__name__)

START_METHODS = ("popen", "spawn", "fork", "forkserver")


def is_interactive() -> bool:
    """True in an interactive session: Jupyter/IPython kernels, Colab, ``python -i`` and the plain REPL."""
    from lightning.fabric.utilities import imports

    if imports._IS_INTERACTIVE or hasattr(sys, "ps1") or bool(sys.flags.interactive):
        return True
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    return callable(get_ipython) and get_ipython() is not None and "ipykernel" in sys.modules


def wants_fork(start_method: str | None, creates_processes_externally: bool) -> bool:
    """Whether to launch with fork: asked for, or ``None``/``"popen"`` (the script launcher, which cannot re-run a
    notebook) in an interactive session. Never when torchrun/SLURM started the processes."""
    if creates_processes_externally:
        return False
    if start_method == "fork":
        return True
    return start_method in (None, "popen") and is_interactive()


def check_start_method(start_method: str | None) -> None:
    """Refuse an unknown ``start_method`` when the strategy is built."""
    if start_method is not None and start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not one of {', '.join(map(repr, START_METHODS))}.")


def check_cuda_not_initialized() -> None:
    """:class:`CudaInitializedError` when CUDA was initialised in this process: forked workers cannot use it."""
    if torch.cuda.is_initialized():
        raise CudaInitializedError(
            "CUDA was initialised in this process before `trainer.fit`/`validate` (for example by `model.cuda()`, "
            "`torch.ones(1, device='cuda')` or another `torch.cuda` call in an earlier cell), and the worker processes "
            "lightspeed forks from a notebook cannot use CUDA then. Restart the kernel and do not touch CUDA before "
            "calling the Trainer: build the model on the CPU and let the strategy move it to the GPUs. (In a script, "
            "run it as `python train.py` without start_method='fork'.)"
        )


def _is_partitioned(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id") and hasattr(tensor, "ds_status")


def consolidated_state_dict(module: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every ZeRO-3 partitioned parameter gathered in full, one at a time (a collective:
    every rank calls it). Returns CPU copies where ``keep`` (the rank that sends them), an empty dict elsewhere."""
    full: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        if _is_partitioned(value):
            import deepspeed

            with deepspeed.zero.GatheredParameters([value], modifier_rank=None):
                if keep:
                    full[key] = value.data.detach().to("cpu", copy=True)
        elif keep:
            full[key] = value.detach().to("cpu", copy=True)
    return full


class LightspeedForkLauncher(_MultiProcessingLauncher):
    """Lightning's fork launcher (``ddp_notebook``) for lightspeed strategies.

    Differences: CUDA initialised before the fork is a :class:`CudaInitializedError` with advice; the weights sent back
    to the main process are consolidated from ZeRO-3 partitions; a worker destroys the process group lightspeed
    created in it before it exits (forked workers leave through ``os._exit``, which skips ``atexit``).
    """

    def __init__(self, strategy: pl.strategies.ParallelStrategy, reason: str) -> None:
        super().__init__(strategy, start_method="fork")
        self.reason = reason

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        check_cuda_not_initialized()
        assert isinstance(self._strategy, DDPStrategy)  # DDP, DeepSpeed and lightspeed's strategies
        rank_zero_info(
            f"lightspeed: starting {self._strategy.num_processes} worker processes with the fork launcher "
            f"({self.reason})"
        )
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(process_idx, *args, **kwargs)
        finally:
            _process_group.destroy_owned_group()

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        rank_zero_debug("Collecting results from rank 0 process.")
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        fitting = trainer.state.fn == TrainerFn.FITTING
        is_sender = self._strategy.local_rank == 0 and self._strategy.global_rank == 0
        # every rank takes part: gathering ZeRO-3 partitions (and Metrics' state_dict) are collectives
        state_dict = consolidated_state_dict(trainer.lightning_module, keep=is_sender)
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if fitting:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        super()._recover_results_in_main_process(worker_output, trainer)
        if worker_output.weights_path is not None:
            os.rmdir(os.path.dirname(worker_output.weights_path))  # Lightning removes the file, not its temp dir


def fork_launcher_if_wanted(strategy: Any, start_method: str | None) -> LightspeedForkLauncher | None:
    """The fork launcher for ``strategy`` when :func:`wants_fork`, else None (the strategy's usual launcher); logs
    which launcher was chosen either way."""
    external = strategy.cluster_environment is not None and strategy.cluster_environment.creates_processes_externally
    if not wants_fork(start_method, external):
        log.debug("lightspeed: %s uses its usual launcher (external: %s)", type(strategy).__name__, external)
        return None
    reason = "start_method='fork'" if start_method == "fork" else "interactive session detected"
    rank_zero_info(f"lightspeed: {type(strategy).__name__} uses the fork launcher ({reason})")
    return LightspeedForkLauncher(strategy, reason)
