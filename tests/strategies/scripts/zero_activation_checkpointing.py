"""Worker: a tiny GPT-2 language model trained 3 steps under each ZeRO stage on 2 ranks, with and without HF's
``gradient_checkpointing_enable()``; rank 0 saves the gathered weights per run into OUT/weights.pt.

usage: zero_activation_checkpointing.py OUT NAME[,NAME...]   (NAME: a strategy name, e.g. zero1, zero3_offload)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import full_state_dict
from _support.trainers import quiet_trainer

VOCAB, CONTEXT = 61, 12


def tiny_lm() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=24,
        n_layer=3,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randint(0, VOCAB, (24, CONTEXT), generator=generator))


class LanguageModel(L.LightningModule):
    def __init__(self, checkpointing: bool) -> None:
        super().__init__()
        self.model = tiny_lm()
        if checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def train(name: str, checkpointing: bool) -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    module = LanguageModel(checkpointing)
    trainer = quiet_trainer(
        strategy=name,
        accelerator="cpu",
        devices=2,
        max_steps=3,
    )
    trainer.fit(module, DataLoader(data(), batch_size=4))
    assert module.model.is_gradient_checkpointing == checkpointing
    return full_state_dict(module)


def main(out: Path, names: list[str]) -> None:
    weights = {}
    for name in names:
        for checkpointing in (False, True):
            for key, value in train(name, checkpointing).items():
                weights[f"{name}.{'ckpt' if checkpointing else 'plain'}.{key}"] = value
    if torch.distributed.get_rank() == 0:
        torch.save(weights, out / "weights.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
