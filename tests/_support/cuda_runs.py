"""The CUDA matrix both front ends are checked on (every ZeRO stage with and without offload, in fp32, bf16-mixed and
16-mixed) and the one comparison of a run's weights with one plain process, shared by the Trainer's and Fabric's
`gpu` tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from _support.models import make_net, reference_training, relative_update_error

PRESETS = ["zero1", "zero2", "zero3", "zero1_offload", "zero2_offload", "zero3_offload"]
PRECISIONS = ["32-true", "bf16-mixed", "16-mixed"]
#: ``NAME@PRECISION``, the runs without offload first: a GPU machine's first offload run waits for DeepSpeed's CPU Adam
#: to compile
RUNS = [
    f"{name}@{precision}"
    for offload in (False, True)
    for name in PRESETS
    for precision in PRECISIONS
    if name.endswith("_offload") == offload
]
#: steps of every run: fp16 starts at DeepSpeed's loss scale 2**16, which overflows (and skips) the first steps of a
#: LightningModule whose batch Lightning casts to fp16, targets included (4 steps were all skipped on an H200)
STEPS = 10
#: ``relative_update_error`` allowed per half precision: the weights rounded to 8 (bf16) or 11 (fp16) significand
#: bits (0.034 measured for bf16 over 4 steps on the CPU); the last of the 10 steps missed is 0.08, the first 0.62
HALF_TOLERANCE = {"bf16-mixed": 0.06, "16-mixed": 0.04}
HALF_DTYPES = {"bf16-mixed": ("bf16", "torch.bfloat16"), "16-mixed": ("fp16", "torch.float16")}


def cuda_devices() -> int:
    """Ranks for a CUDA launch: one per GPU, at most 2 (nccl takes one GPU per rank)."""
    return max(1, min(2, torch.cuda.device_count()))


def check_run(
    meta: dict,
    weights: dict[str, torch.Tensor],
    precision: str,
    batch: int,
    initial: dict[str, torch.Tensor] | None = None,
    steps: int = STEPS,
) -> float:
    """Assert that a CUDA run (its worker's ``meta`` and gathered ``weights``, keys ``net.*``) trained as one plain
    process does on the same global batches from the same ``initial`` weights (default: ``make_net(0)``'s), skipping
    the steps fp16 loss scaling skipped; returns the error measured (largest element difference in fp32,
    ``relative_update_error`` in half precision)."""
    assert meta["device"].startswith("cuda") and meta["world_size"] == cuda_devices(), meta
    net = make_net(0)
    if initial is not None:
        net.load_state_dict({key.removeprefix("net."): value for key, value in initial.items()})
    initial = {f"net.{key}": value.detach().clone() for key, value in net.state_dict().items()}
    reference = reference_training(
        steps=steps, world_size=cuda_devices(), batch=batch, skipped=meta["skipped"], net=net
    )
    if precision == "32-true":
        assert meta["skipped"] == [] and meta["param_dtypes"] == ["torch.float32"]
        # TF32 is off for fp32 matmuls by default in torch; cuBLAS may still reduce in another order
        error = max((weights[key] - expected).abs().max().item() for key, expected in reference.items())
        assert error <= 1e-4, error
        return error
    section, dtype = HALF_DTYPES[precision]
    assert meta["config"][section]["enabled"] is True and meta["param_dtypes"] == [dtype]
    if precision == "16-mixed":
        # dynamic loss scaling (DeepSpeed's default, loss_scale 0): a power of two after the run, some steps applied
        assert meta["config"]["fp16"].get("loss_scale", 0) == 0
        assert meta["loss_scale"] >= 1 and math.log2(meta["loss_scale"]).is_integer(), meta["loss_scale"]
        assert len(meta["skipped"]) <= steps // 2, meta["skipped"]
    else:
        assert meta["skipped"] == []
    error = relative_update_error(weights, reference, initial)
    assert error <= HALF_TOLERANCE[precision], (error, meta["skipped"])
    return error


def check_saved_run(folder: Path, label: str, precision: str, batch: int, key_prefix: str = "") -> dict:
    """:func:`check_run` on what a worker saved in ``folder``: ``<label>.json``, the weights ``<label>.pt`` (their keys
    given ``key_prefix``) and, where the model was built on the GPU, its initial weights ``<label>.initial.pt``; prints
    the error (shown by ``pytest -rA``) and returns the run's record."""
    meta = json.loads((folder / f"{label}.json").read_text())
    assert "crash" not in meta, meta.get("crash")
    weights = {f"{key_prefix}{key}": value for key, value in torch.load(folder / f"{label}.pt").items()}
    initial_file = folder / f"{label}.initial.pt"
    initial = torch.load(initial_file) if initial_file.exists() else None
    error = check_run(meta, weights, precision, batch, initial=initial)
    print(f"{label}: error {error:.3g}, skipped {meta['skipped']}")
    return meta
