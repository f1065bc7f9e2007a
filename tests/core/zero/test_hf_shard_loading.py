"""transformers' ``from_pretrained`` under ZeRO-3 holds one checkpoint shard at a time on rank 0 (it read every
shard into one state dict there first), with the files' exact weights: a Llama of 111 MB in fp32 written in 10 MB
shards, loaded on 2 CPU ranks from the Trainer's ``configure_model`` and from Fabric's ``init_module``. Rank 0 reads
every tensor once and never holds more of them at once than the largest shard has; rank 1 reads none (shapes only).
The tensors read are counted, not the process's memory: at this size the resident peaks of two runs differed by up to
60 MiB, which made a memory bound flaky (the 2B model's memory is measured in bench/big_model.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _support.big_model import BigModelShape
from _support.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "core" / "zero" / "scripts" / "hf_shard_loading.py"
SHARD = 10 * 2**20


def llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(5)
    return LlamaForCausalLM(BigModelShape(hidden=512, layers=8, vocab=2048).config())


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("hf_shard_loading")
    model = llama()
    model.save_pretrained(out / "pretrained", max_shard_size=SHARD)
    assert len(list((out / "pretrained").glob("*.safetensors"))) >= 8
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_rank_zero_holds_one_shard_at_a_time_and_loads_the_exact_weights(
    pretrained: tuple[Path, dict[str, torch.Tensor]], front_end: str
) -> None:
    out, weights = pretrained
    run_torchrun(SCRIPT, 2, [out, front_end], timeout=300)
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    largest_shard = max(_tensor_bytes(file) for file in (out / "pretrained").glob("*.safetensors"))
    reads = []
    for rank in (0, 1):
        result = torch.load(out / f"{front_end}_{rank}.pt")
        assert sorted(result["weights"]) == sorted(weights)
        for key, expected in weights.items():
            assert torch.equal(result["weights"][key], expected), f"rank {rank}: {key}"
        reads.append(result["read"])
    assert reads[0]["total"] == model_bytes  # every tensor read once
    assert reads[0]["peak"] <= largest_shard < model_bytes / 8, (reads[0], largest_shard)  # was the whole model
    assert reads[1] == {"total": 0, "peak": 0}


def _tensor_bytes(file: Path) -> int:
    from safetensors.torch import load_file

    return sum(tensor.numel() * tensor.element_size() for tensor in load_file(file).values())
