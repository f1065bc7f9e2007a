"""Training throughput of lightspeed's ZeRO strategies through the Trainer, against a hand-written DeepSpeed engine
loop with the identical resolved config, the same model and the same data, measured in the same run.

    python bench/train_throughput.py                          # 2 CPU ranks (re-launches itself with torchrun)
    python bench/train_throughput.py --names zero2,zero3 --steps 40 --devices 2
    python bench/train_throughput.py --with-lightning         # also Lightning's deepspeed_stage_* (CUDA only)

Prints samples/s of each and the ratio lightspeed / hand-written loop (target: >= 0.95 on CPU). The two runs of a
strategy alternate ``--repeats`` times and the median of each is compared, so slow drift of the machine affects both.
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


def lm_loss(net: nn.Module, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(net(ids).flatten(0, 1), target.flatten())


def time_trainer(name: str, args: argparse.Namespace, data: TensorDataset) -> tuple[float, dict]:
    """Seconds for the measured steps of a Trainer run (after warm-up), and the resolved DeepSpeed config."""
    import lightning as L

    import lightspeed  # noqa: F401

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, batch_idx):
            return lm_loss(self.net, *batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Clock(L.Callback):
        start = end = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == args.warmup:
                torch.distributed.barrier()
                self.start = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            torch.distributed.barrier()
            self.end = time.perf_counter()

    clock = Clock()
    trainer = L.Trainer(
        strategy=name,
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
    config = getattr(trainer.strategy, "resolved_config", None) or trainer.strategy.config
    return clock.end - clock.start, config


def time_engine_loop(config: dict, offload: bool, args: argparse.Namespace, data: TensorDataset) -> float:
    """Seconds for the measured steps of a plain DeepSpeed engine loop with ``config``."""
    import deepspeed

    from lightspeed.core.zero.cpu_optimizer import to_deepspeed_cpu_adam

    net = make_model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    if offload:
        optimizer = to_deepspeed_cpu_adam(optimizer)
    local_rank = int(os.environ["LOCAL_RANK"])
    engine, *_ = deepspeed.initialize(
        args=argparse.Namespace(device_rank=local_rank),
        model=net,
        optimizer=optimizer,
        config=config,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        dist_init_required=False,
    )
    loader = rank_loader(data, args.batch)
    device = engine.device
    start = 0.0
    for step, (ids, target) in enumerate(loader):
        if step == args.warmup:
            torch.distributed.barrier()
            start = time.perf_counter()
        if step == args.warmup + args.steps:
            break
        loss = lm_loss(engine, ids.to(device), target.to(device))
        engine.backward(loss)
        engine.step()
    torch.distributed.barrier()
    return time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    data = make_data(args.batch * args.devices * (args.warmup + args.steps + 1))
    global_samples = args.steps * args.batch * args.devices
    rows = []
    for name in args.names.split(","):
        ours, theirs = [], []
        for _ in range(args.repeats):
            seconds, config = time_trainer(name, args, data)
            ours.append(global_samples / seconds)
            offload = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") in ("cpu", "nvme")
            theirs.append(global_samples / time_engine_loop(config, offload, args, data))
        rows.append({"name": name, "lightspeed": statistics.median(ours), "engine_loop": statistics.median(theirs)})
        if args.with_lightning and name in LIGHTNING_EQUIVALENT:
            rows[-1]["lightning"] = global_samples / time_trainer(LIGHTNING_EQUIVALENT[name], args, data)[0]
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"\nsamples/s, {args.devices} x {args.accelerator}, micro-batch {args.batch}, {args.steps} measured steps, "
            f"median of {args.repeats}"
        )
        print(
            f"{'strategy':<16}{'lightspeed':>12}{'engine loop':>13}{'ratio':>8}"
            + (f"{'lightning':>12}{'ratio':>8}" if args.with_lightning else "")
        )
        for row in rows:
            line = (
                f"{row['name']:<16}{row['lightspeed']:>12.1f}{row['engine_loop']:>13.1f}"
                f"{row['lightspeed'] / row['engine_loop']:>8.3f}"
            )
            if "lightning" in row:
                line += f"{row['lightning']:>12.1f}{row['lightspeed'] / row['lightning']:>8.3f}"
            print(line)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))


LIGHTNING_EQUIVALENT = {
    "zero1": "deepspeed_stage_1",
    "zero2": "deepspeed_stage_2",
    "zero3": "deepspeed_stage_3",
    "zero3_offload": "deepspeed_stage_3_offload",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", default="zero1,zero2,zero3,zero3_offload")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--with-lightning", action="store_true", help="add Lightning's deepspeed_stage_* (CUDA only)")
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
