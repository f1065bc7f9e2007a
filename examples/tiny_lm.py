"""A tiny character-level transformer language model and its generated training text, shared by the example and the
benchmarks. Plain PyTorch: nothing here knows about Lightning or lightspeed."""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.utils.data import Dataset

ALPHABET = "\n abcdefghijklmnopqrstuvwxyz0123456789+=.,"


def generate_corpus(n_lines: int, seed: int) -> str:
    """A deterministic toy corpus with learnable structure: sums and simple sentences."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the robot", "a bird"]
    verbs = ["sees", "likes", "follows", "finds", "helps"]
    objects = ["the ball", "a tree", "the river", "a small house", "the moon"]
    lines = []
    for _ in range(n_lines):
        if rng.random() < 0.5:
            a, b = rng.randint(0, 49), rng.randint(0, 49)
            lines.append(f"{a}+{b}={a + b}.")
        else:
            lines.append(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}.")
    return "\n".join(lines) + "\n"


class CharWindows(Dataset):
    """Non-overlapping windows of ``length + 1`` characters: input is the first ``length``, target the shift."""

    def __init__(self, text: str, length: int) -> None:
        ids = torch.tensor([ALPHABET.index(c) for c in text], dtype=torch.long)
        count = (len(ids) - 1) // length
        self.windows = ids[: count * length + 1]
        self.length, self.count = length, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.length
        chunk = self.windows[start : start + self.length + 1]
        return chunk[:-1], chunk[1:]


class TinyGPT(nn.Module):
    """A decoder-only transformer: token + position embeddings, pre-norm causal blocks, tied output head."""

    def __init__(self, vocab: int, context: int, width: int = 128, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as in GPT-2
        # GPT-2's embedding init: with torch's default N(0, 1) the tied head starts with logits of std ~17 (a loss
        # of ~80 instead of ln(vocab)), which short runs never recover from
        for embedding in (self.tokens, self.positions):
            nn.init.normal_(embedding.weight, std=0.02)
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        x = self.blocks(x, mask=self.causal_mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))
