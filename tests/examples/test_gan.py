"""examples/gan.py as a user runs it (2 CPU processes, one engine per model): the generated points move towards the
ring, each trained model is exported to its own folder, and the exported generator, loaded into a plain module,
generates exactly what the trained one did."""

from __future__ import annotations

import re
from pathlib import Path

from _support.launch import REPO_ROOT, run_python

SCRIPT = REPO_ROOT / "examples" / "gan.py"
MEASURE = re.compile(
    r"^(before training|epoch \d+|exported generator, reloaded): distance from the ring ([\d.]+), "
    r"modes covered (\d)/8$",
    re.MULTILINE,
)


def test_the_gan_example_trains_both_models_and_exports_each(tmp_path: Path) -> None:
    run = run_python(SCRIPT, ["--epochs", "4", "--samples", "4096", "--out", tmp_path / "gan"], timeout=300)
    measured = {when: (float(distance), int(modes)) for when, distance, modes in MEASURE.findall(run.stdout)}
    epochs = [f"epoch {i}" for i in range(4)]
    assert list(measured) == ["before training", *epochs, "exported generator, reloaded"], run.stdout[-3000:]
    before, last = measured["before training"], measured["epoch 3"]
    assert last[0] < 0.7 * before[0] and last[1] >= 4 > before[1], measured  # towards the ring, onto its modes
    assert measured["exported generator, reloaded"] == last  # the export is the trained generator
    assert "one engine per model: generator: ZeRO-2, discriminator: ZeRO-3" in run.stdout + run.stderr
    assert sorted(p.name for p in (tmp_path / "gan").iterdir()) == ["discriminator", "generator"]
