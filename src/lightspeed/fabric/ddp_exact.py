"""``ddp_exact`` for Lightning Fabric: Fabric's ``DDPStrategy`` in lightspeed's process group, for
:func:`lightspeed.fabric.accumulate` (the Trainer's is :mod:`lightspeed.strategies.ddp_exact`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightspeed.core.reliability.launched_world import check_launched_world, external_launcher
from lightspeed.core.reliability.staging import save_file_atomically
from lightspeed.fabric.process_group import ProcessGroupMixin

__all__ = ["DDPExactFabricStrategy"]


class DDPExactFabricStrategy(ProcessGroupMixin, DDPStrategy):
    """Fabric's ``DDPStrategy`` under lightspeed's ``ddp_exact`` name: with :func:`lightspeed.fabric.accumulate`,
    non-boundary micro-batches skip DDP's all-reduce and every window's gradient is the big-batch gradient (short
    last window and ``num_items`` included). The process group is lightspeed's: a per-restart store prefix under
    ``torchrun --max-restarts``, a heartbeat, and hangs that name the ranks that stopped answering; ``fabric.save``
    writes the file beside its target and renames it into place, so a kill mid-save never leaves a torn checkpoint
    for :func:`lightspeed.fabric.last_checkpoint` to pick up.

    Args:
        accelerator: Fabric's accelerator (set by Fabric from ``Fabric(accelerator=...)``).
        parallel_devices: the devices of this node (set by Fabric from ``Fabric(devices=...)``).
        cluster_environment: Lightning's cluster environment (torchrun, SLURM, ...; set by Fabric).
        checkpoint_io: how ``fabric.save`` writes the file (Lightning's ``CheckpointIO``).
        precision: Fabric's precision plugin (set by Fabric from ``Fabric(precision=...)``).
        process_group_backend: ``"nccl"`` or ``"gloo"``; ``None``: ``"nccl"`` on CUDA, ``"gloo"`` on the CPU.
        timeout: how long a collective may wait for the other ranks before a ``CollectiveTimeoutError`` names the rank
            that stopped answering.
        start_method: how Fabric starts the processes (``"popen"``, ``"spawn"``, ``"fork"``, ``"forkserver"``).
        **kwargs: the keywords of torch's ``DistributedDataParallel`` (e.g. ``find_unused_parameters``).
    """

    strategy_name = "ddp_exact"

    @override
    def _configure_launcher(self) -> None:
        check_launched_world(
            *external_launcher(self.cluster_environment), self.num_nodes, self.num_processes, front_end="Fabric"
        )
        super()._configure_launcher()

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        wrapped = super().setup_module(module)
        self._with_named_hangs(wrapped)
        return wrapped

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        target = Path(self.broadcast(str(path)))
        save_file_atomically(
            target,
            lambda staging: super(DDPExactFabricStrategy, self).save_checkpoint(
                staging, state, storage_options=storage_options, filter=filter
            ),
            writer=self.is_global_zero,
        )
