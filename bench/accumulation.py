"""Time per optimizer step with ``accumulate_grad_batches=8`` on 2 CPU ranks (gloo), all variants in the same run:

* ``ddp_exact`` against Lightning's ``ddp`` (baseline): exactness costs one small all-reduce per window;
* ``zero1`` (non-boundary micro-batches keep gradients local) against ``zero1`` all-reducing the gradients after
  every micro-batch (baseline: what happens without a no-sync path);
* ``zero2`` for reference: DeepSpeed reduce-scatters gradients after every micro-batch in ZeRO-2/3 by design.

    python bench/accumulation.py                    # re-launches itself with torchrun on 2 ranks
    python bench/accumulation.py --steps 12 --hidden 1024 --layers 4 --repeats 2

Variants alternate ``--repeats`` times and the median step time of each is compared, so drift of the machine hits
all of them. With full, equal windows every variant computes the same update, so the final weights must agree:
the script prints the largest difference from the ``ddp`` run as a correctness check.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
ACCUMULATE = 8
VARIANTS = ("ddp", "ddp_exact", "zero1_reduce_every_micro_batch", "zero1", "zero2")
RATIOS = (("ddp_exact", "ddp"), ("zero1", "zero1_reduce_every_micro_batch"), ("zero2", "zero1"))


def make_strategy(name: str):
    if name != "zero1_reduce_every_micro_batch":
        return name
    from lightspeed.strategies.zero import ZeroStrategy

    class ZeroReduceEveryMicroBatch(ZeroStrategy):
        """ZeRO-1 without the no-sync path: after every non-boundary backward the gradients are all-reduced (averaged)
        in one flat buffer, as DDP does without ``no_sync``. The update is unchanged: once averaged, the ranks' common
        part averages to itself at the boundary reduction. (Marking every micro-batch as a DeepSpeed boundary would
        not do: ZeRO-1 then keeps only the last micro-batch's reduced gradient.)"""

        @contextmanager
        def block_backward_sync(self):
            with super().block_backward_sync():  # the product path: boundary off, gradients stay local
                yield
            grads = [p.grad for p in self.lightning_module.parameters() if p.grad is not None]
            flat = torch._utils._flatten_dense_tensors(grads)
            torch.distributed.all_reduce(flat)
            flat /= self.world_size
            for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(synced)

    return ZeroReduceEveryMicroBatch(stage=1)


def time_variant(name: str, args: argparse.Namespace) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Seconds between consecutive optimizer steps (the first one, with set-up, dropped) and the final weights."""
    import lightning.pytorch as pl

    import lightspeed  # noqa: F401  (registers ddp_exact and zero1)

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            layers = []
            for _ in range(args.layers):
                layers += [nn.Linear(args.hidden, args.hidden), nn.Tanh()]
            self.net = nn.Sequential(*layers[:-1])

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.steps = 0

        def on_train_batch_end(self, trainer, *unused) -> None:
            if trainer.global_step > self.steps:
                self.steps = trainer.global_step
                self.stamps.append(time.perf_counter())

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(1)
    n = world * args.batch * ACCUMULATE * args.steps
    data = TensorDataset(torch.randn(n, args.hidden, generator=gen), torch.randn(n, args.hidden, generator=gen))
    loader = DataLoader(
        data, batch_size=args.batch, sampler=DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    )
    timer = StepTimer()
    module = Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=make_strategy(name),
        max_epochs=1,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, loader)
    steps = [b - a for a, b in zip(timer.stamps, timer.stamps[1:], strict=False)]
    weights = {k: v.detach().float().clone() for k, v in module.net.state_dict().items()}
    return steps, weights


def worker(args: argparse.Namespace) -> None:
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for _ in range(args.repeats):
        for name in VARIANTS:
            steps, weights[name] = time_variant(name, args)
            times[name] += steps
    if int(os.environ["RANK"]) != 0:
        return
    params = sum(v.numel() for v in weights["ddp"].values())
    print(
        f"\naccumulate_grad_batches={ACCUMULATE}, {os.environ['WORLD_SIZE']} CPU ranks (gloo), MLP "
        f"{args.layers}x{args.hidden} ({params / 1e6:.1f}M parameters), micro-batch {args.batch}, "
        f"{args.steps} steps x {args.repeats} repeats"
    )
    median = {name: statistics.median(values) for name, values in times.items()}
    for name in VARIANTS:
        drift = max((weights[name][k] - weights["ddp"][k]).abs().max().item() for k in weights["ddp"])
        print(f"  {name:32s} {median[name] * 1e3:9.1f} ms/step   max |w - w_ddp| = {drift:.2e}")
    for variant, baseline in RATIOS:
        ratio = median[variant] / median[baseline]
        print(f"  ratio {variant} / {baseline}: {ratio:.3f} (time per step; < 1 is faster)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="micro-batch size per rank")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    args, _ = parser.parse_known_args()
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.devices}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        __file__,
        *sys.argv[1:],
    ]
    raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
