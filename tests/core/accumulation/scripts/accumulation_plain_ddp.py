"""Worker: the core accumulation API in a plain PyTorch DDP loop (no Lightning), on every torchrun rank.

Usage: accumulation_plain_ddp.py OUT_DIR. Token-weighted sequences (ranks hold different token counts), 6 batches of
2 sequences per rank, accumulate=4 (windows of 4 and 2). Rank 0 saves OUT_DIR/plain_ddp.pt with the final weights,
the gradient all-reduces (DDP comm hook) and count all-reduces per window.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "strategies" / "scripts"))

from accumulation_cases import AccumulationWindows, item_loss, make_data, make_model, rank_batches  # noqa: E402

from lightspeed.core.accumulation.exact import ExactAccumulator, distributed_sum, skip_gradient_sync  # noqa: E402

ACCUMULATE, BATCH, LR, EPOCHS = 4, 2, 0.1, 2


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_data("tokens")
    model = make_model("tokens")
    ddp = DistributedDataParallel(model)
    counts = {"grad_allreduces": 0, "count_allreduces": 0, "steps": 0}

    def counting_hook(state, bucket):
        counts["grad_allreduces"] += 1
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, counting_hook)

    def counting_sum(tensor):
        counts["count_allreduces"] += 1
        return distributed_sum(tensor)

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    accumulator = ExactAccumulator(world_size=world, all_reduce_sum=counting_sum)
    batches = rank_batches(len(data[0]), world, rank, BATCH)
    windows = AccumulationWindows(ACCUMULATE, num_batches=len(batches))
    for epoch in range(EPOCHS):
        for batch_idx, indices in enumerate(batches):
            boundary = windows.is_boundary(batch_idx, epoch)
            with contextlib.nullcontext() if boundary else skip_gradient_sync(ddp):
                loss_sum, tokens = item_loss("tokens", ddp, tuple(t[indices] for t in data))
                (loss_sum * accumulator.record(loss_sum, num_items=tokens)).backward()
            if boundary:
                accumulator.finish_window(model.parameters())
                optimizer.step()
                optimizer.zero_grad()
                counts["steps"] += 1
    if rank == 0:
        torch.save({"state_dict": model.state_dict(), **counts}, Path(sys.argv[1]) / "plain_ddp.pt")
    dist.barrier()  # leave together; destroying the group while DDP still holds it can hang gloo at exit


if __name__ == "__main__":
    main()
