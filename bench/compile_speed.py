"""Training throughput of a ZeRO strategy with ``compile=True`` (DeepSpeed's ``engine.compile()``) against the same
strategy uncompiled, through the Trainer, on the tiny character LM of ``examples/tiny_lm.py``, measured in the same
run.

    python bench/compile_speed.py                          # 2 CPU ranks (re-launches itself with torchrun)
    python bench/compile_speed.py --stages 1,2,3 --steps 30 --repeats 5

Prints samples/s of both and the ratio compiled / uncompiled per stage. The two runs of a stage alternate
``--repeats`` times (uncompiled first) and the median of each is compared, so slow drift of the machine affects both;
the warm-up steps (``--warmup``) absorb compilation, and the first compiled run's warm-up time is printed as the
compile cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

CONTEXT, VOCAB = 64, 42


def make_data(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=gen)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def make_model() -> nn.Module:
    from tiny_lm import TinyGPT  # examples/tiny_lm.py

    torch.manual_seed(0)
    return TinyGPT(VOCAB, CONTEXT, width=256, depth=4, heads=4)


def rank_loader(data: TensorDataset, batch: int) -> DataLoader:
    """This rank's shard, in order (the process group may not exist yet: ranks come from torchrun's environment)."""
    sampler = DistributedSampler(
        data, num_replicas=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]), shuffle=False
    )
    return DataLoader(data, batch_size=batch, sampler=sampler)


def time_trainer(stage: int, compiled: bool, args: argparse.Namespace, data: TensorDataset) -> tuple[float, float]:
    """Seconds for the warm-up steps and for the measured steps of one Trainer run."""
    import lightning as L

    from lightspeed.strategies import ZeroStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, batch_idx):
            ids, target = batch
            return nn.functional.cross_entropy(self.net(ids).flatten(0, 1), target.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Clock(L.Callback):
        begin = start = end = 0.0

        def on_train_start(self, trainer, pl_module):
            self.begin = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == args.warmup:
                torch.distributed.barrier()
                self.start = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            torch.distributed.barrier()
            self.end = time.perf_counter()

    clock = Clock()
    trainer = L.Trainer(
        strategy=ZeroStrategy(stage=stage, compile=compiled),
        accelerator=args.accelerator,
        devices=args.devices,
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
        use_distributed_sampler=False,
    )
    trainer.fit(Module(), rank_loader(data, args.batch))
    return clock.start - clock.begin, clock.end - clock.start


def worker(args: argparse.Namespace) -> None:
    data = make_data(args.batch * args.devices * (args.warmup + args.steps + 1))
    global_samples = args.steps * args.batch * args.devices
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        plain, compiled, compile_warmup = [], [], None
        for _ in range(args.repeats):
            plain.append(global_samples / time_trainer(stage, False, args, data)[1])
            warmup, seconds = time_trainer(stage, True, args, data)
            compile_warmup = warmup if compile_warmup is None else compile_warmup
            compiled.append(global_samples / seconds)
        rows.append(
            {
                "stage": stage,
                "uncompiled": statistics.median(plain),
                "compiled": statistics.median(compiled),
                "first_compiled_warmup_s": compile_warmup,
                "all_uncompiled": plain,
                "all_compiled": compiled,
            }
        )
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"\nsamples/s, tiny LM (4 x 256, context {CONTEXT}), {args.devices} x {args.accelerator}, micro-batch "
            f"{args.batch}, {args.steps} measured steps after {args.warmup} warm-up steps, median of {args.repeats}, "
            f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}"
        )
        print(f"{'strategy':<10}{'uncompiled':>12}{'compiled':>10}{'ratio':>8}{'1st compiled warm-up':>23}")
        for row in rows:
            print(
                f"{'zero' + str(row['stage']):<10}{row['uncompiled']:>12.1f}{row['compiled']:>10.1f}"
                f"{row['compiled'] / row['uncompiled']:>8.3f}{row['first_compiled_warmup_s']:>21.1f} s"
            )
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="2,3", help="ZeRO stages, comma-separated")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing; compilation happens here")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.devices}", __file__, *sys.argv[1:]]
    raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
