"""Pad a batch's sequence length up to one of a few fixed lengths ("buckets"), so that an XLA device compiles one
graph per bucket instead of one per sequence length. Plain PyTorch: nothing here needs torch_xla.

* :func:`pad_to_bucket` pads a collated batch (tensors of shape ``(batch, sequence, ...)``);
* :func:`bucket_collate` makes a ``collate_fn`` that pads variable-length samples to the bucket of the batch's
  longest sample (with an attention mask marking the real tokens) and collates them.

Pad values go by the name a tensor has in its container: ``labels`` are padded with ``-100`` (what
``torch.nn.CrossEntropyLoss`` ignores), ``attention_mask`` with ``0``, everything else with ``pad_value``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import default_collate

from lightspeed.core.common.checks import require_whole_number
from lightspeed.core.xla.batch_tree import Path, format_path, leaf_name, map_tensors, tensor_leaves

__all__ = [
    "DEFAULT_BUCKETS",
    "DEFAULT_PAD_VALUES",
    "bucket_collate",
    "bucket_length",
    "check_buckets",
    "pad_to_bucket",
]

DEFAULT_BUCKETS = (128, 256, 512)

#: pad values by tensor name, unless the caller's ``pad_values`` say otherwise
DEFAULT_PAD_VALUES: Mapping[Any, int] = {"labels": -100, "attention_mask": 0}


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """``buckets`` as a tuple of positive, strictly increasing integers; else an error saying what to pass."""
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Collection):
        raise TypeError(
            f"buckets must be a sequence of sequence lengths, e.g. buckets=(128, 256, 512), got {buckets!r}."
        )
    values = tuple(buckets)
    if not values:
        raise ValueError("buckets is empty: pass the sequence lengths to pad to, e.g. buckets=(128, 256, 512).")
    lengths = []
    for value in values:
        try:
            length = operator.index(value)
        except TypeError:
            length = 0
        if isinstance(value, bool) or length < 1:
            raise ValueError(
                f"buckets must be positive whole numbers (sequence lengths), got {value!r} in buckets={values!r}."
            )
        lengths.append(length)
    if any(later <= earlier for earlier, later in zip(lengths, lengths[1:], strict=False)):
        raise ValueError(
            f"buckets must be strictly increasing, got buckets={values!r}: pass them sorted and without repeats,"
            f" buckets={tuple(sorted(set(lengths)))!r}."
        )
    return tuple(lengths)


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds a sequence of ``length``; an error if the largest bucket is too short."""
    checked = check_buckets(buckets)
    for bucket in checked:
        if length <= bucket:
            return bucket
    largest = checked[-1]
    raise ValueError(
        f"A sequence of length {length} is longer than the largest bucket {largest} (buckets={checked!r}). Add a"
        f" bucket of at least {length} to `buckets`, or truncate the sequences to at most {largest} tokens (for a"
        f" Hugging Face tokenizer: truncation=True, max_length={largest})."
    )


def _check_dim(dim: int) -> int:
    """``dim``, checked to be a sequence dimension: an integer >= 1 (dim 0 is the batch dimension)."""
    return require_whole_number(
        dim,
        1,
        f"dim must be the sequence dimension of the batch's tensors, an integer >= 1 (dim 0 is the batch"
        f" dimension), got dim={dim!r}.",
    )


def _pad_values(pad_values: Mapping[Any, float | int] | None, mask_key: str | None = None) -> dict[Any, float | int]:
    values: dict[Any, float | int] = dict(DEFAULT_PAD_VALUES)
    if mask_key is not None:
        values.setdefault(mask_key, 0)
    values.update(pad_values or {})
    return values


def _describe(batch: Any, root: str) -> str:
    leaves = [f"{format_path(path, root)} {tuple(t.shape)}" for path, t in tensor_leaves(batch)]
    return ", ".join(leaves) if leaves else "no tensors"


def _sequence_length(batch: Any, dim: int, keys: Collection[Any] | None, *, root: str, what: str, hint: str) -> int:
    """The length along ``dim`` of the tensors to pad (all must agree); errors for a batch with nothing to pad."""
    selected = [(path, t) for path, t in tensor_leaves(batch) if _selected(path, t, dim, keys)]
    if keys is not None:
        found = {leaf_name(path) for path, _ in selected}
        missing = [key for key in keys if key not in found]
        if missing:
            raise ValueError(
                f"keys={list(keys)!r} names {missing!r}, which {'is' if len(missing) == 1 else 'are'} not a tensor"
                f" with a dimension {dim} in the {what} ({_describe(batch, root)}). Name tensors of the {what} that"
                f" hold the sequence along dim {dim}."
            )
    if not selected:
        raise ValueError(
            f"Nothing to pad: the {what} has no tensor with a sequence dimension {dim} ({_describe(batch, root)})."
            f" {hint}"
        )
    lengths = {format_path(path, root): int(t.shape[dim]) for path, t in selected}
    if len(set(lengths.values())) > 1:
        listing = ", ".join(f"{name} {length}" for name, length in lengths.items())
        raise ValueError(
            f"The tensors to pad disagree on the sequence length along dim {dim}: {listing}. Pass keys=[...] naming"
            f" the tensors that hold the sequence (the others are left as they are)."
        )
    return next(iter(lengths.values()))


def _selected(path: Path, tensor: Tensor, dim: int, keys: Collection[Any] | None) -> bool:
    return tensor.ndim > dim and (keys is None or leaf_name(path) in keys)


def _fits(value: float | int, dtype: torch.dtype) -> bool:
    """Whether ``value`` is stored exactly in ``dtype`` (no wrap-around of -100 in uint8, no 0.5 in int64)."""
    if dtype.is_floating_point or dtype.is_complex:
        return True
    if dtype == torch.bool:
        return value in (0, 1)
    if float(value) != int(value):
        return False
    info = torch.iinfo(dtype)
    return info.min <= int(value) <= info.max


def _pad_tensor(tensor: Tensor, dim: int, target: int, value: float | int, name: str) -> Tensor:
    length = int(tensor.shape[dim])
    if length == target:
        return tensor
    if not _fits(value, tensor.dtype):
        raise ValueError(
            f"The pad value {value!r} for {name} does not fit its dtype {tensor.dtype}. Pass one that does, by the"
            f" tensor's name in pad_values={{name: value}}, or as pad_value=... for every tensor."
        )
    shape = list(tensor.shape)
    shape[dim] = target
    padded = tensor.new_full(shape, value)
    padded.narrow(dim, 0, length).copy_(tensor)
    return padded


def _pad_tree(
    batch: Any,
    dim: int,
    target: int,
    pad_value: float | int,
    values: Mapping[Any, float | int],
    keys: Collection[Any] | None,
    root: str,
) -> Any:
    def pad(path: Path, tensor: Tensor) -> Tensor:
        if not _selected(path, tensor, dim, keys):
            return tensor
        value = values.get(leaf_name(path), pad_value)
        return _pad_tensor(tensor, dim, target, value, format_path(path, root))

    return map_tensors(batch, pad)


def pad_to_bucket(
    batch: Any,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    *,
    dim: int = 1,
    pad_value: float | int = 0,
    pad_values: Mapping[Any, float | int] | None = None,
    keys: Collection[Any] | None = None,
) -> Any:
    """Pad the sequence dimension of a collated batch up to the smallest bucket that holds it.

    Args:
        batch: a tensor, or mappings, lists, tuples and dataclasses of tensors (a tokenizer's ``BatchEncoding``
            too); the containers come back with their types.
        buckets: the lengths to pad to, strictly increasing. A batch longer than the last one is an error.
        dim: the sequence dimension of the batch's tensors (``1`` for ``(batch, sequence, ...)``). Tensors with
            fewer dimensions (per-sample labels of shape ``(batch,)``) are left alone.
        pad_value: what padded positions hold, unless ``pad_values`` names the tensor.
        pad_values: pad values by the tensor's key (or index) in its container; added to the defaults
            ``{"labels": -100, "attention_mask": 0}``.
        keys: only pad the tensors with these keys (or indices); by default every tensor with a dimension ``dim``,
            all of which must have the same length along it.

    Returns:
        A new batch of the same structure; tensors already at the bucket length are returned as they are.

    Example::

        batch = pad_to_bucket(batch, buckets=(128, 256, 512), pad_value=tokenizer.pad_token_id)
    """
    checked = check_buckets(buckets)
    dim = _check_dim(dim)
    length = _sequence_length(
        batch,
        dim,
        keys,
        root="batch",
        what="batch",
        hint="pad_to_bucket pads a collated batch (tensors of shape (batch, sequence, ...)): call it on the output"
        " of the collate function, use lightspeed.xla.bucket_collate(...) as the DataLoader's collate_fn to pad"
        " samples, or set dim= to the sequence dimension.",
    )
    target = bucket_length(length, checked)
    return _pad_tree(batch, dim, target, pad_value, _pad_values(pad_values), keys, "batch")


def _as_tensors(sample: Any) -> Any:
    """Lists of numbers (what a tokenizer returns per sample) and NumPy arrays become tensors."""
    if isinstance(sample, list) and sample and all(isinstance(item, (int, float)) for item in sample):
        return torch.tensor(sample)
    if type(sample).__module__ == "numpy" and type(sample).__name__ == "ndarray":
        return torch.as_tensor(sample)
    if isinstance(sample, Mapping):
        return {key: _as_tensors(value) for key, value in sample.items()}
    if isinstance(sample, tuple) and hasattr(sample, "_fields"):
        return type(sample)(*(_as_tensors(value) for value in sample))
    if isinstance(sample, (list, tuple)):
        return type(sample)(_as_tensors(value) for value in sample)
    return sample


def bucket_collate(
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    *,
    dim: int = 1,
    pad_value: float | int = 0,
    pad_values: Mapping[Any, float | int] | None = None,
    keys: Collection[Any] | None = None,
    mask_key: str | None = "attention_mask",
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Callable[[list[Any]], Any]:
    """A ``collate_fn`` whose batches have a bucket's sequence length.

    Without ``collate_fn``: each sample (a mapping, tuple or list of tensors or of lists of numbers, or a tensor)
    is padded along its dimension ``dim - 1`` to the bucket of the batch's longest sample, then collated with
    ``torch.utils.data.default_collate``. Mapping samples without ``mask_key`` get one: ``1`` for the sample's
    real positions, ``0`` for the padding (``mask_key=None``: no mask).

    With ``collate_fn`` (e.g. a tokenizer's ``DataCollatorWithPadding``): its batch is padded with
    :func:`pad_to_bucket` (its own attention mask is padded with ``0``).

    The other arguments are :func:`pad_to_bucket`'s. They are checked here, when the DataLoader is built.

    Example::

        loader = DataLoader(dataset, batch_size=8, collate_fn=bucket_collate((128, 256, 512), pad_value=pad_id))

    Args:
        buckets: the lengths to pad to, strictly increasing (each batch takes the smallest that holds its longest
            sample).
        dim: the sequence dimension of the collated batch (of each sample: ``dim - 1``).
        pad_value: what padded positions hold, unless ``pad_values`` names the tensor.
        pad_values: pad values by the tensor's key (or index) in its sample; added to the defaults
            ``{"labels": -100, "attention_mask": 0}``.
        keys: only pad the tensors with these keys (or indices); by default every tensor with the sequence dimension.
        mask_key: the key of the attention mask added to mapping samples that have none; ``None``: no mask.
        collate_fn: the collate function to run first (e.g. a tokenizer's collator); its batch is then padded to the
            bucket.
    """
    checked = check_buckets(buckets)
    dim = _check_dim(dim)
    values = _pad_values(pad_values, mask_key)

    if collate_fn is not None:
        user_collate = collate_fn

        def collate_then_pad(samples: list[Any]) -> Any:
            return pad_to_bucket(
                user_collate(samples), checked, dim=dim, pad_value=pad_value, pad_values=values, keys=keys
            )

        return collate_then_pad

    sample_dim = dim - 1
    hint = (
        "bucket_collate pads samples whose sequences are tensors or lists of numbers; give each sample its"
        f" sequence along dim {sample_dim}, or set dim= (the batch's sequence dimension, the sample's plus one)."
    )

    def collate(samples: list[Any]) -> Any:
        if not samples:
            raise ValueError("bucket_collate got no samples to collate (an empty batch).")
        converted = [_as_tensors(sample) for sample in samples]
        lengths = [
            _sequence_length(sample, sample_dim, keys, root=f"samples[{index}]", what=f"sample {index}", hint=hint)
            for index, sample in enumerate(converted)
        ]
        target = bucket_length(max(lengths), checked)
        padded = []
        for index, (sample, length) in enumerate(zip(converted, lengths, strict=True)):
            sample = _pad_tree(sample, sample_dim, target, pad_value, values, keys, f"samples[{index}]")
            if mask_key is not None and isinstance(sample, Mapping) and mask_key not in sample:
                mask = torch.zeros(target, dtype=torch.long)
                mask[:length] = 1
                sample = {**sample, mask_key: mask}
            padded.append(sample)
        return default_collate(padded)

    return collate
