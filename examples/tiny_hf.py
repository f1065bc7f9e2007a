"""Tiny HuggingFace models built locally, shared by ``finetune_pretrained.py`` and ``distill.py``: a character-level
``PreTrainedTokenizerFast`` over the toy alphabet of ``tiny_lm.py``, small GPT-2 configs, and a "pretrained" directory
written with ``save_pretrained`` after a few quick steps of plain single-process training. Nothing is downloaded, and
nothing here knows about Lightning or lightspeed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from tiny_lm import ALPHABET
from torch import nn
from torch.utils.data import DataLoader, Dataset

EOS = "\n"  # one line of the corpus is one "document": generation stops at the end of the line


def char_tokenizer() -> Any:
    """One token per character of ``ALPHABET`` (ids equal to ``ALPHABET.index``) plus ``<unk>``; the newline is the
    end-of-sequence and padding token, padding on the left (batched generation with a decoder-only model)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: index for index, char in enumerate(ALPHABET)}
    vocab["<unk>"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character a token
    backend.decoder = decoders.Fuse()  # decode by concatenation
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token=EOS, eos_token=EOS, pad_token=EOS, padding_side="left"
    )


def gpt2_config(tokenizer: Any, context: int, width: int, layers: int, heads: int = 4) -> Any:
    """A small GPT-2 for ``tokenizer``'s vocabulary (no dropout: short runs learn faster and evaluate exactly)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=context,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


class TokenWindows(Dataset):
    """Non-overlapping windows of ``length + 1`` tokens of ``text``: the input is the first ``length``, the target
    the next token at every position."""

    def __init__(self, tokenizer: Any, text: str, length: int) -> None:
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        self.count = (len(ids) - 1) // length
        self.ids, self.length = ids[: self.count * length + 1], length

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[index * self.length : (index + 1) * self.length + 1]
        return chunk[:-1], chunk[1:]


def perplexity(model: Any, windows: TokenWindows, batch_size: int = 64) -> float:
    """Perplexity of a causal LM over every token of ``windows`` (one process, no gradients)."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, target in DataLoader(windows, batch_size=batch_size):
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits.float()
            total += nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").item()
            count += target.numel()
    return math.exp(total / count)


def write_pretrained(
    directory: Path,
    text: str,
    *,
    context: int,
    width: int,
    layers: int,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    shards: int = 4,
) -> dict[str, float]:
    """Train a GPT-2 of this size on ``text`` for ``steps`` steps (plain PyTorch, one process), then write it with its
    tokenizer to ``directory`` as ``save_pretrained`` does for a published model: ``config.json``,
    ``generation_config.json``, about ``shards`` safetensors files with their index, and the tokenizer files. Returns
    the training loss of the first and the last step."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    tokenizer = char_tokenizer()
    model = GPT2LMHeadModel(gpt2_config(tokenizer, context, width, layers))
    loader = DataLoader(TokenWindows(tokenizer, text, context), batch_size=batch_size, shuffle=True, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses: list[float] = []
    model.train()
    while len(losses) < steps:
        for ids, target in loader:
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits  # "\n" is also the pad token
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size=max(size // shards, 1))
    tokenizer.save_pretrained(directory)
    return {"first_loss": losses[0] if losses else math.nan, "last_loss": losses[-1] if losses else math.nan}
