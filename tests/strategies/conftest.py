"""Fixtures shared by the Trainer's multi-node tests (loopback nodes, simulated hosts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _support.launch import REPO_ROOT, run_torchrun

MULTINODE_SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "multinode.py"


@pytest.fixture(scope="session")
def one_node_of_four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The multi-node runs (zero2_offload, zero3) uninterrupted with 4 processes on one node, run once per session:
    ``weights_1x4.pt`` holds the weights that two nodes (test_multinode) and two hosts (test_hosts) of 2 processes each
    must end with, ``ckpt/last.ckpt`` zero3's checkpoint in one shared directory."""
    shared = tmp_path_factory.mktemp("one_node_of_four")
    run_torchrun(MULTINODE_SCRIPT, 4, ["reference", shared, "1"])
    return shared
