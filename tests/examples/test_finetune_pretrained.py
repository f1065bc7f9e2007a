"""examples/finetune_pretrained.py as a user runs it (zero3_offload, 2 CPU processes, a tiny GPT-2): the pretrained
directory it writes is sharded, fine-tuning lowers the perplexity, samples generated under ZeRO-3 are printed, and the
export loads with ``from_pretrained``, with different weights from the pretrained ones and the same greedy
continuations as the partitioned model generated in the last validation."""

from __future__ import annotations

import ast
import math
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from _support.launch import REPO_ROOT, run_python

EXAMPLES = REPO_ROOT / "examples"
SCRIPT = EXAMPLES / "finetune_pretrained.py"
NEW_TOKENS = 6
TINY = ["--pretrain-steps", "30", "--lines", "400", "--epochs", "2", "--width", "32", "--layers", "1"]
TINY += ["--new-tokens", str(NEW_TOKENS)]


def samples(section: str, kind: str) -> list[tuple[str, str]]:
    """The ``  <kind>: 'prompt' -> 'continuation'`` lines of ``section``."""
    pairs = re.findall(rf"^  {kind}: ('.*') -> ('.*')$", section, re.MULTILINE)
    return [(ast.literal_eval(prompt), ast.literal_eval(continuation)) for prompt, continuation in pairs]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_the_finetuning_example_generates_exports_and_reloads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = run_python(SCRIPT, [*TINY, "--out", tmp_path], timeout=300).stdout
    pretrained, export = tmp_path / "pretrained", tmp_path / "export"
    assert (pretrained / "model.safetensors.index.json").is_file()  # sharded, as published checkpoints are
    assert len(list(pretrained.glob("model-*-of-*.safetensors"))) > 1

    baseline = re.search(r"pretrained model on the \d+ validation windows of arithmetic: perplexity ([\d.]+)", out)
    assert baseline, out[-3000:]
    before = float(baseline[1])
    epochs = re.split(r"^epoch (\d+): validation perplexity ([\d.]+)$", out, flags=re.MULTILINE)
    # [preamble, "0", ppl0, section0, "1", ppl1, section1 (up to the end)]
    assert epochs[1::3] == ["0", "1"], out[-3000:]
    perplexities = [float(p) for p in epochs[2::3]]
    assert perplexities[1] < perplexities[0] < before, (before, perplexities)
    sys.path.insert(0, str(EXAMPLES))
    try:
        from finetune_pretrained import PROMPTS, complete, prompts_of
    finally:
        sys.path.remove(str(EXAMPLES))
    last = samples(epochs[-1], "sample")
    assert sorted(prompt for prompt, _ in last) == sorted(PROMPTS), out[-3000:]  # every rank's samples, on rank 0

    # the export: what HF's from_pretrained reads, with the fine-tuned weights
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {p.name for p in export.iterdir()}
    exported, original = weights(export), weights(pretrained)
    assert set(exported) == set(original)
    assert all(exported[k].shape == original[k].shape for k in original)
    assert not any(torch.equal(exported[k], original[k]) for k in original)  # fine-tuning changed every tensor
    # the example compares the reloaded export's perplexity with the distributed evaluation of the live model
    reload = re.search(r"from_pretrained: perplexity ([\d.]+) \(matches the distributed evaluation, ([\d.]+)\)", out)
    assert reload, out[-3000:]
    assert math.isclose(float(reload[1]), float(reload[2]), rel_tol=1e-4)
    assert math.isclose(float(reload[2]), perplexities[-1], rel_tol=1e-3)

    # greedy continuations of the reloaded export, each rank's prompts batched as that rank batched them, equal the
    # ones the ZeRO-3 partitioned model generated in the last validation (and the ones the example printed)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    reloaded = {}
    for rank in range(2):
        prompts = prompts_of(rank, 2)
        reloaded.update(zip(prompts, complete(model, tokenizer, prompts, NEW_TOKENS), strict=True))
    assert dict(last) == reloaded
    assert samples(out.split("reloaded with")[1], "reloaded") == [(p, reloaded[p]) for p in prompts_of(0, 2)]
