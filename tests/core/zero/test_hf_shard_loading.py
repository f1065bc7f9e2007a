"""transformers' ``from_pretrained`` under ZeRO-3 holds one checkpoint shard at a time on rank 0 (it read every
shard into one state dict there first), with the files' exact weights: a Llama of 111 MB in fp32 written in 10 MB
shards, loaded on 2 CPU ranks from the Trainer's ``configure_model`` and from Fabric's ``init_module``; rank 0's
memory rises no more than a third of the model above rank 1's, which reads no tensor."""

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
    rises = []
    for rank in (0, 1):
        result = torch.load(out / f"{front_end}_{rank}.pt")
        assert sorted(result["weights"]) == sorted(weights)
        for key, expected in weights.items():
            assert torch.equal(result["weights"][key], expected), f"rank {rank}: {key}"
        rises.append(result["rise"])
    # building the model costs every rank alike; rank 0 reads the files besides: 106 MiB more than rank 1 when it
    # read them all at once, a shard and a gathered module now
    assert rises[0] - rises[1] < model_bytes / 3, f"rank 0 rose {(rises[0] - rises[1]) / 2**20:.0f} MiB above rank 1"
