"""Worker: creates the default process group through lightspeed with a heartbeat that writes to the store without
pause (so its thread is almost always inside a native store call), then ends normally. lightspeed's exit hook must
stop and join the heartbeat before the interpreter shuts down, or the process aborts after a successful run."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from lightspeed.core.reliability import hang_report
from lightspeed.core.reliability import process_group as _process_group


def no_pause(timeout: timedelta) -> float:
    return 0.0


hang_report.heartbeat_interval = no_pause
_process_group.init_process_group("gloo", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timedelta(minutes=1))
dist.barrier()
print(f"rank {dist.get_rank()} done", flush=True)
