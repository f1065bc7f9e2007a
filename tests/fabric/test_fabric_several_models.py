"""Several models in one Fabric loop, one ``fabric.setup`` (one engine) each, against a plain single-process run of
the same models (fp32, 2 CPU ranks, <= 1e-5): a GAN with a ZeRO-2 generator and a ZeRO-3 discriminator
(``lightspeed.fabric.model_options``), uninterrupted and resumed through ``fabric.save`` / ``fabric.load`` of both
models, exported per model; a student with exact accumulation beside a frozen, CPU-offloaded ZeRO-3 teacher, evaluated
through ``gather_for_metrics``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lightspeed
from _support import several_models as sm
from _support.launch import REPO_ROOT, run_python
from lightspeed.core.errors import DeepSpeedConfigError

SCRIPT = REPO_ROOT / "tests" / "fabric" / "scripts" / "fabric_several_models.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("fabric_several_models")
    run_python(SCRIPT, [out], timeout=600)
    return out, torch.load(out / "result.pt")


def test_a_gan_with_one_engine_per_model_trains_like_one_process(run: tuple[Path, dict[str, Any]]) -> None:
    _, result = run
    want = sm.gan_reference(sm.EPOCHS)
    sm.close(result["gan"]["uninterrupted"], want, "uninterrupted")
    assert (want["generator.0.weight"] - sm.make_generator().state_dict()["0.weight"]).abs().max() > 1e-3


def test_a_gan_whose_generator_steps_first_through_the_frozen_discriminator_trains_like_one_process(
    run: tuple[Path, dict[str, Any]],
) -> None:
    """Lightning's basic GAN order (both set up under ZeRO-2): the generator's loss runs through the discriminator's
    engine while its parameters are off; DeepSpeed's ZeRO-2 backward epilogue of that engine used to crash."""
    _, result = run
    sm.close(result["gan"]["generator_first"], sm.gan_reference(sm.EPOCHS, generator_first=True), "generator first")


def test_both_models_saved_together_and_loaded_continue_exactly(run: tuple[Path, dict[str, Any]]) -> None:
    _, result = run
    gan = result["gan"]
    sm.close(gan["half"], sm.gan_reference(sm.EPOCHS // 2), "after the first epoch")
    sm.close(gan["resumed"], sm.gan_reference(sm.EPOCHS), "loaded and continued")
    assert gan["loaded_epoch"] == 1 and "epoch" not in gan["remainder"]  # the user's entry went back into the state
    assert gan["checkpoint_dirs"] == ["discriminator", "generator"]
    assert gan["manifest"]["models"] == {"generator": {"zero_stage": 2}, "discriminator": {"zero_stage": 3}}
    assert gan["errors"]["setup_twice"].startswith("DeepSpeedConfigError: Sequential was already set up by")


def test_the_export_of_a_fabric_checkpoint_writes_each_model(run: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    out, _ = run
    result = lightspeed.export.export_checkpoint(out / "gan.ckpt", tmp_path / "export")
    assert sorted(result.models) == ["discriminator", "generator"]
    assert result.num_tensors == sum(r.num_tensors for r in result.models.values()) == 8
    want = sm.gan_reference(sm.EPOCHS // 2)
    for name, make in (("generator", sm.make_generator), ("discriminator", sm.make_discriminator)):
        model = make()
        lightspeed.export.load_exported(model, tmp_path / "export" / name)
        got = {f"{name}.{k}": v for k, v in model.state_dict().items()}
        sm.close(got, {k: v for k, v in want.items() if k.startswith(f"{name}.")}, f"export {name}")


def test_a_student_beside_a_frozen_zero3_teacher_trains_exactly_and_its_metric_is_exact(
    run: tuple[Path, dict[str, Any]],
) -> None:
    _, result = run
    distill = result["distill"]
    want, accuracy = sm.distill_reference()
    sm.close(distill["student"], want, "student")
    sm.close(distill["teacher"], sm.make_teacher().state_dict(), "teacher (frozen)")
    assert distill["count"] == 9  # the padded duplicate dropped
    assert distill["checkpoint_dirs"] == ["student"] and distill["manifest"]["frozen_models"] == ["teacher"]
    sm.close(distill["loaded_student"], want, "student loaded into a fresh model")
    assert distill["foreign_optimizer"] == (
        "DeepSpeedConfigError: The optimizer given with Sequential trains 2 parameter(s) that are not the model's: "
        "build the optimizer from this model's parameters (`torch.optim.AdamW(model.parameters())`)."
    )
    assert distill["acc"] == pytest.approx(accuracy, abs=1e-7)


def test_model_options_are_checked_when_given() -> None:
    with pytest.raises(DeepSpeedConfigError, match="stage must be"):
        lightspeed.fabric.model_options(torch.nn.Linear(1, 1), stage=5)
    with pytest.raises(DeepSpeedConfigError, match="offload_parameters"):
        lightspeed.fabric.model_options(torch.nn.Linear(1, 1), offload_parameters="disk")
