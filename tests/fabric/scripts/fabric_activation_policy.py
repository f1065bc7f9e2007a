"""Worker: ``activation_checkpointing_policy={Block}`` under Fabric: the Trainer worker's model and data
(``tests/strategies/scripts/zero_activation_policy.py``) in a hand-written Fabric loop, 3 steps under each stage on
2 ranks, without and with the policy. Rank 0 writes OUT/result.pt as the Trainer worker does.

usage: fabric_activation_policy.py OUT STAGE[,STAGE...]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightspeed
from _support.models import full_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "strategies" / "scripts"))
from zero_activation_policy import (  # noqa: E402  (the same model, data and counters as the Trainer's worker)
    CALLS,
    SECTION_ARGUMENTS,
    STEPS,
    Block,
    Net,
    count_checkpoint_calls,
    data,
    deepspeed_settings,
    initial_weights,
)


def train(stage: int, policy: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds

    ds.SYNCHRONIZE, ds.num_layers = False, None  # what a run that configures nothing leaves
    extra: dict[str, Any] = {"activation_checkpointing_policy": {Block}, **SECTION_ARGUMENTS} if policy else {}
    strategy = lightspeed.fabric.ZeroFabricStrategy(stage=stage, **extra)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    L.seed_everything(0, verbose=False)
    net = Net()
    net.load_state_dict(initial_weights())
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(DataLoader(data(), batch_size=4))
    CALLS.update(forward=0, checkpoint=0)
    for x, y in loader:
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    facts = {
        **CALLS,
        "section": strategy.config.get("activation_checkpointing"),
        "deepspeed": deepspeed_settings(),
    }
    assert len(loader) == STEPS
    return full_state_dict(net), facts


def main(out: Path, stages: list[int]) -> None:
    count_checkpoint_calls()
    result: dict[str, Any] = {"weights": {}, "facts": {}}
    for stage in stages:
        for policy in (False, True):
            label = f"zero{stage}.{'policy' if policy else 'plain'}"
            weights, facts = train(stage, policy)
            result["weights"][label] = weights
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, facts)
            result["facts"][label] = gathered
    if torch.distributed.get_rank() == 0:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")])
