"""The narrowest lossless wire dtype for integer tensors (the distributed round trip: test_gather_distributed.py)."""

from __future__ import annotations

import pytest
import torch

from lightspeed.core.gather.wire import narrowest_code, wire_dtype


@pytest.mark.parametrize(
    ("values", "dtype", "wire"),
    [
        ([0, 255], torch.int64, torch.uint8),
        ([-1, 127], torch.int64, torch.int8),
        ([-129, 5], torch.int64, torch.int16),
        ([0, 256], torch.int64, torch.int16),
        ([0, 2**31 - 1], torch.int64, torch.int32),
        ([0, 2**31], torch.int64, torch.int64),
        ([0, 70_000], torch.int32, torch.int32),
        ([0, 3], torch.int16, torch.uint8),
        ([0, 3], torch.uint8, torch.uint8),
        ([0.0, 3.0], torch.float32, torch.float32),
        ([True, False], torch.bool, torch.bool),
        ([], torch.int64, torch.int64),
    ],
)
def test_narrowest_wire_dtype_holds_every_value(values, dtype, wire):
    tensor = torch.tensor(values, dtype=dtype)
    code = narrowest_code(tensor)
    assert wire_dtype(code, dtype) == wire
    assert torch.equal(tensor.to(wire).to(dtype), tensor), "lossless"


def test_unknown_wire_code_is_refused():
    with pytest.raises(ValueError, match="unknown wire code 9 for a torch.int64 tensor"):
        wire_dtype(9, torch.int64)
