"""ZeRO-3 with NVMe offload trains a model whose training state does not fit in the memory it is given: a 261M-parameter
Llama (fp32 with AdamW: 4.2 GB of training state), built with ``from_pretrained`` in ``configure_model``, fine-tuned on
2 CPU ranks with ``strategy="zero3_nvme"`` inside an OS memory cap (a cgroup) of 3.5 GiB for torchrun and both ranks
together. The cap is below the training state and below what ZeRO-3 without NVMe needs (6.6 GB per rank measured,
the planner's estimate asserted below); the run finishes and its export equals the same steps in one uncapped plain
process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _support import big_model
from _support.launch import REPO_ROOT, child_env, free_port
from _support.memory_cap import memory_cap, memory_cap_unavailable
from lightspeed.core.zero.planner import ZERO_OPTIONS, Accounting, Cluster, count_parameters, estimate_option

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_nvme_big.py"
CAP = int(3.5 * 2**30)
STEPS = 2

pytestmark = pytest.mark.skipif(memory_cap_unavailable() is not None, reason=str(memory_cap_unavailable()))


def _async_io_problem() -> str | None:
    from lightspeed.core.zero.runtime import async_io_problem

    return async_io_problem()


def test_zero3_nvme_fine_tunes_under_a_memory_cap_below_the_training_state(tmp_path: Path) -> None:
    if (problem := _async_io_problem()) is not None:
        pytest.skip(f"NVMe offload cannot run here: {problem}")
    shape = big_model.BigModelShape()
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        counts = count_parameters(LlamaForCausalLM(shape.config()))
    training_state = 16 * counts.total_params  # fp32 weights and gradients, two Adam moments
    zero3 = estimate_option(
        next(o for o in ZERO_OPTIONS if o.name == "zero3"),
        counts,
        Cluster(big_model.WORLD),
        Accounting(precision="32-true"),
    )
    assert CAP < training_state and CAP < big_model.WORLD * zero3.cpu_process_peak

    big_model.write_pretrained(tmp_path / "pretrained", shape)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={big_model.WORLD}",
        "--nnodes=1",
        f"--master_port={free_port()}",
        "--master_addr=127.0.0.1",
        str(SCRIPT),
        str(tmp_path),
        "zero3_nvme",
        str(STEPS),
        *shape.as_args(),
    ]
    with memory_cap(CAP) as group:
        proc = group.run(cmd, env=child_env(), cwd=REPO_ROOT, timeout=900)
        killed = group.oom_kills
    assert proc.returncode == 0 and killed == 0, (
        f"the capped run exited with {proc.returncode} ({killed} processes killed for memory)\n"
        f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    )

    got = {key: value for path in (tmp_path / "export").glob("*.safetensors") for key, value in load_file(path).items()}
    want = big_model.reference(tmp_path / "pretrained", shape.vocab, STEPS)
    initial = {
        key: value for path in (tmp_path / "pretrained").glob("*.safetensors") for key, value in load_file(path).items()
    }
    assert sorted(got) == sorted(want) == sorted(initial)
    assert all(not torch.equal(want[key], initial[key]) for key in want)  # every weight trained
    for key, expected in want.items():
        torch.testing.assert_close(got[key], expected, rtol=0, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
