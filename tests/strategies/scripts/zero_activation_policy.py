"""Worker: ``activation_checkpointing_policy={Block}`` under the Trainer. A tiny model of 3 blocks (the first gets the
batch itself, which has no gradient; each block owns a parameter directly, which ZeRO-3 must gather for the
recomputation) trains 3 steps under each stage on 2 ranks, without and with the policy. Rank 0 writes OUT/result.pt:
the gathered weights of every run and, per run and rank, the calls of ``Block.forward`` and of
``deepspeed.checkpointing.checkpoint`` during ``fit``, the resolved ``activation_checkpointing`` section and DeepSpeed's
checkpointing settings afterwards.

usage: zero_activation_policy.py OUT STAGE[,STAGE...]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed
from _support.models import full_state_dict
from _support.trainers import quiet_trainer

WIDTH, BLOCKS, STEPS = 16, 3, 3
#: the section arguments of the checkpointed runs: two that Lightning's own configure call would drop
SECTION_ARGUMENTS: dict[str, Any] = {"synchronize_checkpoint_boundary": True, "number_checkpoints": BLOCKS}
CALLS = {"forward": 0, "checkpoint": 0}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.gain = nn.Parameter(torch.full((WIDTH,), 0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS["forward"] += 1
        return x + self.gain * torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(4 * STEPS * 2, WIDTH, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def initial_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return Net().state_dict()


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.net.load_state_dict(initial_weights())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def count_checkpoint_calls() -> None:
    """Count the calls of ``deepspeed.checkpointing.checkpoint`` (the policy looks it up at every call)."""
    from deepspeed import checkpointing

    original = checkpointing.checkpoint

    def counted(*args: Any, **kwargs: Any) -> Any:
        CALLS["checkpoint"] += 1
        return original(*args, **kwargs)

    checkpointing.checkpoint = counted


def deepspeed_settings() -> dict[str, Any]:
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds

    return {"synchronize": ds.SYNCHRONIZE, "num_layers": ds.num_layers, "cpu": ds.CPU_CHECKPOINT}


def train(stage: int, policy: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds

    ds.SYNCHRONIZE, ds.num_layers = False, None  # what a run that configures nothing leaves
    L.seed_everything(0, verbose=False)
    module = Regression()
    extra: dict[str, Any] = {"activation_checkpointing_policy": {Block}, **SECTION_ARGUMENTS} if policy else {}
    strategy = lightspeed.strategies.ZeroStrategy(stage=stage, **extra)
    trainer = quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
    )
    CALLS.update(forward=0, checkpoint=0)
    trainer.fit(module, DataLoader(data(), batch_size=4))
    facts = {
        **CALLS,
        "section": strategy.config.get("activation_checkpointing"),
        "deepspeed": deepspeed_settings(),
    }
    return full_state_dict(module.net), facts


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
