"""Worker: Ulysses sequence parallelism in a Fabric loop, ``ZeroFabricStrategy(stage, sequence_parallel_size=2)``.

usage: zero_sequence_parallel.py OUT STAGE TILED_LOGITS   (OUT/pretrained: written by the test; TILED_LOGITS: the
strategy's ``tiled_logits_loss``, 0 for off or the tokens per chunk)

The model is built under ``fabric.init_module()``; one step, ``fabric.save(OUT/ck_<STAGE>)``, then a new model and
optimizer ``fabric.load`` it and train the second step from the loader's second batch. Each rank writes
OUT/result_<rank>.pt: the gathered weights, the losses the loop saw, and the loss of another model in the process
on whole sequences before and after sequence parallelism was installed, the metrics ``lightspeed.exact_metrics``
computed with the model before training (per-token predictions of every rank's slices, on all rows but the last), and
the error of a hand-written ``gather_for_metrics`` of a slice.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Subset

import lightspeed
from _support import long_context
from _support.models import full_state_dict
from _support.outcomes import error_text


def build(fabric: L.Fabric, pretrained: Path) -> tuple[Any, Any]:
    with fabric.init_module():
        model = long_context.load(pretrained)
    return fabric.setup(model, long_context.optimizer(model))


def main(out: Path, stage: int, tiled_logits: int) -> None:
    world = int(os.environ["WORLD_SIZE"])
    strategy = lightspeed.fabric.ZeroFabricStrategy(
        stage=stage, sequence_parallel_size=2, tiled_logits_loss=tiled_logits or False
    )
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=world)
    fabric.launch()
    data = DataLoader(long_context.PaddedTokens(), batch_size=long_context.BATCH, shuffle=True)
    loader = fabric.setup_dataloaders(data)
    batches = iter(loader)
    other = long_context.load(out / "pretrained")  # another model in the process: its attention stays its own
    whole = long_context.collate(long_context.PaddedTokens(), [0, 1])
    other_before = float(other(**whole).loss.detach())
    model, optimizer = build(fabric, out / "pretrained")
    other_after = float(other(**whole).loss.detach())
    rows = Subset(long_context.PaddedTokens(), range(long_context.SAMPLES - 1))
    evaluation = fabric.setup_dataloaders(DataLoader(rows, batch_size=long_context.BATCH))

    @torch.no_grad()
    def step(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return model(**batch).logits.argmax(-1), batch["shift_labels"]

    metrics = lightspeed.exact_metrics(evaluation, step, long_context.token_metrics(), gather_every=1)
    by_hand = error_text(
        lambda: [lightspeed.gather_for_metrics(batch["input_ids"]) for batch in lightspeed.track(evaluation)]
    )
    losses = []
    for step in range(2):
        if step == 1:  # resume from the checkpoint of step 1 in a new model and optimizer
            fabric.save(out / f"ck_{stage}", {"model": model, "optimizer": optimizer})
            model, optimizer = build(fabric, out / "pretrained")
            fabric.load(out / f"ck_{stage}", {"model": model, "optimizer": optimizer})
        loss = model(**next(batches)).loss
        fabric.backward(loss, model=model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    result = {
        "state": full_state_dict(model.module),
        "losses": losses,
        "other": (other_before, other_after),
        "metrics": metrics,
        "by_hand": by_hand,
    }
    torch.save(result, out / f"result_{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
