"""The permutation that puts rank-major gathered rows into the sampler's global order (position * world + rank)."""

from __future__ import annotations

import random

import torch

from lightspeed.core.gather.accounting import global_order as _order


def sort_by_global_position(valid: tuple[int, ...], start: tuple[int, ...], world: int) -> list[int]:
    """Reference: list every gathered row with its global position and sort (plain Python)."""
    rows, offset = [], 0
    for rank, (count, first) in enumerate(zip(valid, start, strict=True)):
        rows += [((first + i) * world + rank, offset + i) for i in range(count)]
        offset += count
    return [row for _, row in sorted(rows)]


def test_order_matches_sorting_by_global_position_for_equal_and_unequal_starts():
    rng = random.Random(0)
    for _ in range(1000):
        world = rng.randint(1, 4)
        valid = tuple(rng.randint(0, 6) for _ in range(world))
        first = rng.randint(0, 5)
        start = (first,) * world if rng.random() < 0.7 else tuple(rng.randint(0, 5) for _ in range(world))
        assert _order(valid, start, world).tolist() == sort_by_global_position(valid, start, world), (valid, start)


def test_last_batch_with_fewer_real_rows_on_later_ranks():
    # 3 ranks at positions 4, 5: ranks 0 and 1 hold two real rows, rank 2 one (the sampler padded its second)
    assert _order((2, 2, 1), (4, 4, 4), 3).tolist() == [0, 2, 4, 1, 3]
    assert isinstance(_order((0, 0), (0, 0), 2), torch.Tensor) and _order((0, 0), (0, 0), 2).numel() == 0
