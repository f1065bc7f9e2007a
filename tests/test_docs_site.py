"""The documentation site builds: ``mkdocs build --strict`` (mkdocs.yml) with the guides in docs/, README.md as its
home page and the API reference generated from the docstrings (docs/reference/). Strict makes every warning an
error: a docstring mkdocstrings cannot parse, a link to a page or an anchor that does not exist. No network is used.

The links as the repository shows them are checked too: every relative link in README.md and docs/ (reference pages
included) names a file that exists, and an anchor names a heading of that file (GitHub's slugs)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _support.launch import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    command = [str(mkdocs)] if mkdocs.exists() else [shutil.which("mkdocs") or "mkdocs"]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    proc = subprocess.run(
        [*command, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    site = tmp_path / "site"
    assert (site / "index.html").is_file()  # the README
    reference = (site / "reference" / "strategies" / "index.html").read_text()
    for argument in ("allgather_bucket_size", "sub_group_size", "exclude_frozen_parameters", "leaf_modules"):
        assert argument in reference, argument  # the Args tables are rendered
    assert "safety_margin" in reference and "tune_micro_batches" in reference  # ZeroAutoStrategy's own arguments


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def _anchors(path: Path) -> set[str]:
    text = _CODE.sub("", path.read_text())
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO_ROOT)) for p in PAGES])
def test_every_relative_link_names_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_CODE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked (no network)
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {resolved.name}")
    assert not broken, f"{page.relative_to(REPO_ROOT)}: " + "; ".join(broken)
