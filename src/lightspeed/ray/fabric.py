"""``RayZeroFabricStrategy``: :class:`~lightspeed.fabric.ZeroFabricStrategy` for a Fabric loop inside a Ray Train
worker.

Ray starts the workers and creates the process group; this strategy takes the ranks, the world and each worker's
device from Ray (``RayLightningEnvironment``, ``ray.train.torch.get_device()``), so ``L.Fabric(strategy=...)`` needs
neither ``devices`` nor ``num_nodes``. Checkpoints: ``fabric.save`` into a directory of each worker's own, then
``ray.train.report(..., checkpoint=Checkpoint.from_directory(...))`` on every worker; every rank writes only its own
ZeRO shard there (rank 0 also the model states and the marker listing every rank's files), and Ray merges the
directories into one complete checkpoint, which ``fabric.load`` reads back after a restart.
"""

from __future__ import annotations

import ray.train.torch
from ray.train.lightning import RayLightningEnvironment
from typing_extensions import Unpack, override

from lightspeed.fabric.zero import ZeroFabricStrategy
from lightspeed.fabric.zero_keywords import FabricZeroKeywords
from lightspeed.ray.worker import refuse_what_ray_decides, require_ray_worker

__all__ = ["RayZeroFabricStrategy"]


class RayZeroFabricStrategy(ZeroFabricStrategy):
    """lightspeed's ZeRO strategy for Lightning Fabric inside ``ray.train.torch.TorchTrainer``; takes every
    :class:`~lightspeed.fabric.ZeroFabricStrategy` argument except ``node_local_storage``, ``timeout``,
    ``cluster_environment`` and ``parallel_devices`` (Ray's)."""

    def __init__(self, **kwargs: Unpack[FabricZeroKeywords]) -> None:
        name = type(self).__name__
        refuse_what_ray_decides(name, kwargs, ray_sets=("cluster_environment", "parallel_devices"))
        context = require_ray_worker(name)
        local_world_size = context.get_local_world_size()
        kwargs["cluster_environment"] = RayLightningEnvironment()
        kwargs["parallel_devices"] = [ray.train.torch.get_device()] * local_world_size
        super().__init__(**kwargs)
        self._ray_nodes = context.get_world_size() // local_world_size
        self._session.own_checkpoint_paths = True

    @property
    @override
    def num_nodes(self) -> int:
        """Ray's number of nodes (``Fabric(num_nodes=...)`` is not needed; another count than Ray's is an error)."""
        if self._num_nodes not in (1, self._ray_nodes):
            raise ValueError(
                f"Fabric(num_nodes={self._num_nodes}), but Ray Train runs this job on {self._ray_nodes} node(s): leave "
                "num_nodes out, RayZeroFabricStrategy takes it from Ray."
            )
        return self._ray_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes
