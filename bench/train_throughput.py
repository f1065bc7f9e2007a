"""Training throughput of lightspeed's ZeRO strategies, through the Trainer and under Fabric, against a hand-written
DeepSpeed engine loop and against Lightning's own ``DeepSpeedStrategy``, all with the identical resolved DeepSpeed
config, the same model and the same data, measured in the same run.

    python bench/train_throughput.py                          # every preset but NVMe, 2 ranks (re-launches itself)
    python bench/train_throughput.py --names zero2,zero3 --steps 40 --repeats 7
    python bench/train_throughput.py --variants trainer,engine --json out.json --profile prof/

Variants (``--variants``):

* ``trainer``: ``L.Trainer(strategy=<preset>)`` with a LightningModule returning ``AdamW``;
* ``engine``: a hand-written ``deepspeed.initialize`` loop (``engine(x)``, ``engine.backward``, ``engine.step``) with
  the config the Trainer resolved, and the optimizer lightspeed runs (DeepSpeed's CPU Adam under offload);
* ``lightning``: Lightning's own ``lightning.pytorch.strategies.DeepSpeedStrategy(config=<that config>)``. On the
  CPU it refuses to run, so the benchmark subclasses it and bypasses, for this baseline only, the CUDA-only check,
  the CUDA device-index check and the ``device_rank=None`` DeepSpeed cannot use (:func:`lightning_baseline`); its
  LightningModule returns DeepSpeed's CPU Adam under offload, as Lightning asks of its users;
* ``fabric``: a hand-written Fabric loop with ``L.Fabric(strategy=<preset>)`` (``fabric.backward``,
  ``optimizer.step()``, ``optimizer.zero_grad()``).

Step by step, in turn: every variant runs in a thread of its own and stops after each of its training steps (the
Trainers in ``on_train_batch_end``); the main thread lets one variant at a time take its next step, behind a barrier
of all ranks, in an order rotated every round. Only one thread ever runs, so every rank issues the same collectives
in the same order, and a burst of load from other jobs on the machine hits every variant alike instead of whichever
run it fell into. A step's time runs from the variant's resumption to its next stop, so it covers everything the
loop does between two steps (fetching the batch, Lightning's hooks). Each of ``--repeats`` repeats builds every
variant anew and takes ``--warmup`` untimed steps and ``--steps`` timed ones; each preset starts with one untimed
Trainer run that resolves the config (and pays one-time costs such as loading CPU Adam's op).

Prints, per variant, samples/s and CPU ms per step of the variant's thread (``time.thread_time``: little disturbed
by other jobs), both as medians over the repeats and averaged over ranks; the ratios trainer/engine (target >=
0.97), trainer/lightning (target >= 1.0) and fabric/engine (target >= 0.97), each the median of the per-repeat ratios
with their range; and the load average at the start and at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

CONTEXT, VOCAB = 64, 42
PRESETS = ("zero1", "zero2", "zero3", "zero1_offload", "zero2_offload", "zero3_offload_optimizer", "zero3_offload")
VARIANTS = ("trainer", "engine", "lightning", "fabric")
#: (numerator, denominator, target)
RATIOS = (("trainer", "engine", 0.97), ("trainer", "lightning", 1.0), ("fabric", "engine", 0.97))
ENGINE_FILE = "deepspeed/runtime/engine.py"


# ------------------------------------------------------------------------------------------------ model and data
def make_data(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=gen)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def make_model() -> nn.Module:
    from tiny_lm import TinyGPT  # examples/tiny_lm.py

    torch.manual_seed(0)
    return TinyGPT(VOCAB, CONTEXT, width=256, depth=4, heads=4)


def make_optimizer(params: Iterable[nn.Parameter], cpu_adam: bool) -> torch.optim.Optimizer:
    """``AdamW``, or the DeepSpeed CPU Adam lightspeed turns it into under optimizer offload."""
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    if cpu_adam:
        from lightspeed.core.zero.cpu_optimizer import to_deepspeed_cpu_adam

        optimizer = to_deepspeed_cpu_adam(optimizer)
    return optimizer


def offloads_optimizer(config: dict) -> bool:
    return config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") in ("cpu", "nvme")


def rank_loader(data: TensorDataset, batch: int) -> DataLoader:
    """This rank's shard, in order (the process group may not exist yet: ranks come from torchrun's environment)."""
    sampler = DistributedSampler(
        data, num_replicas=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]), shuffle=False
    )
    return DataLoader(data, batch_size=batch, sampler=sampler)


def lm_loss(net: nn.Module, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(net(ids).flatten(0, 1), target.flatten())


# ------------------------------------------------------------------------------------------------ taking turns
class Player(threading.Thread):
    """One variant's training loop in a thread of its own that runs only during its turns: the loop calls
    :meth:`pause` after every training step, the main thread calls :meth:`turn` to let it run to its next pause (or
    to its end). ``walls``/``cpus``: seconds of each step, from resumption to pause (the first step includes building
    the variant); with ``profile`` the steps after the first ``warmup`` run under cProfile, timed in thread CPU time."""

    def __init__(self, name: str, loop: Callable[[Player], None], warmup: int, profile: bool) -> None:
        super().__init__(name=name, daemon=True)
        self.loop = loop
        self.walls: list[float] = []
        self.cpus: list[float] = []
        # CPU time of this thread (collectives waiting for the other rank count little, other jobs not at all)
        self.profiler = cProfile.Profile(time.thread_time) if profile else None
        self._warmup = warmup
        self._resume, self._paused = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._wall = self._cpu = 0.0
        self.done = False  # the loop has ended

    def run(self) -> None:
        try:
            self._wait_for_turn()
            self.loop(self)
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            self._error = error
        finally:
            self.done = True
            self._paused.set()

    def _wait_for_turn(self) -> None:
        self._resume.wait()
        self._resume.clear()
        if self.profiler is not None and len(self.walls) >= self._warmup:
            self.profiler.enable()
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def pause(self) -> None:
        """End of a training step: record its time, hand over, wait for the next turn. On a GPU the step ends when
        its kernels have run: CUDA returns before that, and the next variant's step would be charged for them."""
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        cpu, wall = time.thread_time() - self._cpu, time.perf_counter() - self._wall
        if self.profiler is not None:
            self.profiler.disable()
        self.walls.append(wall)
        self.cpus.append(cpu)
        self._paused.set()
        self._wait_for_turn()

    def turn(self) -> None:
        """Let the loop run until its next pause or its end (re-raising its error)."""
        self._paused.clear()
        self._resume.set()
        self._paused.wait()
        if self._error is not None:
            raise RuntimeError(f"variant {self.name!r} failed") from self._error


def outside_deepspeed_ms(profiler: cProfile.Profile, steps: int) -> float:
    """CPU ms per step that the profiled steps spent outside DeepSpeed: everything but the engine's ``forward``
    (which runs the model, and under the Trainer its ``training_step``), ``backward`` and ``step``, and the ZeRO
    optimizer's ``step`` where the loop calls it itself (Fabric's ``optimizer.step()``). The front end's own work per
    step: the loop, its hooks, the strategy's additions (profiled, so Python-level work counts heavier than it is)."""
    # {(file, line, function): (primitive calls, calls, own time, cumulative time, {caller: the same for it})}
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in stats.values())
    engine = optimizer = 0.0
    engine_steps = 0
    for (file, _, function), (_, calls, _, cumulative, _) in stats.items():
        if file.endswith(ENGINE_FILE) and function in ("forward", "backward", "step"):
            engine += cumulative
            engine_steps += calls if function == "step" else 0
        elif "deepspeed/runtime/zero/" in file and function == "step":
            optimizer += cumulative
    inside = engine if engine_steps else engine + optimizer  # engine.step() runs the optimizer's step itself
    return 1000 * (total - inside) / steps


def take_turns(players: list[Player], rounds: int) -> None:
    """``rounds`` steps of every player, one player at a time behind a barrier, rotating the order every round; then
    every loop to its end, one at a time."""
    for player in players:
        player.start()
    for index in range(rounds):
        shift = index % len(players)
        for player in players[shift:] + players[:shift]:
            torch.distributed.barrier()
            player.turn()
    for player in players:
        torch.distributed.barrier()
        player.turn()
        if not player.done:
            raise RuntimeError(f"variant {player.name!r} took more than {rounds} steps")
        player.join()


# ------------------------------------------------------------------------------------------------ the variants
def run_trainer(
    strategy: Any,
    args: argparse.Namespace,
    data: TensorDataset,
    cpu_adam: bool = False,
    player: Player | None = None,
    batch: int | None = None,
    accumulate: int = 1,
) -> dict:
    """A Trainer run of ``--warmup + --steps`` optimizer steps of ``accumulate`` micro-batches of ``batch`` samples
    (default ``--batch``), pausing after each optimizer step when a ``player`` runs it; returns the strategy's resolved
    DeepSpeed config. ``cpu_adam``: the LightningModule returns DeepSpeed's CPU Adam itself."""
    import lightning as L

    import lightspeed  # noqa: F401

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, batch_idx):
            return lm_loss(self.net, *batch)

        def configure_optimizers(self):
            return make_optimizer(self.parameters(), cpu_adam)

    class PauseAfterEachStep(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            assert player is not None
            if (batch_idx + 1) % accumulate == 0:
                player.pause()

    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        max_steps=args.warmup + args.steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[PauseAfterEachStep()] if player is not None else [],
        use_distributed_sampler=False,
    )
    trainer.fit(Module(), rank_loader(data, batch or args.batch))
    return getattr(trainer.strategy, "resolved_config", None) or trainer.strategy.config


def run_engine(config: dict, args: argparse.Namespace, data: TensorDataset, player: Player) -> None:
    """A hand-written DeepSpeed engine loop with ``config``."""
    import deepspeed

    net = make_model()
    optimizer = make_optimizer(net.parameters(), offloads_optimizer(config))
    engine, *_ = deepspeed.initialize(
        args=argparse.Namespace(device_rank=int(os.environ["LOCAL_RANK"])),
        model=net,
        optimizer=optimizer,
        config=config,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        dist_init_required=False,
    )
    device = engine.device
    for step, (ids, target) in enumerate(rank_loader(data, args.batch)):
        if step == args.warmup + args.steps:
            break
        loss = lm_loss(engine, ids.to(device), target.to(device))
        engine.backward(loss)
        engine.step()
        player.pause()


def lightning_baseline(config: dict, accelerator: str) -> Any:
    """Lightning's ``DeepSpeedStrategy`` with ``config`` (less ``gradient_accumulation_steps``, which it refuses and
    sets from the Trainer: 1 here). On the CPU, where Lightning refuses DeepSpeed, a subclass overrides exactly the
    three places that assume CUDA; nothing else differs from Lightning's strategy."""
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    config = {key: value for key, value in config.items() if key != "gradient_accumulation_steps"}
    if accelerator != "cpu":
        return DeepSpeedStrategy(config=config)

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)  # skips only `isinstance(self.accelerator, CUDAAccelerator)`

        def setup_distributed(self) -> None:
            # Lightning's, less _validate_device_index_selection (CPU devices carry no index)
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
            # Lightning's, with the local rank for DeepSpeed's device_rank (root_device.index is None on the CPU)
            import deepspeed

            engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank),
                config=self.config,
                model=model,
                model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
            return engine, deepspeed_optimizer

    return CPUDeepSpeedStrategy(config=config)


def run_fabric(name: str, args: argparse.Namespace, data: TensorDataset, player: Player) -> dict:
    """A hand-written Fabric loop with ``strategy=name``; returns the strategy's resolved config."""
    import lightning as L

    import lightspeed  # noqa: F401

    fabric = L.Fabric(strategy=name, accelerator=args.accelerator, devices=args.devices)
    fabric.launch()
    net = make_model()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    loader = fabric.setup_dataloaders(rank_loader(data, args.batch), use_distributed_sampler=False)
    for step, (ids, target) in enumerate(loader):
        if step == args.warmup + args.steps:
            break
        fabric.backward(lm_loss(model, ids, target))
        optimizer.step()
        optimizer.zero_grad()
        player.pause()
    config = fabric.strategy.config
    fabric.strategy.teardown()
    return config


# ------------------------------------------------------------------------------------------------ the driver
def differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Keys whose values differ between two configs, as dotted paths."""
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += differences(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key}: {x!r} vs {y!r}")
    return out


def mean_over_ranks(value: float) -> float:
    # nccl reduces only CUDA tensors, gloo CPU ones
    on_gpu = torch.distributed.get_backend() == "nccl"
    total = torch.tensor([value], dtype=torch.float64, device="cuda" if on_gpu else "cpu")
    torch.distributed.all_reduce(total)
    return total.item() / torch.distributed.get_world_size()


def measure(name: str, args: argparse.Namespace, data: TensorDataset, variants: list[str]) -> dict:
    """``--repeats`` repeats of every variant taking steps in turn, after one untimed Trainer run that resolves the
    config."""
    config = run_trainer(name, args, data)
    fabric_configs: list[dict] = []
    loops: dict[str, Callable[[Player], Any]] = {
        "trainer": lambda player: run_trainer(name, args, data, player=player),
        "engine": lambda player: run_engine(config, args, data, player),
        "lightning": lambda player: run_trainer(
            lightning_baseline(config, args.accelerator), args, data, offloads_optimizer(config), player
        ),
        "fabric": lambda player: fabric_configs.append(run_fabric(name, args, data, player)),
    }
    rank = int(os.environ["RANK"])
    rates: dict[str, list[float]] = {variant: [] for variant in variants}
    cpu_ms: dict[str, list[float]] = {variant: [] for variant in variants}
    outside_ms: dict[str, list[float]] = {variant: [] for variant in variants}  # with --profile
    for repeat in range(args.repeats):
        gc.collect()
        players = [Player(v, loops[v], args.warmup, args.profile is not None) for v in variants]
        take_turns(players, args.warmup + args.steps)
        for player in players:
            wall = mean_over_ranks(sum(player.walls[args.warmup :]))
            cpu = mean_over_ranks(sum(player.cpus[args.warmup :]))
            rates[player.name].append(args.steps * args.batch * args.devices / wall)
            cpu_ms[player.name].append(1000 * cpu / args.steps)
            if player.profiler is not None:
                player.profiler.dump_stats(args.profile / f"{name}-{player.name}-{repeat + 1}-rank{rank}.prof")
                outside_ms[player.name].append(mean_over_ranks(outside_deepspeed_ms(player.profiler, args.steps)))
        if rank == 0:
            print(
                f"[{name} repeat {repeat + 1}] "
                + ", ".join(f"{v} {rates[v][-1]:.1f} samples/s {cpu_ms[v][-1]:.0f} CPU ms" for v in variants),
                flush=True,
            )
    # Fabric does not tell the strategy its loaders: train_micro_batch_size_per_gpu (which DeepSpeed uses for its
    # throughput logs only) may differ; anything else would make the engine loop the wrong baseline for Fabric
    notes = differences(config, fabric_configs[0]) if fabric_configs else []
    row = {"name": name, "samples_per_s": rates, "cpu_ms_per_step": cpu_ms, "config": config, "fabric_notes": notes}
    if args.profile is not None:
        row["outside_deepspeed_ms"] = outside_ms
    return row


def ratio_cells(values: dict[str, list[float]], numerator: str, denominator: str) -> tuple[float, float, float]:
    """The median, lowest and highest of the per-repeat ratios ``numerator / denominator``. The variants of one repeat
    took their steps in turn, so each repeat's ratio compares like with like; the load of the machine moves whole
    repeats up and down, which the ratio of the medians over repeats would mix into the comparison."""
    paired = [a / b for a, b in zip(values[numerator], values[denominator], strict=True)]
    return statistics.median(paired), min(paired), max(paired)


def table(rows: list[dict], key: str, variants: list[str], invert: bool) -> None:
    """One line per preset: the median of each variant over the repeats, then each ratio (``invert``: of the
    baseline's value to the variant's, so that above 1 still means faster) as the median of the per-repeat ratios,
    with their range."""
    ratios = [(a, b, target) for a, b, target in RATIOS if a in variants and b in variants]
    header = f"{'strategy':<25}" + "".join(f"{v:>11}" for v in variants)
    print(header + "".join(f"{f'{a}/{b} (range)':>32}" for a, b, _ in ratios))
    for row in rows:
        values = row[key]
        line = f"{row['name']:<25}" + "".join(f"{statistics.median(values[v]):>11.1f}" for v in variants)
        for a, b, target in ratios:
            ratio, low, high = ratio_cells(values, b, a) if invert else ratio_cells(values, a, b)
            flag = "" if ratio >= target else " *"
            line += f"{f'{ratio:.3f} ({low:.2f}-{high:.2f}){flag}':>32}"
        print(line)


def report(rows: list[dict], args: argparse.Namespace, variants: list[str], loads: list[tuple]) -> None:
    print(
        f"\n{args.devices} x {args.accelerator}, micro-batch {args.batch}, {args.steps} timed steps after "
        f"{args.warmup}, variants taking steps in turn, medians of {args.repeats} repeats"
    )
    import deepspeed
    import lightning

    import lightspeed

    print(
        f"lightspeed {lightspeed.__version__} ({Path(lightspeed.__file__).parent}), Lightning {lightning.__version__}, "
        f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}"
    )
    print("load average (1/5/15 min): start " + " / ".join(f"{x:.2f}" for x in loads[0]), end="")
    print(", end " + " / ".join(f"{x:.2f}" for x in loads[1]))
    print("\nsamples/s; ratios of samples/s")
    table(rows, "samples_per_s", variants, invert=False)
    print("\nCPU ms per step; ratios of the baseline's CPU time to the variant's (above 1: less work)")
    table(rows, "cpu_ms_per_step", variants, invert=True)
    if all("outside_deepspeed_ms" in row for row in rows):
        print("\nprofiled CPU ms per step outside DeepSpeed's engine and ZeRO optimizer (see outside_deepspeed_ms)")
        print(f"{'strategy':<25}" + "".join(f"{v:>11}" for v in variants))
        for row in rows:
            values = row["outside_deepspeed_ms"]
            print(f"{row['name']:<25}" + "".join(f"{statistics.median(values[v]):>11.1f}" for v in variants))
    targets = [f"{a}/{b} >= {target}" for a, b, target in RATIOS if a in variants and b in variants]
    print("targets: " + ", ".join(targets) + " (* below target)")
    for row in rows:
        for note in row["fabric_notes"]:
            print(f"{row['name']}: Fabric's resolved config differs from the Trainer's: {note}")


def worker(args: argparse.Namespace) -> None:
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.warmup < 1:
        raise SystemExit("--warmup must be at least 1 (the first step also builds the variant)")
    # torch 2.13's deprecation of the collectives DeepSpeed calls on every bucket: lightspeed filters it while its
    # strategies run, the hand-written loops would print it (again after every change to the filters); silenced for
    # all variants alike
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    loads = [os.getloadavg()]
    data = make_data(args.batch * args.devices * (args.warmup + args.steps + 1))
    rows = [measure(name, args, data, variants) for name in args.names.split(",")]
    loads.append(os.getloadavg())
    if int(os.environ["RANK"]) == 0:
        report(rows, args, variants, loads)
        if args.json:
            record = {"loads": loads, "args": vars(args), "rows": rows}
            Path(args.json).write_text(json.dumps(record, indent=2, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", default=",".join(PRESETS), help="ZeRO presets, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ",".join(VARIANTS))
    parser.add_argument("--devices", type=int, default=min(2, torch.cuda.device_count()) or 2, help="ranks (GPUs)")
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write every measurement to this file")
    parser.add_argument("--profile", type=Path, help="profile the timed steps with cProfile, files into this folder")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if args.accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"  # before any rank imports DeepSpeed (the Lightning baseline sets nothing)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.devices}", __file__, *sys.argv[1:]]
    raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
