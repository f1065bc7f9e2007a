"""``lightspeed env``: versions, devices, DeepSpeed ops, and which strategies can run here and why not."""

from __future__ import annotations

import importlib.metadata
import json
import platform

from lightspeed.cli.env_command import strategies
from lightspeed.cli.main import main
from lightspeed.core.xla.runtime import torch_xla_install_hint
from lightspeed.core.zero.config import NVME_PATH_ENV


def test_reports_versions_devices_ops_and_strategies(capsys):
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    versions = data["versions"]
    assert versions["python"] == platform.python_version()
    for name in ("torch", "lightning", "deepspeed", "torchmetrics", "safetensors"):
        assert versions[name] == importlib.metadata.version(name)
    assert "torch_xla" in versions  # reported even when missing (None)
    assert data["devices"]["cpu_cores"] >= 1 and data["devices"]["host_memory_total_bytes"] > 0
    assert {"cpu_adam", "async_io"} <= set(data["deepspeed_ops"])
    names = set(data["strategies"])
    assert {
        "zero1",
        "zero2",
        "zero2_offload",
        "zero3",
        "zero3_offload",
        "zero3_offload_optimizer",
        "zero3_nvme",
        "zero_auto",
        "ddp_exact",
    } <= names
    assert data["strategies"]["zero2"] is None  # plain ZeRO-2 needs no compiled op: it runs wherever DeepSpeed does
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert "lightspeed strategies" in text and "DeepSpeed ops" in text and f"torch          {versions['torch']}" in text


def test_strategy_verdicts_follow_the_ops(monkeypatch):
    versions = {"torch_xla": None}
    usable = {"usable": True, "why": "prebuilt"}
    broken_adam = {"cpu_adam": {"usable": False, "why": "needs a C++ compiler and ninja"}, "async_io": usable}
    verdicts = strategies(broken_adam, versions)
    assert verdicts["zero2"] is None and verdicts["zero3"] is None
    assert verdicts["zero2_offload"] == "DeepSpeed's cpu_adam op is not usable: needs a C++ compiler and ninja"
    assert verdicts["zero3_offload"] == verdicts["zero2_offload"]
    assert verdicts["zero3_offload_optimizer"] == verdicts["zero2_offload"]
    assert strategies({"cpu_adam": usable, "async_io": usable}, versions)["zero3_offload_optimizer"] is None
    no_aio = {"cpu_adam": usable, "async_io": {"usable": False, "why": "missing libaio: apt-get install libaio-dev"}}
    assert strategies(no_aio, versions)["zero3_nvme"] == (
        "DeepSpeed's async_io op is not usable: missing libaio: apt-get install libaio-dev"
    )
    assert strategies(None, versions)["zero2"] == "DeepSpeed is not installed (pip install deepspeed)"
    assert "needs torch_xla" in strategies(broken_adam, versions)["xla_exact"]
    # the one install instruction every message gives (never the extra alone, which pins another torch)
    assert torch_xla_install_hint() in strategies(broken_adam, versions)["xla_exact"]
    all_usable = {"cpu_adam": usable, "async_io": usable}
    monkeypatch.delenv(NVME_PATH_ENV, raising=False)
    assert strategies(all_usable, versions)["zero3_nvme"] == (
        "can run, given nvme_path= or $LIGHTSPEED_NVME_PATH (a directory on an NVMe drive)"
    )
    monkeypatch.setenv(NVME_PATH_ENV, "/tmp/swap")
    assert strategies(all_usable, versions)["zero3_nvme"] is None


def test_zero3_offload_optimizer_is_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    from lightspeed.strategies.zero import ZeroStrategy

    entry = StrategyRegistry["zero3_offload_optimizer"]
    assert entry["strategy"] is ZeroStrategy
    assert entry["init_params"] == {"stage": 3, "offload_optimizer": "cpu"}
    assert entry["description"] == "ZeRO-3 with optimizer states and step on the CPU, parameters on the device"
