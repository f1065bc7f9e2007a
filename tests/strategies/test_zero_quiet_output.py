"""A ZeRO run prints only actionable warnings: the third-party deprecation floods (DeepSpeed's collectives under
torch 2.13, Lightning's LeafSpec) are filtered by message, category and module while the strategy runs."""

from __future__ import annotations

import re
import warnings

import pytest

from _support.launch import REPO_ROOT, run_python
from lightspeed.core.zero import third_party_warnings as _third_party_warnings

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_quiet_run.py"

#: how each warning line that may remain is recognised
KINDS = {
    # DeepSpeed's logger when it picks its CPU accelerator (once, in the launching process)
    "deepspeed-cpu-accelerator": re.compile(
        r"\[WARNING\] \[real_accelerator\.py:\d+:get_accelerator\] Setting accelerator to CPU"
    ),
    # Lightning: evaluating on several ranks pads the last batch; actionable (devices=1 or exact metrics)
    "lightning-distributed-sampler-test": re.compile(
        r"data_connector\.py:\d+: Using `DistributedSampler` .*`trainer\.test\(\)`"
    ),
}
WARNING_LINE = re.compile(r"warn|deprecat|^\S+\.py:\d+: ", re.IGNORECASE)


@pytest.fixture(scope="module")
def output() -> str:
    proc = run_python(SCRIPT, timeout=600)
    assert "done: 6 steps" in proc.stdout
    return proc.stdout + proc.stderr


def test_only_actionable_warnings_remain(output: str) -> None:
    lines = [line for line in output.splitlines() if WARNING_LINE.search(line)]
    kinds = []
    for line in lines:
        matched = [kind for kind, pattern in KINDS.items() if pattern.search(line)]
        assert matched, f"unexpected warning line: {line}"
        kinds.append(matched[0])
    # each known kind at most once (DeepSpeed's accelerator line only where DeepSpeed picks the accelerator itself);
    # Lightning's actionable notice about padded evaluation is always there
    assert len(kinds) == len(set(kinds)), lines
    assert "lightning-distributed-sampler-test" in kinds, lines


def test_no_deprecation_flood(output: str) -> None:
    assert "all_gather_into_tensor" not in output and "reduce_scatter_tensor" not in output
    assert "LeafSpec" not in output


def _emitted(message: str, category: type[Warning], module: str) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _third_party_warnings.install()
        try:
            warnings.warn_explicit(message, category, filename=f"{module}.py", lineno=1, module=module)
        finally:
            _third_party_warnings.uninstall()
    return bool(caught)


def test_filters_are_specific_and_removed_again() -> None:
    flood = "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single`"
    leaf = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()`"
    assert not _emitted(flood, FutureWarning, "torch.distributed.c10d_logger")
    assert not _emitted(leaf, FutureWarning, "lightning.pytorch.utilities._pytree")
    # the same message from another module, another category, or another message from that module still shows
    assert _emitted(flood, FutureWarning, "lightspeed.strategies.zero")
    assert _emitted(flood, UserWarning, "torch.distributed.c10d_logger")
    assert _emitted("`torch.distributed.broadcast` is deprecated", FutureWarning, "torch.distributed.c10d_logger")
    before = list(warnings.filters)
    _third_party_warnings.install()
    _third_party_warnings.install()
    assert len(warnings.filters) == len(before) + len(_third_party_warnings.THIRD_PARTY_WARNINGS)
    _third_party_warnings.uninstall()
    assert warnings.filters == before
