"""The micro-batch one rank of a sequence-parallel group trains on: its slice of every sequence.

All ranks of a group receive the same rows (the sampler runs over the data-parallel groups). Each one pads the
sequence on the right to a multiple of the group size, shifts the labels on the whole sequence (a slice's last target
is the next slice's first token), adds the global ``position_ids`` (RoPE and the causal order of the gathered
sequence depend on them) and keeps its own slice. ``num_items_in_batch`` counts the real targets of the whole
micro-batch, so that each rank's summed loss divided by it adds up, over the group, to the micro-batch's token mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from lightspeed.core.errors import SequenceParallelError

__all__ = ["IGNORE_INDEX", "SHARDED_KEYS", "shard_batch"]

IGNORE_INDEX = -100
#: the keys :func:`shard_batch` reads; every other key passes through unchanged
SHARDED_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def shard_batch(batch: Any, rank: int, size: int, pad_token_id: int = 0) -> dict[str, Any]:
    """This rank's slice of ``batch`` (a mapping with ``input_ids`` and usually ``labels``, both ``[batch, seq]``):
    ``input_ids``, ``position_ids`` and, with labels, ``labels`` and ``shift_labels`` (both the shifted labels, so
    the model's loss does not shift again) and ``num_items_in_batch`` (the real targets of the whole micro-batch).
    ``attention_mask`` is checked (right padding only) and dropped: the sequence-parallel attention is causal over
    the gathered sequence, and pads after the last real token change nothing before it."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise SequenceParallelError(
            "sequence_parallel_size > 1 splits a batch along its sequence and needs it as a mapping with "
            f"'input_ids' (and 'labels'), as HuggingFace collators make it; got {_describe(batch)}."
        )
    input_ids = _two_dimensional(batch, "input_ids")
    rows, length = input_ids.shape
    labels = _two_dimensional(batch, "labels", length) if batch.get("labels") is not None else None
    if batch.get("attention_mask") is not None:
        _check_right_padded(_two_dimensional(batch, "attention_mask", length))
    if batch.get("position_ids") is not None:
        _check_plain_positions(_two_dimensional(batch, "position_ids", length))
    _check_no_other_sequences(batch, length)

    padded = length + (-length) % size
    pad = padded - length
    if pad:
        input_ids = F.pad(input_ids, (0, pad), value=pad_token_id)
    chunk = padded // size
    cols = slice(rank * chunk, (rank + 1) * chunk)
    positions = torch.arange(padded, device=input_ids.device).expand(rows, -1)

    sharded = {key: value for key, value in batch.items() if key not in SHARDED_KEYS}
    sharded["input_ids"] = input_ids[:, cols]
    sharded["position_ids"] = positions[:, cols]
    if labels is not None:
        shifted = F.pad(labels, (0, pad + 1), value=IGNORE_INDEX)[:, 1:]
        sharded["labels"] = sharded["shift_labels"] = shifted[:, cols].contiguous()
        sharded["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
    return sharded


def _describe(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return f"a mapping with keys {sorted(map(str, batch))}"
    return f"a {type(batch).__name__}"


def _two_dimensional(batch: Mapping[str, Any], key: str, length: int | None = None) -> torch.Tensor:
    value = batch[key]
    if not isinstance(value, torch.Tensor) or value.ndim != 2:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise SequenceParallelError(
            f"sequence_parallel_size > 1 needs batch[{key!r}] as a [batch, sequence] tensor; got {shape}."
        )
    if length is not None and value.shape[1] != length:
        raise SequenceParallelError(
            f"batch[{key!r}] has {value.shape[1]} positions but input_ids has {length}: they must be the same "
            "sequence to be split together."
        )
    return value


def _check_right_padded(mask: torch.Tensor) -> None:
    # right padding: every row is ones, then zeros (never a one after a zero)
    if bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise SequenceParallelError(
            "sequence parallelism attends causally over the whole sequence and ignores attention_mask, so padding "
            "must be on the right (a real token after a pad would attend to it). Pad on the right "
            "(tokenizer.padding_side = 'right'), and do not pack several documents into one sequence."
        )


def _check_plain_positions(positions: torch.Tensor) -> None:
    expected = torch.arange(positions.shape[1], device=positions.device).expand_as(positions)
    if not torch.equal(positions, expected):
        raise SequenceParallelError(
            "batch['position_ids'] is not 0, 1, 2, ... in every row (packed sequences or left padding): sequence "
            "parallelism cannot keep documents apart. Leave position_ids out (lightspeed adds them) and pad on the "
            "right."
        )


def _check_no_other_sequences(batch: Mapping[str, Any], length: int) -> None:
    others = [
        key
        for key, value in batch.items()
        if key not in SHARDED_KEYS and isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == length
    ]
    if others:
        raise SequenceParallelError(
            f"batch key(s) {others} have the sequence dimension too, and sequence parallelism splits only "
            f"{', '.join(SHARDED_KEYS)}: leave them out of the batch, or compute what needs them inside the model."
        )
