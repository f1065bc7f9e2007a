"""Worker: a Fabric loop under ZeRO-3 (2 ranks, fp32) evaluating two dataloaders whose ranks run different numbers of
batches (``tests/_support/uneven_evaluation.py``) inside ``lightspeed.gathered_for_evaluation``, gathering each
dataloader's outputs once after its loop with ``lightspeed.gather_for_metrics``, and the same two plus a third that
gives rank 1 no batch through ``lightspeed.exact_metrics``; then one training step (the engine goes on after the
gathered evaluation), the same evaluations again, and ``enabled=False`` (the model may not be gathered: a clear error
on every rank instead of a hang).

usage: fabric_uneven_evaluation.py OUT
Rank 0 writes OUT/fabric.json: per rank, per evaluation whether the model was gathered, the batches run and the metrics
per dataloader; whether the parameters were partitioned again afterwards; the error of ``enabled=False``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightspeed
from _support.models import make_net
from _support.uneven_evaluation import FABRIC_LOADERS, MODEL_SEED, SHARDS, TIMEOUT_S, dataset, metrics, shard_loader
from lightspeed.fabric import ZeroFabricStrategy


def evaluate(model: Any, loaders: list[Any]) -> dict[str, Any]:
    """The documented loop: gathered for the evaluation, one gather per dataloader after its loop."""
    result: dict[str, Any] = {"batches": [], "metrics": []}
    model.eval()
    with torch.no_grad(), lightspeed.gathered_for_evaluation(model, *loaders) as gathered:
        for loader in loaders:
            preds, labels = [], []
            for x, y in lightspeed.track(loader):
                preds.append(model(x).argmax(-1))
                labels.append(y)
            pred, target = lightspeed.gather_for_metrics((torch.cat(preds), torch.cat(labels)), dataloader=loader)
            values = {}
            for name, metric in metrics().items():
                if isinstance(metric, torch.nn.Module):
                    metric.update(pred, target)
                    values[name] = float(metric.compute())
                else:
                    values[name] = float(metric(pred, target))
            result["batches"].append(len(preds))
            result["metrics"].append(values)
    result["gathered"] = gathered
    every_loader = [shard_loader(i, torch.distributed.get_rank()) for i in range(len(SHARDS))]
    with torch.no_grad(), lightspeed.gathered_for_evaluation(model, *every_loader):
        result["exact"] = [
            {
                name: float(value)
                for name, value in lightspeed.exact_metrics(
                    loader, lambda batch: (model(batch[0]).argmax(-1), batch[1]), metrics()
                ).items()
            }
            for loader in every_loader
        ]
    return result


def partitioned(model: Any) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = list(model.parameters())
    return all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params if not p.ds_persist) and not any(
        p.ds_active_sub_modules for p in params
    )


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    strategy = ZeroFabricStrategy(stage=3, timeout=timedelta(seconds=TIMEOUT_S))
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=2, precision="32-true")
    fabric.launch()
    rank = fabric.global_rank
    net = make_net(MODEL_SEED)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.0))  # lr 0: the reference weights
    loaders = [shard_loader(i, rank) for i in range(FABRIC_LOADERS)]
    facts: dict[str, Any] = {"evaluations": [evaluate(model, loaders)], "partitioned_after": [partitioned(model)]}

    model.train()  # the same batch on both ranks: the engine trains on after the gathered evaluation
    x, y = dataset().tensors
    fabric.backward(torch.nn.functional.cross_entropy(model(x[:4]), y[:4]))
    optimizer.step()
    optimizer.zero_grad()

    facts["evaluations"].append(evaluate(model, loaders))
    facts["partitioned_after"].append(partitioned(model))
    try:
        with lightspeed.gathered_for_evaluation(model, *loaders, enabled=False):
            facts["disabled"] = "no error"
    except Exception as err:  # noqa: BLE001 - the test reads the message
        facts["disabled"] = f"{type(err).__name__}: {err}"
    ranks = lightspeed.gather_object(facts)
    if rank == 0:
        (out / "fabric.json").write_text(json.dumps(ranks))


if __name__ == "__main__":
    main()
