"""Bad inputs on 3 gloo ranks; every rank records the error it got (for tests/core/gather/test_gather_errors.py).

``run_errors(out_dir)`` is called by gather_cases.py at the end of its 3-rank launch (one start-up fewer); this
file also runs alone: ``torchrun --nproc_per_node=3 gather_errors.py OUT_DIR``. Each rank writes
``errors_rank{r}.json`` mapping case name to the error message (or null). The last case leaves rank 1 out of a
gather on purpose, so it ends the process with ``os._exit`` instead of tearing the process group down.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gather_data import LengthIterable, MapData, ShardedIterable  # noqa: E402

from lightspeed import gather_for_metrics, pad_across_processes  # noqa: E402
from lightspeed.core.errors import GatherError
from lightspeed.core.gather import GatherState, fail_gather, track


class NoPredictions(GatherError):
    """A caller's own error type, raised on every rank through fail_gather."""


def catch(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return None


def one_batch_state(rank: int, world: int, n: int = 9, batch: int = 3) -> GatherState:
    state = GatherState.strided(n, rank, world)
    state.begin_batch(batch)
    return state


def run_errors(out_dir: Path) -> None:
    """Run every bad-input case on the already initialized 3-rank group, save the messages, end the process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, str | None] = {}

    state = one_batch_state(rank, world)
    dtype = torch.float16 if rank == 1 else torch.float32
    results["dtype"] = catch(
        lambda: gather_for_metrics({"preds": torch.zeros(3, dtype=dtype), "target": torch.zeros(3)}, state=state)
    )

    data = {"preds": torch.zeros(3)} if rank == 2 else {"preds": torch.zeros(3), "target": torch.zeros(3)}
    results["structure"] = catch(lambda: gather_for_metrics(data, state=state))

    width = 5 if rank == 1 else 4
    results["trailing_dims"] = catch(lambda: gather_for_metrics(torch.zeros(3, width), state=state))

    rows = 6 if rank == 0 else 3  # rank 0 flattened tokens: dim 0 is not the batch
    results["not_batch_dim"] = catch(lambda: gather_for_metrics(torch.zeros(rows), state=state))

    # rank 1 names a first sample past what it has produced (3 samples so far)
    first = 2 if rank == 1 else 0
    results["first_sample_out_of_range"] = catch(
        lambda: gather_for_metrics(torch.zeros(3), state=state, first_sample=first)
    )

    results["pad_ndim"] = catch(
        lambda: pad_across_processes(torch.zeros(2, 2) if rank == 2 else torch.zeros(2, 2, 2), dim=1)
    )
    results["pad_dim_out_of_range"] = catch(lambda: pad_across_processes(torch.zeros(2, 2), dim=2 if rank == 0 else 1))

    # an IterableDataset without __len__ whose shards yield 2, 1, 1 batches: ranks 1 and 2 finish while rank 0
    # still gathers its second batch
    def uneven() -> None:
        for x, _, _ in track(DataLoader(ShardedIterable(7, rank, world, padded=False), batch_size=2)):
            gather_for_metrics(x)

    results["uneven_batches"] = catch(uneven)

    # the same with a pad_across_processes before each gather: rank 0 pads its second batch while the others
    # check the end of the dataloader; a data-less call must send as many bytes as a gather or gloo aborts
    def uneven_pad() -> None:
        for x, _, _ in track(DataLoader(ShardedIterable(7, rank, world, padded=False), batch_size=2)):
            gather_for_metrics(pad_across_processes(x, dim=1))

    results["uneven_pad"] = catch(uneven_pad)

    # one rank cannot make its gather (e.g. a step returned no predictions) while the others gather
    def one_fails() -> None:
        state = one_batch_state(rank, world)
        if rank == 2:
            fail_gather(NoPredictions("validation_step returned None; return the predictions."), state)
        gather_for_metrics(torch.zeros(3), state=state)

    results["fail_gather"] = catch(one_fails)
    results["fail_gather_everywhere"] = catch(
        lambda: fail_gather(NoPredictions("no predictions."), one_batch_state(rank, world))
    )

    # __len__ returning the per-rank count instead of the total over all ranks
    def per_rank_len() -> None:
        for x, _, _ in track(DataLoader(LengthIterable(12, rank, world, length=4), batch_size=2)):
            gather_for_metrics(x)

    results["per_rank_len"] = catch(per_rank_len)

    # __len__ that differs across ranks
    def differing_len() -> None:
        for x, _, _ in track(DataLoader(LengthIterable(12, rank, world, length=12 + rank), batch_size=2)):
            gather_for_metrics(x)

    results["differing_len"] = catch(differing_len)

    # a map-style loader is fine and the group still works after all those errors
    ds = MapData(10)
    loader = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False))
    gathered = []
    for _, _, idx in track(loader):
        gathered.append(gather_for_metrics(idx))
    results["recovered"] = None if torch.cat(gathered).tolist() == list(range(10)) else "wrong samples after errors"

    # a gather that rank 1 never joins (it is busy elsewhere for longer than the timeout)
    os.environ["LIGHTSPEED_GATHER_TIMEOUT"] = "3"
    if rank == 1:
        time.sleep(5)
        results["missing_rank"] = None
    else:
        results["missing_rank"] = catch(lambda: gather_for_metrics(torch.zeros(3), state=one_batch_state(rank, world)))

    (out_dir / f"errors_rank{rank}.json").write_text(json.dumps(results, indent=1))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run_errors(Path(sys.argv[1]))
