"""Evaluation throughput with ``GatherForMetrics`` versus without any gathering, measured in the same run.

    python bench/eval_gather.py [--samples 100000] [--batch-size 1000] [--devices 2] [--repeats 5]

Lightning DDP on CPU (gloo), a tiny model so that the gather's overhead is visible. Each repeat runs
``trainer.validate`` once per variant, alternating:

* ``baseline``: ``validation_step`` updates a local torchmetrics accuracy, no gathering, no sync (the metric is
  wrong across ranks, which is the point: it is the cost floor);
* ``callback``: ``GatherForMetrics({"acc": MulticlassAccuracy})`` gathers predictions and targets every batch,
  drops the sampler's padding and logs the exact global accuracy (one all-gather per batch: the agreement check
  and the data travel together);
* ``callback, gather_every=epoch``: the same metric, outputs kept per rank and gathered once at epoch end.

Prints samples/s per variant (best of the repeats, rank 0's wall clock) and the ratio callback / baseline
(target >= 0.9 on CPU). Each per-batch gather is a synchronisation point: on an oversubscribed CPU
(more busy processes than cores) its cost is dominated by waiting for the other rank to be scheduled.
"""

from __future__ import annotations

import argparse
import os
import time

import lightning as L
import torch
import torch.distributed as dist
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

from lightspeed.callbacks import GatherForMetrics

CLASSES, FEATURES = 10, 32


class TinyEval(L.LightningModule):
    def __init__(self, gather: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))
        self.gather = gather
        self.local_acc = torchmetrics.classification.MulticlassAccuracy(CLASSES, average="micro", sync_on_compute=False)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        preds = self.net(x).argmax(-1)
        if self.gather:
            return {"preds": preds, "target": y}
        self.local_acc.update(preds, y)
        return None

    def on_validation_epoch_end(self) -> None:
        if not self.gather:
            self.local_acc.compute()
            self.local_acc.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, FEATURES, generator=gen), torch.randint(0, CLASSES, (args.samples,), generator=gen))
    loader = DataLoader(data, batch_size=args.batch_size)
    callback = GatherForMetrics({"acc": torchmetrics.classification.MulticlassAccuracy(CLASSES, average="micro")})

    def make_trainer(callbacks: list) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto", callbacks=callbacks,
            logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        )

    epoch_callback = GatherForMetrics(
        {"acc": torchmetrics.classification.MulticlassAccuracy(CLASSES, average="micro")}, gather_every="epoch"
    )
    plain_trainer, trainer, epoch_trainer = make_trainer([]), make_trainer([callback]), make_trainer([epoch_callback])
    variants = {
        "baseline (no gathering)": (plain_trainer, TinyEval(gather=False)),
        "callback": (trainer, TinyEval(gather=True)),
        "callback, gather_every=epoch": (epoch_trainer, TinyEval(gather=True)),
    }
    best: dict[str, float] = {}
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, (runner, module) in variants.items():
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            runner.validate(module, dataloaders=loader, verbose=False)
            if dist.is_initialized():
                dist.barrier()
            elapsed = time.perf_counter() - start
            if repeat > 0:
                best[name] = min(best.get(name, float("inf")), elapsed)
    if trainer.global_rank == 0:
        base = best["baseline (no gathering)"]
        print(f"eval of {args.samples} samples, batch {args.batch_size}, {args.devices} CPU ranks (gloo), best of {args.repeats}:")
        for name, seconds in best.items():
            print(f"  {name:28s} {args.samples / seconds:12.0f} samples/s  ({seconds:.3f} s)")
        print(f"ratio callback / baseline: {base / best['callback']:.3f} (target >= 0.9)")
        print(f"ratio callback (gather_every='epoch') / baseline: {base / best['callback, gather_every=epoch']:.3f}")
        print(f"exact accuracy logged by the callback: {float(callback.results['validate']['val/acc']):.6f}")


if __name__ == "__main__":
    main()
