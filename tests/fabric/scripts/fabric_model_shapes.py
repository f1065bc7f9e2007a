"""Worker: model shapes under Fabric's ZeRO-3 (with and without offload) on 2 CPU ranks, fp32: an
``nn.TransformerEncoder`` built under ``fabric.init_module()`` (it deep-copies its layer while ZeRO-3 partitions what
is built), set up and trained ``STEPS`` steps; an MLP initialised again by its parent, gathered right after
``fabric.init_module()``; a layer some micro-batches skip, accumulated over 2 with ``lightspeed.fabric.accumulate``,
under every ZeRO stage with and without optimizer offload (AdamW), resumed from a checkpoint under ZeRO-2 and ZeRO-3
with offload, with ``unused_parameters="zero_gradient"``, with SGD (momentum, weight decay), and with NAdam (an error).

Rank 0 writes OUT/result.pt: the gathered weights per strategy name (``reinitialized``: the MLP's, under zero3).

usage: fabric_model_shapes.py OUT NAME[,NAME...]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightspeed
from _support import model_shapes as ms
from _support.models import full_state_dict, rank_batches


def encoder_under_init_module(name: str) -> dict[str, torch.Tensor]:
    fabric = L.Fabric(strategy=name, accelerator="cpu", devices=2)
    fabric.launch()
    with fabric.init_module():
        model = ms.EncoderRegressor()
    optimizer = ms.encoder_optimizer(model)
    engine, optimizer = fabric.setup(model, optimizer)
    x, y = ms.encoder_data().tensors
    for ranks in ms.encoder_steps():
        index = torch.tensor(ranks[fabric.global_rank])
        optimizer.zero_grad()
        fabric.backward(ms.encoder_loss(engine, x[index], y[index]))
        optimizer.step()
    return full_state_dict(model)


def reinitialized_under_init_module() -> dict[str, torch.Tensor]:
    fabric = L.Fabric(strategy="zero3", accelerator="cpu", devices=2)
    fabric.launch()
    with fabric.init_module():
        model = ms.ReinitializedMLP()
    return full_state_dict(model)


def sometimes_skipped(
    strategy: str | lightspeed.fabric.ZeroFabricStrategy,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    save_to: Path | None = None,
) -> dict[str, torch.Tensor]:
    """Train the sometimes-skipped layer's windows; with ``save_to``: the first ``ms.SAVED_WINDOWS``, saved there,
    then the rest in a new Fabric, model and engine resumed from it."""
    x, y = ms.skip_data().tensors
    micro_batches = rank_batches(len(x), 2, ms.SKIP_BATCH, epoch=0)
    split = 2 * ms.SAVED_WINDOWS if save_to is not None else len(micro_batches)
    fabric, model, engine, optimizer = _skip_setup(strategy, optimizer_class)
    _train_windows(fabric, engine, optimizer, micro_batches[:split], first=0)
    if save_to is not None:
        fabric.save(save_to, {"model": engine, "optimizer": optimizer})
        fabric, model, engine, optimizer = _skip_setup(strategy, optimizer_class)
        fabric.load(save_to, {"model": engine, "optimizer": optimizer})
        _train_windows(fabric, engine, optimizer, micro_batches[split:], first=split)
    return full_state_dict(model)


def _skip_setup(strategy: Any, optimizer_class: type[torch.optim.Optimizer]) -> tuple[Any, Any, Any, Any]:
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    model = ms.SometimesSkipped()
    engine, optimizer = fabric.setup(model, ms.skip_optimizer(model.parameters(), optimizer_class))
    return fabric, model, engine, optimizer


def _train_windows(fabric: Any, engine: Any, optimizer: Any, micro_batches: list[list[list[int]]], first: int) -> None:
    """Train on ``micro_batches`` (each rank's indices), the first being micro-batch ``first`` of the epoch."""
    x, y = ms.skip_data().tensors
    mine = [torch.tensor(ranks[fabric.global_rank]) for ranks in micro_batches]
    batches = [(x[index], y[index]) for index in mine]
    for (xb, yb), step in lightspeed.fabric.accumulate(fabric, engine, batches, steps=2):
        step.backward(torch.nn.functional.mse_loss(engine(xb, ms.uses_skippable(first + step.index)), yb))
        if step.sync_gradients:
            optimizer.step()
            optimizer.zero_grad()


def error_of(run: Callable[[], object]) -> str:
    try:
        run()
    except Exception as err:  # noqa: BLE001 (the message is what the test reads)
        return f"{type(err).__name__}: {err}"
    return "no error"


def main() -> None:
    out = Path(sys.argv[1])
    result = {name: encoder_under_init_module(name) for name in sys.argv[2].split(",")}
    result["reinitialized"] = reinitialized_under_init_module()
    result.update({f"skipped_{name}": sometimes_skipped(name) for name in ms.SKIP_STRATEGIES})
    for name in ("zero2", "zero3_offload"):
        result[f"resumed_{name}"] = sometimes_skipped(name, save_to=out / f"resumed_{name}")
    result["zero_gradient"] = sometimes_skipped(lightspeed.fabric.ZeroFabricStrategy(unused_parameters="zero_gradient"))
    result["sgd_momentum"] = sometimes_skipped("zero2", torch.optim.SGD)
    result["nadam"] = error_of(lambda: sometimes_skipped("zero2", torch.optim.NAdam))
    if torch.distributed.get_rank() == 0:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main()
