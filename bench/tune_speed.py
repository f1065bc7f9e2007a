"""What ``zero_auto``'s throughput tuner (``ZeroAutoStrategy(tune=True)``) gains: the option it chooses against the
option ``zero_auto`` picks without tuning and against the slowest option it measured, each trained by this benchmark
as an ordinary fixed ``ZeroStrategy`` through the Trainer, on the tiny character LM of ``examples/tiny_lm.py``
(4 layers, width 256, as in ``train_throughput.py``), in the same run.

    python bench/tune_speed.py                              # 2 CPU ranks (re-launches itself with torchrun)
    python bench/tune_speed.py --steps 30 --repeats 7 --tune-steps 10 --json out.json
    python bench/tune_speed.py --batch 8 --accumulate 2 --micro-batches 4,16   # micro-batch sizes tuned as well

First one tuned ``fit`` (``retune=True``, a fresh cache in a temporary folder, 1 training step) decides; its table of
candidates is printed as the tuner logged it. The untuned default is the planner's choice in the same strategy
(``memory_plan.choice``), the slowest is the lowest samples/s in the tuner's table (failed candidates left out).
With ``--micro-batches`` the candidates also differ in micro-batch size (``tune_micro_batches``), each role trains
with its candidate's micro-batch and accumulation, and the default is the planner's option at ``--batch x
--accumulate``.

Then the three roles train as ``ZeroStrategy(stage=..., offload_optimizer=..., offload_parameters=...)`` with the
protocol of ``train_throughput.py`` (its :class:`Player`, :func:`take_turns` and :func:`run_trainer`): each Trainer
in a thread of its own, taking one training step at a time in turn behind a barrier of both ranks, the order rotated
every round, so that a burst of load from other jobs hits all three alike; ``--warmup`` untimed and ``--steps`` timed
steps, ``--repeats`` repeats each building the three anew. Two roles naming the same option still train separately:
their ratio is then the protocol's noise.

Prints samples/s and CPU ms per step of each role (medians over the repeats, averaged over ranks) next to the tuner's
own figure (samples per rank per second), the ratios chosen / default and chosen / slowest (of samples/s, and of CPU
time the other way round, so that above 1 means the chosen option is faster) as the median of the per-repeat ratios
with their range and as the tuner's table has them, and the load average at start and end.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset
from train_throughput import CONTEXT, Player, make_data, make_model, run_trainer, take_turns

ROLES = ("chosen", "default", "slowest")
CACHE_ENV = "TUNE_SPEED_CACHE"


# ------------------------------------------------------------------------------------------------ the tuner
class Capture(logging.Handler):
    """Keeps the messages of Lightning's rank-zero logger (where ``zero_auto`` logs its tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def tuned_fit(args: argparse.Namespace, data: TensorDataset) -> tuple[Any, list[str], float]:
    """One training step under ``ZeroAutoStrategy(tune=True, retune=True)`` with the launcher's fresh cache: the
    strategy, what it logged and the seconds the fit took."""
    from lightspeed.strategies.zero_auto import ZeroAutoStrategy

    capture = Capture()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    strategy = ZeroAutoStrategy(
        tune=True,
        tune_steps=args.tune_steps,
        tune_cache=os.environ[CACHE_ENV],
        retune=True,
        tune_micro_batches=args.micro_batches,
    )
    start = time.perf_counter()
    one_step = argparse.Namespace(**{**vars(args), "warmup": 0, "steps": 1})
    run_trainer(strategy, one_step, data, accumulate=args.accumulate)
    seconds = time.perf_counter() - start
    logger.removeHandler(capture)
    return strategy, capture.messages, seconds


def tuner_decision(args: argparse.Namespace, data: TensorDataset) -> dict[str, Any]:
    """The tuned fit's chosen option, the untuned default, the slowest measured candidate, the tuner's samples/s per
    candidate (read back from the cache it wrote) and its logged table."""
    strategy, messages, seconds = tuned_fit(args, data)
    torch.distributed.barrier()  # rank 0 has written the cache
    (entry,) = json.loads(Path(os.environ[CACHE_ENV]).read_text())["entries"].values()
    measured = {name: speed for name, speed in entry["samples_per_second"].items() if speed is not None}
    plan = strategy.memory_plan
    assert strategy.chosen_option is not None and plan is not None and plan.choice is not None
    names = {
        "chosen": entry["chosen"],
        "default": plan.choice.estimate.option.name,
        "slowest": min(measured, key=lambda name: measured[name]),
    }
    by_name = {verdict.estimate.option.name: verdict.estimate.option for verdict in plan.verdicts}
    tables = [m for m in messages if m.startswith("lightspeed zero_auto: measured")]
    return {
        "names": names,
        "options": {role: role_of(name, by_name, args) for role, name in names.items()},
        "tuner_samples_per_s": entry["samples_per_second"],
        "table": tables[-1] if tables else "(no table logged)",
        "fit_seconds": seconds,
    }


def role_of(name: str, options: dict[str, Any], args: argparse.Namespace) -> tuple[Any, int, int]:
    """A candidate's ZeRO option, micro-batch and accumulation from its name (``zero2+micro_batch_4``)."""
    option, _, micro = name.partition("+micro_batch_")
    per_step = args.batch * args.accumulate
    size = int(micro) if micro else args.batch
    return options[option], size, per_step // size


# ------------------------------------------------------------------------------------------------ the fixed runs
def fixed_strategy(option: Any) -> Any:
    """The untuned strategy of a ``zero_auto`` option: its stage and offload targets, every other setting default."""
    from lightspeed.strategies import ZeroStrategy

    return ZeroStrategy(
        stage=option.stage, offload_optimizer=option.offload_optimizer, offload_parameters=option.offload_parameters
    )


def mean_over_ranks(value: float) -> float:
    total = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(total)
    return total.item() / torch.distributed.get_world_size()


def player(role: str, candidate: tuple[Any, int, int], args: argparse.Namespace, data: TensorDataset) -> Player:
    """A fixed-strategy Trainer run of a candidate (option, micro-batch, accumulation) that takes its optimizer steps
    when its turn comes."""
    option, size, accumulate = candidate

    def loop(me: Player) -> None:
        run_trainer(fixed_strategy(option), args, data, player=me, batch=size, accumulate=accumulate)

    return Player(role, loop, args.warmup, False)


def measure(options: dict[str, Any], args: argparse.Namespace, data: TensorDataset) -> dict[str, dict[str, list]]:
    """``--repeats`` repeats of the three roles taking their steps in turn; samples/s and CPU ms per step of each
    role's thread, per repeat (averaged over ranks)."""
    rates: dict[str, list[float]] = {role: [] for role in ROLES}
    cpu_ms: dict[str, list[float]] = {role: [] for role in ROLES}
    for repeat in range(args.repeats):
        gc.collect()
        players = [player(role, options[role], args, data) for role in ROLES]
        take_turns(players, args.warmup + args.steps)
        for done in players:
            wall = mean_over_ranks(sum(done.walls[args.warmup :]))
            rates[done.name].append(args.steps * args.batch * args.accumulate * args.devices / wall)
            cpu_ms[done.name].append(1000 * mean_over_ranks(sum(done.cpus[args.warmup :])) / args.steps)
        if int(os.environ["RANK"]) == 0:
            cells = [f"{role} {rates[role][-1]:.1f}" for role in ROLES]
            print(f"[repeat {repeat + 1}] samples/s: " + ", ".join(cells), flush=True)
    return {"samples_per_s": rates, "cpu_ms_per_step": cpu_ms}


# ------------------------------------------------------------------------------------------------ report
def ratio_cells(values: dict[str, list[float]], numerator: str, denominator: str) -> tuple[float, float, float]:
    """The median, lowest and highest of the per-repeat ratios ``numerator / denominator`` (the roles of one repeat
    took their steps side by side; the load moves whole repeats, which a ratio of medians over repeats would mix in)."""
    paired = [a / b for a, b in zip(values[numerator], values[denominator], strict=True)]
    return statistics.median(paired), min(paired), max(paired)


def ratio_line(decision: dict[str, Any], measured: dict[str, Any], role: str) -> str:
    """The measured ratio of samples/s chosen / ``role`` and of CPU time ``role`` / chosen (above 1: the chosen
    option is faster), each with its range, and the ratio in the tuner's own table."""
    chosen, other = decision["names"]["chosen"], decision["names"][role]
    ratio, low, high = ratio_cells(measured["samples_per_s"], "chosen", role)
    cpu, cpu_low, cpu_high = ratio_cells(measured["cpu_ms_per_step"], role, "chosen")
    line = f"samples/s {ratio:.3f} ({low:.2f}-{high:.2f}), CPU time {cpu:.3f} ({cpu_low:.2f}-{cpu_high:.2f})"
    if chosen == other:
        return f"{line}; the same option ({chosen}): the protocol's noise"
    tuner = decision["tuner_samples_per_s"]
    in_table = f"{tuner[chosen] / tuner[other]:.3f}" if tuner.get(chosen) and tuner.get(other) else "-"
    return f"{line}; in the tuner's table {in_table}"


def report(decision: dict[str, Any], measured: dict[str, Any], args: argparse.Namespace, loads: list) -> None:
    import deepspeed
    import lightning

    names, rates, cpu_ms = decision["names"], measured["samples_per_s"], measured["cpu_ms_per_step"]
    parameters = sum(p.numel() for p in make_model().parameters())
    print(
        f"\ntiny LM (4 x 256, context {CONTEXT}, {parameters / 1e6:.2f}M parameters), {args.devices} x "
        f"{args.accelerator}, micro-batch {args.batch} x accumulation {args.accumulate}, fp32; the tuner measured "
        f"{args.tune_steps} steps per candidate"
        + (f", micro-batch sizes {args.micro_batches} as well" if args.micro_batches else "")
    )
    print(f"Lightning {lightning.__version__}, DeepSpeed {deepspeed.__version__}, torch {torch.__version__}")
    print("load average (1/5/15 min): start " + " / ".join(f"{x:.2f}" for x in loads[0]), end="")
    print(", end " + " / ".join(f"{x:.2f}" for x in loads[1]))
    print(f"\nthe tuner's table (the tuned fit took {decision['fit_seconds']:.1f} s):\n{decision['table']}")
    print(
        f"\nfixed-strategy Trainer runs taking steps in turn, {args.steps} timed steps after {args.warmup}, "
        f"medians of {args.repeats} repeats"
    )
    print(f"{'role':<9}{'candidate':<32}{'samples/s':>10}{'CPU ms/step':>13}{'tuner (per rank)':>18}")
    for role in ROLES:
        tuner = decision["tuner_samples_per_s"].get(names[role])
        tuner_cell = f"{tuner:.1f}" if tuner is not None else "-"
        speed, cpu = statistics.median(rates[role]), statistics.median(cpu_ms[role])
        print(f"{role:<9}{names[role]:<32}{speed:>10.1f}{cpu:>13.1f}{tuner_cell:>18}")
    for role in ("default", "slowest"):
        print(f"chosen / {role}: {ratio_line(decision, measured, role)}")


def worker(args: argparse.Namespace) -> None:
    if args.warmup < 1:
        raise SystemExit("--warmup must be at least 1 (the first step also builds the engine)")
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation of DeepSpeed's collectives
    loads = [os.getloadavg()]
    per_step = args.batch * args.accumulate * args.devices
    data = make_data(per_step * (max(args.warmup + args.steps, 2 * (args.tune_steps + 1)) + 1))
    decision = tuner_decision(args, data)
    measured = measure(decision["options"], args, data)
    loads.append(os.getloadavg())
    if int(os.environ["RANK"]) == 0:
        report(decision, measured, args, loads)
        if args.json:
            record = {"loads": loads, "args": vars(args), "decision": decision, **measured}
            Path(args.json).write_text(json.dumps(record, indent=2, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument(
        "--micro-batches",
        type=lambda text: [int(size) for size in text.split(",")],
        help="micro-batch sizes the tuner tries as well (tune_micro_batches), e.g. 4,16",
    )
    parser.add_argument("--tune-steps", type=int, default=3, help="the tuner's measured steps per candidate")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write every measurement to this file")
    args = parser.parse_args()
    args.accelerator = "cpu"  # run_trainer's Trainer; the tuner's trials and the planner run on the CPU ranks
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.devices}", __file__, *sys.argv[1:]]
    with tempfile.TemporaryDirectory() as folder:  # a fresh tuning cache, shared by the ranks
        # DS_ACCELERATOR before any rank imports DeepSpeed; one thread per rank
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), DS_ACCELERATOR="cpu")
        env[CACHE_ENV] = str(Path(folder) / "zero_tune.json")
        code = subprocess.call(cmd, env=env)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
