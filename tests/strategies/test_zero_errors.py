"""Bad input to the ZeRO strategies: each is one clear exception, raised before training starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest

import lightspeed  # noqa: F401
from _support.launch import REPO_ROOT, run_python
from lightspeed.core.common.sizes import format_size
from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config import NVME_PATH_ENV, ZERO_PRESETS
from lightspeed.strategies import ZeroStrategy

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_errors.py"


def test_all_names_are_registered_with_their_presets() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    expected = {"zero1", "zero1_offload", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_nvme"}
    assert expected <= set(StrategyRegistry.available_strategies())
    for name in expected:
        entry = StrategyRegistry[name]
        assert entry["strategy"] is ZeroStrategy
        assert entry["init_params"] == ZERO_PRESETS[name].init_params()


@pytest.mark.parametrize(
    ("name", "stage", "optimizer_device", "param_device"),
    [("zero1", 1, None, None), ("zero2_offload", 2, "cpu", None), ("zero3_offload", 3, "cpu", "cpu")],
)
def test_trainer_builds_the_named_preset_on_cpu(name, stage, optimizer_device, param_device) -> None:
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == stage
    assert zero.get("offload_optimizer", {}).get("device") == optimizer_device
    assert zero.get("offload_param", {}).get("device") == param_device
    assert os.environ["DS_ACCELERATOR"] == "cpu"  # chosen for the user, inherited by every rank


def test_missing_config_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(DeepSpeedConfigError, match=f"DeepSpeed config file '{re.escape(str(missing))}' does not exist"):
        ZeroStrategy(stage=2, config=missing)


def test_invalid_json(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 2,}}')
    with pytest.raises(DeepSpeedConfigError, match=r"is not valid JSON: .* at line 1, column 35"):
        ZeroStrategy(stage=2, config=bad)


def test_unknown_key_suggests_the_closest(tmp_path: Path) -> None:
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"gradient_clippping": 1.0}))
    with pytest.raises(DeepSpeedConfigError, match=r"'gradient_clippping' \(did you mean 'gradient_clipping'\?\)"):
        ZeroStrategy(stage=2, config=path)


@pytest.mark.parametrize("stage", [4, -1, "2", True])
def test_stage_outside_range(stage) -> None:
    with pytest.raises(DeepSpeedConfigError, match=re.escape(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}.")):
        ZeroStrategy(stage=stage)


def test_nvme_without_a_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NVME_PATH_ENV, raising=False)
    with pytest.raises(
        DeepSpeedConfigError,
        match=r"NVMe offload needs a directory .* set the environment variable "
        f"{NVME_PATH_ENV}",
    ):
        L.Trainer(strategy="zero3_nvme", accelerator="cpu", devices=2)


def test_nvme_path_not_writable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(DeepSpeedConfigError, match=r"NVMe offload path .* cannot be created"):
        ZeroStrategy(stage=3, offload_optimizer="nvme", offload_parameters="nvme", nvme_path=blocker / "sub")


def test_nvme_path_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NVME_PATH_ENV, str(tmp_path / "swap"))
    trainer = L.Trainer(strategy="zero3_nvme", accelerator="cpu", devices=2, logger=False)
    zero = trainer.strategy.config["zero_optimization"]
    assert zero["offload_param"]["nvme_path"] == zero["offload_optimizer"]["nvme_path"] == str(tmp_path / "swap")
    assert (tmp_path / "swap").is_dir()


def test_fp16_on_cpu_fails_before_any_process_starts() -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"`precision='16-mixed'` needs a CUDA GPU"):
        L.Trainer(strategy="zero2", accelerator="cpu", devices=2, precision="16-mixed")


def test_unknown_offload_target() -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"`offload_optimizer='gpu'` is not an offload target"):
        ZeroStrategy(stage=2, offload_optimizer="gpu")


TINY_FILESYSTEM = "4k"  # a tmpfs this size holds far less than the test model's NVMe offload


@pytest.fixture(scope="module")
def setup_errors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    folder = tmp_path_factory.mktemp("zero_errors")
    tiny = folder / "tiny"
    tiny.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TINY_FILESYSTEM}", "tmpfs", str(tiny)], capture_output=True
    )
    try:
        run_python(SCRIPT, [folder / "errors.json", *([tiny] if mounted.returncode == 0 else [])])
        errors = json.loads((folder / "errors.json").read_text())
        errors["tiny"] = str(tiny)
        errors["mount_error"] = mounted.stderr.decode().strip()
        yield errors
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", str(tiny)], check=True)


def test_an_nvme_path_too_small_is_one_error_before_step_one(setup_errors) -> None:
    if "nvme_too_small" not in setup_errors:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {setup_errors['mount_error']}")
    from _support.models import make_net

    net = make_net()
    elements = sum(p.numel() for p in net.parameters())
    needed = elements * 4 + elements * (4 + 4 + 8)  # fp32 parameters, then fp32 weights, gradients and Adam moments
    assert setup_errors["nvme_too_small"] == (
        f"DeepSpeedConfigError: NVMe offload path {setup_errors['tiny']!r} has 4.00 KiB free, but this node's 1 "
        f"process(es) will write about {format_size(needed)} there ({needed} bytes: the parameters and the fp32 "
        "weights, gradients and optimizer moments of the trained ones). Free space there, choose another path "
        "(nvme_path= or LIGHTSPEED_NVME_PATH), or train on more nodes."
    )


def test_two_optimizers(setup_errors) -> None:
    assert setup_errors["two_optimizers"] == (
        "DeepSpeedConfigError: ZeRO strategies train one optimizer per model, but `configure_optimizers` returned "
        "several optimizers. For one model, use one optimizer with several param groups (each group can have its own "
        "lr and weight_decay). For several models each with its own optimizer (a GAN's generator and discriminator), "
        "give each its own engine: `ZeroStrategy(models=['generator', 'discriminator'])` with the attributes that "
        "hold them."
    )


def test_float64_and_scalar_parameters_are_refused_before_they_are_cast(setup_errors) -> None:
    assert setup_errors["float64_parameter"].startswith(
        "DeepSpeedConfigError: The model has parameters ZeRO cannot train as one process does: 'net.0.bias' is "
        "float64, but ZeRO trains float32 parameters"
    )
    assert setup_errors["scalar_parameter"].startswith(
        "DeepSpeedConfigError: The model has parameters ZeRO cannot train as one process does: 'logit_scale' is a "
        "0-dimensional parameter, which DeepSpeed cannot broadcast"
    )


def test_a_weight_decay_split_by_partition_shapes_is_refused(setup_errors) -> None:
    assert setup_errors["shape_split_under_zero3"] == (
        "DeepSpeedConfigError: Param group 0 of AdamW has weight_decay=0.1 but no parameters, while 2 parameter(s) of "
        "two or more dimensions ('net.0.weight', 'net.2.weight') are in groups without weight decay. The model was "
        "built as ZeRO-3 partitions (in `configure_model` or under `fabric.init_module()`), so `p.dim()` and `p.shape` "
        "see a flat partition, not the parameter: split by the full shape, `len(getattr(p, 'ds_shape', p.shape)) >= "
        "2`, or by name."
    )


def test_offloaded_optimizer_without_cpu_implementation_runs_as_it_is(setup_errors) -> None:
    assert setup_errors["sgd_offload"] == "no error"


def test_offloaded_optimizer_that_cannot_run_on_partitions_is_named(setup_errors) -> None:
    assert setup_errors["sparse_adam_offload"] == (
        "UnsupportedOffloadOptimizerError: Optimizer offload cannot run `SparseAdam`: `SparseAdam` needs sparse "
        "gradients, but ZeRO reduces and offloads dense gradient partitions. Use `torch.optim.Adam`/`AdamW` (run as "
        "DeepSpeed's CPU Adam) or a strategy without optimizer offload."
    )


def test_config_contradicting_the_trainer_lists_every_mismatch(setup_errors) -> None:
    message = setup_errors["mismatch"]
    assert message.startswith("DeepSpeedConfigError")
    assert "gradient_accumulation_steps=8 in the DeepSpeed config, but Trainer(accumulate_grad_batches=4)" in message
    assert "gradient_clipping=0.5" in message and "gradient_clip_val=1.0" in message


def test_boolean_zero_optimization_is_refused() -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"`zero_optimization` must be an object such as \{\"stage\": 2\}"):
        ZeroStrategy(stage=2, config={"zero_optimization": True})


def test_keywords_the_trainer_strategies_do_not_take_say_what_to_do_instead() -> None:
    """Lightning DeepSpeedStrategy's keywords (users migrating) and Fabric's get the same hints as under Fabric."""
    with pytest.raises(TypeError) as info:
        lightspeed.strategies.ZeroStrategy(stage=3, offload_params_device="cpu", precision="bf16-mixed", stag=2)
    message = str(info.value)
    assert message.startswith("ZeroStrategy does not take `offload_params_device`, `precision`, `stag`.\n")
    assert "`offload_params_device`: use `offload_parameters='cpu'` or `offload_parameters='nvme'`" in message
    assert "`precision`: pass the precision to the Trainer: Trainer(precision='bf16-mixed')" in message
    assert "`stag`: not a keyword of ZeroStrategy" in message
    assert "\nZeroStrategy takes: stage, offload_optimizer, offload_parameters, nvme_path," in message
    with pytest.raises(TypeError, match=r"`overlap_comm`: write it into the DeepSpeed config instead: "):
        lightspeed.strategies.ZeroAutoStrategy(overlap_comm=True)
