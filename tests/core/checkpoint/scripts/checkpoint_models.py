"""Small models for the export tests: tied weights, a frozen layer, odd sizes that force padding, two parameter
groups, persistent and non-persistent buffers. Imported by the worker scripts and by the tests (fresh modules)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH, HIDDEN = 53, 24, 37
BIG_IN, BIG_OUT = 523, 1021  # > 2 x 262144 elements: big enough for DeepSpeed to swap it to NVMe (1 MB per rank)


class TinyLM(nn.Module):
    """An embedding tied to the output head, one frozen projection, a norm, an MLP and an optional big layer."""

    def __init__(self, big: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.frozen_proj = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.big = nn.Linear(BIG_IN, BIG_OUT) if big else None
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.frozen_proj.requires_grad_(False)
        self.register_buffer("position_scale", torch.linspace(0.5, 1.5, WIDTH))
        self.register_buffer("seen_batches", torch.zeros((), dtype=torch.long))
        self.register_buffer("scratch", torch.ones(BIG_IN), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h * self.position_scale.to(h.dtype)
        h = self.frozen_proj(h)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        logits = self.head(h)
        if self.big is not None:
            logits = logits + self.big(self.scratch.to(h.dtype)).mean()
        return logits

    def param_groups(self) -> list[dict]:
        """Two groups with different weight decay; the frozen projection is in neither."""
        first = [self.embed.weight, self.up.weight, self.up.bias]
        ids = {id(p) for p in first}
        rest = [p for p in self.parameters() if p.requires_grad and id(p) not in ids]
        return [{"params": first, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


class SharedBlocks(nn.Module):
    """One block registered twice in one parent (``nn.Sequential(block, act, block)``) and once more at the top: the
    state dict names the same weights ``block.*``, ``body.0.*`` and ``body.2.*``; DeepSpeed records only ``body.0``
    as shared (its walk over ``named_children()`` skips the repeat)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.Linear(WIDTH, WIDTH)
        self.body = nn.Sequential(self.block, nn.Tanh(), self.block)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))

    def param_groups(self) -> list[dict]:
        return [{"params": list(self.parameters()), "weight_decay": 0.01}]


def tiny_gpt2_config():
    """A two-layer GPT-2 config with odd sizes, built locally (no download)."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=61, n_positions=16, n_embd=20, n_layer=2, n_head=2, tie_word_embeddings=True)


class HFWrapper(nn.Module):
    """A module holding a Hugging Face causal LM under ``self.model``, as a LightningModule usually does."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2LMHeadModel

        self.model = GPT2LMHeadModel(tiny_gpt2_config())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits

    def param_groups(self) -> list[dict]:
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]
        return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def batch(step: int, seq: int = 7, rows: int = 3, vocab: int = VOCAB) -> torch.Tensor:
    """Deterministic token ids for one step."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (rows, seq), generator=generator)
