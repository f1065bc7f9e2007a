"""What core reads from a front end's strategy about the job and this process's place in it."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["ProcessPlace", "RankedProcess"]


class RankedProcess(Protocol):
    """This process's ranks and its cluster environment (``main_address``, ``main_port``): what the process group's
    rendezvous needs."""

    @property
    def cluster_environment(self) -> object: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


class ProcessPlace(RankedProcess, Protocol):
    """The job a front end's strategy launches and this process's place in it (Lightning's Trainer and Fabric
    strategies have all of these): the ZeRO session's launch checks and checkpoints, and the tuner's trials, read them
    from the strategy itself instead of a copy of each value."""

    @property
    def num_nodes(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...
