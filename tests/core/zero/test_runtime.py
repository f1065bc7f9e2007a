"""DeepSpeed's runtime as lightspeed sets it up per process: on CUDA, each local rank trains on the GPU of its index
(DeepSpeed selects the device by the local rank), checked before the process group exists with the way to choose
other GPUs in the error."""

from __future__ import annotations

import pytest
import torch

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.runtime import check_device_of_local_rank


def test_each_local_rank_trains_on_the_gpu_of_its_index() -> None:
    for local_rank in range(3):
        check_device_of_local_rank(torch.device("cuda", local_rank), local_rank)
    with pytest.raises(DeepSpeedConfigError) as raised:
        check_device_of_local_rank(torch.device("cuda", 2), 0)
    assert str(raised.value) == (
        "The process of local rank 0 was given cuda:2, but ZeRO trains local rank 0 on cuda:0. Choose the GPUs with "
        "CUDA_VISIBLE_DEVICES instead of the device indices (e.g. CUDA_VISIBLE_DEVICES=2 for this one) and pass "
        "devices=<how many>."
    )
