"""Worker: a Fabric evaluation loop on 3 ranks over 7 samples (the DistributedSampler pads 2 duplicates) gathering
predictions and targets with lightspeed.gather_for_metrics, then the same evaluation through lightspeed.exact_metrics
with each gather window (one batch, two, sized automatically, the whole epoch); rank 0 writes what it gathered and
the metrics.

usage: fabric_metrics.py OUT_JSON STRATEGY[,STRATEGY...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

import lightspeed
from _support.models import make_net, make_regression_data


def evaluate(name: str) -> dict:
    fabric = L.Fabric(strategy=name, accelerator="cpu", devices=3, precision="32-true")
    fabric.launch()
    data = make_regression_data(7)
    index = torch.arange(7)
    model = fabric.setup(make_net())  # evaluation only: fabric.setup without an optimizer
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(*data.tensors, index), batch_size=2))
    model.eval()
    preds, targets, ids, local_rows = [], [], [], 0
    with torch.no_grad():
        for x, y, i in lightspeed.track(loader):
            local_rows += len(i)
            p = model(x)
            gathered = lightspeed.gather_for_metrics({"pred": p, "y": y, "i": i}, dataloader=loader)
            preds.append(gathered["pred"])
            targets.append(gathered["y"])
            ids.append(gathered["i"])
    pred, target = torch.cat(preds), torch.cat(targets)
    metrics = {"mse": torchmetrics.MeanSquaredError(), "rows": lambda p, t: len(p)}
    with torch.no_grad():
        exact = {
            str(every): lightspeed.exact_metrics(
                loader, lambda batch: (model(batch[0]), batch[1]), metrics, device=fabric.device, gather_every=every
            )
            for every in ("batch", 2, "auto", "epoch")
        }
    return {
        "exact": {every: {name: float(value) for name, value in values.items()} for every, values in exact.items()},
        "metric_untouched": int(metrics["mse"].total),
        "rows_per_rank": lightspeed.gather_object(local_rows),
        "ids": torch.cat(ids).tolist(),
        "mse": torch.nn.functional.mse_loss(pred, target).item(),
        "pred": pred.tolist(),
    }


def main() -> None:
    out = Path(sys.argv[1])
    results = {name: evaluate(name) for name in sys.argv[2].split(",")}
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
