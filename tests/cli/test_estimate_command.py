"""``lightspeed estimate``: the table and JSON agree with the planner, factories are built on the meta device, and
bad input or a machine where nothing fits is one clear message with exit code 2."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from lightspeed.cli.main import main
from lightspeed.core.zero.planner import ZERO_OPTIONS, Accounting, Budgets, Cluster, ModelCounts, plan

ARGS_7B = [
    "estimate",
    "--params",
    "7e9",
    "--largest-layer",
    "1.3e8",
    "--devices",
    "1",
    "--device-memory",
    "80GB",
    "--host-memory",
    "256GB",
]


def test_json_matches_the_planner(capsys):
    assert main([*ARGS_7B, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = plan(
        ModelCounts(7_000_000_000, 130_000_000),
        Cluster(1),
        Budgets(80 * 10**9, 256 * 10**9),
        Accounting(precision="32-true"),  # the command's default precision is the Trainer's
    )
    assert data["accounting"]["precision"] == "32-true"
    assert data["choice"] == expected.choice.estimate.option.name
    assert [o["name"] for o in data["options"]] == [o.name for o in ZERO_OPTIONS]
    for option, verdict in zip(data["options"], expected.verdicts, strict=False):
        assert option["device_bytes"]["total"] == verdict.estimate.device.total
        assert option["host_bytes_per_node"]["total"] == verdict.estimate.host.total
        assert option["fits"] == verdict.fits


def test_table_marks_every_option_and_the_pick(capsys):
    assert main(ARGS_7B) == 0
    out = capsys.readouterr().out
    for option in ZERO_OPTIONS:
        assert f"\n{option.name} " in out
    assert out.count("<- chosen") == 1
    assert "Choice: zero2_offload" in out  # 7B on one 80 GB GPU: weights fit, Adam states go to the host


def test_factory_is_built_on_the_meta_device(tmp_path, monkeypatch, capsys):
    (tmp_path / "cli_estimate_models.py").write_text(
        textwrap.dedent("""
        import torch

        def build():
            assert torch.empty(1).device.type == "meta"  # the command builds inside torch.device("meta")
            return torch.nn.Sequential(torch.nn.Embedding(50000, 4096), torch.nn.Linear(4096, 4096))

        def not_a_model():
            return [1, 2, 3]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert (
        main(
            [
                "estimate",
                "cli_estimate_models:build",
                "--devices",
                "2",
                "--device-memory",
                "24GiB",
                "--host-memory",
                "64GiB",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == {"total_params": 50000 * 4096 + 4096 * 4096 + 4096, "largest_layer_params": 50000 * 4096}
    assert data["cluster"] == {"nodes": 1, "devices_per_node": 2}

    assert main(["estimate", "cli_estimate_models:not_a_model"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "lightspeed estimate: error: Model factory 'cli_estimate_models:not_a_model' returned a list, not a "
        "torch.nn.Module: make it return the model."
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["estimate", "no_such_pkg.models:build"], "Cannot import 'no_such_pkg.models' for model factory"),
        (["estimate", "--params", "-5", "--largest-layer", "1"], "--params must be a positive number, got '-5'"),
        (["estimate", "--params", "0", "--largest-layer", "1"], "--params must be a positive number, got '0'"),
        (["estimate", "--params", "7e9"], "--params needs --largest-layer"),
        (["estimate"], "say what to estimate"),
        (
            ["estimate", "--params", "10", "--largest-layer", "1", "--devices", "0"],
            "devices per node must be at least 1, got 0",
        ),
        (
            ["estimate", "--params", "10", "--largest-layer", "1", "--device-memory", "lots"],
            "Cannot read --device-memory 'lots'",
        ),
        (
            ["estimate", "--params", "10", "--largest-layer", "1", "--precision", "64-true"],
            "Unsupported precision '64-true'",
        ),
        (["estimate", "--params", "10", "--largest-layer", "1", "--precision", "16"], "Unsupported precision '16'"),
        # a bare number could be bytes or GiB: the message says how to write it
        (
            ["estimate", "--params", "10", "--largest-layer", "1", "--device-memory", "80"],
            "--device-memory '80' has no unit: write e.g. '80GB' (10^9 bytes) or '80GiB' (2^30 bytes).",
        ),
        (
            ["estimate", "--params", "10", "--largest-layer", "1", "--host-memory", "256"],
            "--host-memory '256' has no unit: write e.g. '256GB' (10^9 bytes) or '256GiB' (2^30 bytes).",
        ),
    ],
)
def test_bad_input_is_one_message_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("lightspeed estimate: error: ")
    assert message in captured.err
    assert "Traceback" not in captured.err


def test_nothing_fits_prints_the_table_and_what_would_fit(capsys):
    argv = [
        "estimate",
        "--params",
        "70e9",
        "--largest-layer",
        "1.3e9",
        "--devices",
        "8",
        "--device-memory",
        "80GB",
        "--host-memory",
        "500GB",
    ]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Choice: none; no option fits." in captured.out
    assert captured.err.startswith("lightspeed estimate: error: No ZeRO option fits 70,000,000,000 parameters")
    assert "What would fit:" in captured.err and "--nvme-path" in captured.err


def test_nvme_path_gives_an_nvme_budget(tmp_path, capsys):
    assert main([*ARGS_7B, "--host-memory", "64GB", "--nvme-path", str(tmp_path), "--json"]) in (0, 2)
    data = json.loads(capsys.readouterr().out)
    assert data["budgets"]["nvme_free_bytes"] > 0
    nvme = data["options"][-1]
    assert nvme["name"] == "zero3_nvme" and nvme["nvme_bytes_per_node"] > 0
    assert "NVMe path" not in nvme["reason"]  # it had one; the verdict is about sizes (or async_io), not the path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default (no GPU visible)")
def test_without_gpu_the_devices_share_host_memory(capsys):
    assert main(["estimate", "--params", "1e6", "--largest-layer", "1e5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["budgets"]["device_bytes"] is None
    assert data["choice"] == "zero1"
    assert "devices share host memory" in data["options"][0]["reason"]


def test_the_old_memory_flags_still_work_with_a_warning(capsys):
    """``--gpu-memory`` / ``--cpu-memory`` (before ``--device-memory`` / ``--host-memory``, as ``lightspeed tune`` and
    ``zero_auto``'s ``device_memory=`` / ``host_memory=`` spell them): the same estimate, a warning on stderr, and
    hidden from ``--help``."""
    new = [*ARGS_7B, "--json"]
    old = [{"--device-memory": "--gpu-memory", "--host-memory": "--cpu-memory"}.get(arg, arg) for arg in new]
    assert "--gpu-memory" in old and "--cpu-memory" in old
    assert main(new) == 0
    expected = capsys.readouterr()
    assert main(old) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == json.loads(expected.out)
    assert captured.err.splitlines()[:2] == [
        "lightspeed estimate: warning: --gpu-memory is deprecated and will be removed; use --device-memory",
        "lightspeed estimate: warning: --cpu-memory is deprecated and will be removed; use --host-memory",
    ]
    assert "deprecated" not in expected.err
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    help_text = capsys.readouterr().out
    assert "--device-memory SIZE" in help_text and "--host-memory SIZE" in help_text
    assert "--gpu-memory" not in help_text and "--cpu-memory" not in help_text


def test_the_default_precision_is_the_trainers(capsys):
    assert main([*ARGS_7B, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accounting"]["precision"] == "32-true"
    assert main([*ARGS_7B]) == 0
    assert "precision 32-true" in capsys.readouterr().out  # the table says which precision it assumed
