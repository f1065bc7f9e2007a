"""Pages of a CPU tensor given back to the system: the contents read as zeros afterwards, the pages are no longer
resident, and the partial pages at the tensor's ends (other data may share them) are written, never given back."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from _support.process_memory import resident_bytes
from lightspeed.core.common.page_release import give_back_pages, zero_without_touching

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTNEED is Linux's")

MIB = 2**20


def test_zero_without_touching_gives_zeros_and_keeps_no_page_resident() -> None:
    whole = torch.arange(16 * MIB // 4, dtype=torch.float32) + 1  # written: every page resident
    inner = whole[1000 : whole.numel() - 1000]  # starts and ends inside a page
    assert resident_bytes(inner) >= inner.numel() * 4 - 2 * mmap.PAGESIZE
    zero_without_touching(inner)
    assert resident_bytes(inner) == 0  # before reading: a read maps the zero page
    assert torch.count_nonzero(inner) == 0
    assert torch.equal(whole[:1000], torch.arange(1000, dtype=torch.float32) + 1)  # the neighbours are kept
    assert whole[-1].item() == whole.numel()


def test_pages_given_back_read_as_zeros_and_cost_memory_again_only_where_written() -> None:
    tensor = torch.ones(8 * MIB // 4)
    assert give_back_pages(tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * 4)
    assert resident_bytes(tensor) == 0
    tensor[: MIB // 4] = 2.0
    assert resident_bytes(tensor) <= MIB + mmap.PAGESIZE
    page = mmap.PAGESIZE // 4
    assert tensor[: MIB // 4].eq(2.0).all() and torch.count_nonzero(tensor[MIB // 4 + page : -page]) == 0


def test_a_range_within_one_page_gives_nothing_back() -> None:
    tensor = torch.ones(100)
    assert not give_back_pages(tensor.data_ptr(), tensor.data_ptr() + 400)
    zero_without_touching(tensor)
    assert torch.count_nonzero(tensor) == 0
