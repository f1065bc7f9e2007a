"""``ddp_exact``: Lightning's DDP with gradient accumulation that equals the big batch.

Non-boundary micro-batches run under DDP's ``no_sync`` (no gradient all-reduce); the boundary micro-batch all-reduces
the accumulated gradients once, then one small all-reduce of the window's item count turns them into the gradient of
the mean loss over every item of the window on every rank (see :mod:`lightspeed.strategies.exact_accumulation`).
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightspeed.core.reliability.launched_world import check_launched_world, external_launcher
from lightspeed.strategies.exact_accumulation import ExactAccumulationMixin
from lightspeed.strategies.launchers import fork_launcher_if_wanted
from lightspeed.strategies.process_group import ProcessGroupMixin
from lightspeed.strategies.resumable_data import ResumableDataMixin

__all__ = ["DDPExactStrategy"]


class DDPExactStrategy(ProcessGroupMixin, ResumableDataMixin, ExactAccumulationMixin, DDPStrategy):
    """``DDPStrategy`` whose ``accumulate_grad_batches`` gives exactly the big-batch gradient, in lightspeed's process
    group (per-restart store prefix, heartbeat, named hangs) with mid-epoch resumable training dataloaders.

    Accepts every ``DDPStrategy`` argument plus ``sync_with_dataloader`` (what a short last window of an epoch does;
    see :class:`~lightspeed.strategies.exact_accumulation.ExactAccumulationMixin`). In an interactive session
    (Jupyter, Colab) the workers are forked, as with Lightning's ``ddp_notebook``; ``start_method="fork"`` forces it.

    Args:
        *args: ``DDPStrategy``'s positional arguments, in its order.
        sync_with_dataloader: ``True`` (default) steps the short last window of an epoch with its real size; ``False``
            makes a short window an error.
        **kwargs: Lightning's ``DDPStrategy`` arguments, passed on unchanged: ``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``ddp_comm_state``, ``ddp_comm_hook``,
            ``ddp_comm_wrapper``, ``model_averaging_period``, ``process_group_backend``, ``timeout`` (how long a
            collective waits before a ``CollectiveTimeoutError`` names the rank that stopped answering),
            ``start_method`` (``"fork"`` forks the workers, as in a notebook) and the keywords of torch's
            ``DistributedDataParallel`` (e.g. ``find_unused_parameters``).
    """

    strategy_name = "ddp_exact"  # registered with Lightning by :mod:`lightspeed.registry`

    @override
    def _configure_launcher(self) -> None:
        check_launched_world(*external_launcher(self.cluster_environment), self.num_nodes, self.num_processes)
        launcher = fork_launcher_if_wanted(self, self._start_method)
        if launcher is not None:
            self._launcher = launcher
            return
        super()._configure_launcher()
