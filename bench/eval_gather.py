"""Evaluation throughput with ``GatherForMetrics`` versus without any gathering, measured in the same run.

    python bench/eval_gather.py [--samples 100000] [--batch-size 1000] [--devices 2] [--repeats 20]

Lightning DDP on CPU (gloo), a tiny model so that the gather's overhead is visible. Each repeat runs
``trainer.validate`` once per variant, alternating:

* ``baseline``: ``validation_step`` updates a local torchmetrics accuracy, no gathering, no sync (the metric is
  wrong across ranks, which is the point: it is the cost floor);
* ``callback``: ``GatherForMetrics({"acc": MulticlassAccuracy})`` with its defaults: predictions and targets are
  kept for a window of consecutive batches (sized so that a rank keeps about 4 MiB: with these outputs, the whole
  epoch), gathered in one collective, split back and fed to the metric once per batch; it logs the exact global
  accuracy;
* ``callback, gather_every=8``: windows of 8 batches;
* ``callback, gather_every=batch``: one all-gather per batch (the agreement check and the data travel together);
* ``callback, gather_every=epoch``: the same metric, outputs gathered once at epoch end.

Prints samples/s per variant (median of the repeats, rank 0's wall clock) and the ratio of the median times to
the baseline's (target >= 0.9 on CPU); the variants alternate within each repeat, so a slow patch of the machine
hits them alike. Every timed run starts after a full garbage collection (one takes 0.2-0.4 s with Lightning
loaded; landing in one run, it would swamp the comparison). Then checks that every callback logged exactly the
single-process accuracy. Each gather is a synchronisation point costing about a millisecond over gloo here,
whatever it carries; the windows pay that once per many batches instead of once per batch.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
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
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(args.samples, FEATURES, generator=gen), torch.randint(0, CLASSES, (args.samples,), generator=gen)
    )
    loader = DataLoader(data, batch_size=args.batch_size)

    def accuracy() -> dict[str, torchmetrics.Metric]:
        return {"acc": torchmetrics.classification.MulticlassAccuracy(CLASSES, average="micro")}

    callbacks = {
        "callback": GatherForMetrics(accuracy()),
        "callback, gather_every=8": GatherForMetrics(accuracy(), gather_every=8),
        "callback, gather_every=batch": GatherForMetrics(accuracy(), gather_every="batch"),
        "callback, gather_every=epoch": GatherForMetrics(accuracy(), gather_every="epoch"),
    }

    def make_trainer(callbacks: list) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy="ddp" if args.devices > 1 else "auto",
            callbacks=callbacks,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )

    variants = {"baseline (no gathering)": (make_trainer([]), TinyEval(gather=False))}
    variants.update({name: (make_trainer([cb]), TinyEval(gather=True)) for name, cb in callbacks.items()})
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, (runner, module) in variants.items():
            gc.collect()  # a full collection takes 0.2-0.4 s with Lightning loaded: start every run from the same state
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            runner.validate(module, dataloaders=loader, verbose=False)
            if dist.is_initialized():
                dist.barrier()
            elapsed = time.perf_counter() - start
            if repeat > 0:
                times[name].append(elapsed)
    if variants["callback"][0].global_rank == 0:
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        ratios = {name: medians["baseline (no gathering)"] / median for name, median in medians.items()}
        print(
            f"eval of {args.samples} samples, batch {args.batch_size}, {args.devices} CPU ranks (gloo), "
            f"median of {args.repeats} repeats:"
        )
        for name, median in medians.items():
            print(f"  {name:30s} {args.samples / median:12.0f} samples/s ({median:.3f} s)  ratio {ratios[name]:.3f}")
        print(f"ratio callback (defaults) / baseline: {ratios['callback']:.3f} (target >= 0.9)")
        with torch.no_grad():  # the single-process value every callback must have logged, exactly
            reference = float(
                (TinyEval(gather=False).net(data.tensors[0]).argmax(-1) == data.tensors[1]).double().mean()
            )
        values = {name: float(cb.results["validate"]["val/acc"]) for name, cb in callbacks.items()}
        print(f"accuracy: single process {reference:.6f}; logged by the callbacks {values}")
        if any(abs(value - reference) > 1e-6 for value in values.values()):
            raise SystemExit("a callback logged another accuracy than the single-process one")


if __name__ == "__main__":
    main()
