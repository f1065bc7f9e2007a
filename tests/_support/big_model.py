"""A Llama-style causal LM too big to train in a capped memory without NVMe offload, shared by the memory-cap test
and ``bench/big_model.py``: its config (a small vocabulary, so that no single weight dominates the partitions),
the pretrained files written with random weights, the data, and the one-process reference a ZeRO run is compared with.
Nothing is downloaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from _support.models import rank_batches

WORLD, BATCH, SEQ, SAMPLES, LR, EPS = 2, 1, 32, 16, 1e-3, 1e-3


@dataclass(frozen=True)
class BigModelShape:
    """The model's size: ``hidden`` x ``layers`` (intermediate 2.75 x hidden), ``vocab`` tokens, untied embeddings."""

    hidden: int = 1024
    layers: int = 19
    vocab: int = 8192

    def config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=int(self.hidden * 2.75),
            num_hidden_layers=self.layers,
            num_attention_heads=max(self.hidden // 128, 1),
            num_key_value_heads=max(self.hidden // 128, 1),
            max_position_embeddings=SEQ * 4,
            tie_word_embeddings=False,
        )

    def parameters(self) -> int:
        with torch.device("meta"):
            from transformers import LlamaForCausalLM

            return sum(p.numel() for p in LlamaForCausalLM(self.config()).parameters())

    def flops_per_token(self) -> int:
        """Training FLOPs per token of a ``SEQ``-token sequence (forward and backward, 3x the forward): every weight but
        the input embedding (a lookup) multiplies the token (2 FLOPs a weight), and in every layer attention compares
        it with the sequence's tokens (scores and weighted sum: 4 x hidden FLOPs a token pair)."""
        forward = 2 * (self.parameters() - self.vocab * self.hidden) + 4 * self.layers * self.hidden * SEQ
        return 3 * forward

    def as_args(self) -> list[str]:
        return ["--hidden", str(self.hidden), "--layers", str(self.layers), "--vocab", str(self.vocab)]


def write_pretrained(path: Path, shape: BigModelShape) -> None:
    """Random weights as sharded safetensors (what ``from_pretrained`` reads), built one layer at a time in fp32."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    LlamaForCausalLM(shape.config()).save_pretrained(path, max_shard_size="200MB")


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(3))


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with ``eps`` large enough that reduction-order noise cannot flip a near-zero update."""
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)


def lm_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def reference(pretrained: Path, vocab: int, steps: int) -> dict[str, torch.Tensor]:
    """One plain process on the global batches (both ranks' micro-batches, each rank's loss averaged): every weight
    after ``steps`` steps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pretrained)
    model.train()
    opt = optimizer(model)
    data = tokens(vocab)
    for step_batches in rank_batches(SAMPLES, WORLD, BATCH, epoch=0)[:steps]:
        loss = sum(lm_loss(model, data[indices]) for indices in step_batches) / WORLD
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {key: value.detach() for key, value in model.state_dict().items()}
