"""Several models in one LightningModule, one engine each (``ZeroStrategy(models=...)``), against a plain
single-process run of the same models (fp32, 2 CPU ranks, <= 1e-5): a GAN (manual optimization, two optimizers,
ZeRO-2 generator and ZeRO-3 discriminator) uninterrupted and resumed from a checkpoint, exported per model; a student
under ZeRO-2 with exact accumulation beside a frozen, CPU-offloaded ZeRO-3 teacher, validated through
``GatherForMetrics``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lightspeed
from _support import several_models as sm
from _support.launch import REPO_ROOT, run_torchrun
from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.several_models import (
    assign_optimizers,
    engine_for_backward,
    infer_models,
    parse_model_options,
)

SCRIPT = REPO_ROOT / "tests" / "strategies" / "scripts" / "zero_several_models.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("zero_several_models")
    run_torchrun(SCRIPT, 2, [out], timeout=600)
    return out, torch.load(out / "result.pt")


def test_a_gan_with_one_engine_per_model_trains_like_one_process(run: tuple[Path, dict[str, Any]]) -> None:
    _, result = run
    want = sm.gan_reference(sm.EPOCHS)
    sm.close(result["gan"]["uninterrupted"], want, "uninterrupted")
    start = sm.make_generator().state_dict()["0.weight"]
    assert (want["generator.0.weight"] - start).abs().max() > 1e-3  # training moved the weights


def test_a_gan_whose_generator_steps_first_through_the_frozen_discriminator_trains_like_one_process(
    run: tuple[Path, dict[str, Any]],
) -> None:
    """Lightning's basic GAN order, ``ZeroStrategy(stage=2, models=["generator", "discriminator"])``: the generator's
    loss runs through the discriminator's engine while its parameters are off; DeepSpeed's ZeRO-2 backward epilogue of
    that engine used to crash."""
    _, result = run
    sm.close(result["gan"]["generator_first"], sm.gan_reference(sm.EPOCHS, generator_first=True), "generator first")


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_a_gan_under_a_plain_strategy_name_gets_one_engine_per_model_and_trains_like_one_process(
    run: tuple[Path, dict[str, Any]], name: str
) -> None:
    """Lightning's basic GAN (two optimizers, each over one attribute's parameters) with ``strategy="zero2"`` /
    ``"zero3"``: the models are inferred from the optimizers, which is logged once."""
    gan = run[1]["gan"]
    sm.close(gan[f"inferred_{name}"], sm.gan_reference(sm.EPOCHS, generator_first=True), name)
    assert gan[f"inferred_{name}_log"] == [
        "lightspeed: `configure_optimizers` returned 2 optimizers, each training one attribute's parameters: one "
        "engine per model, as with ZeroStrategy(models=['generator', 'discriminator'])."
    ]


def test_a_gan_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run(run: tuple[Path, dict[str, Any]]) -> None:
    _, result = run
    gan = result["gan"]
    sm.close(gan["half"], sm.gan_reference(sm.EPOCHS // 2), "after the first half")
    sm.close(gan["resumed"], sm.gan_reference(sm.EPOCHS), "resumed")
    assert gan["checkpoint_dirs"] == ["discriminator", "generator"]
    assert gan["manifest"]["models"] == {"generator": {"zero_stage": 2}, "discriminator": {"zero_stage": 3}}


def test_each_trained_model_is_exported_to_its_own_folder(run: tuple[Path, dict[str, Any]]) -> None:
    out, result = run
    want = sm.gan_reference(sm.EPOCHS)
    for name, make in (("generator", sm.make_generator), ("discriminator", sm.make_discriminator)):
        model = make()
        lightspeed.export.load_exported(model, out / "export" / name)
        sm.close(
            {f"{name}.{k}": v for k, v in model.state_dict().items()},
            {k: v for k, v in want.items() if k.startswith(f"{name}.")},
            f"export {name}",
        )
    assert sorted(p.name for p in (out / "export").iterdir()) == ["discriminator", "generator"]


def test_the_offline_export_of_a_several_model_checkpoint_writes_each_model(
    run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, _ = run
    lightspeed.export.export_checkpoint(out / "gan.ckpt", tmp_path / "offline")
    want = sm.gan_reference(sm.EPOCHS // 2)
    for name, make in (("generator", sm.make_generator), ("discriminator", sm.make_discriminator)):
        model = make()
        lightspeed.export.load_exported(model, tmp_path / "offline" / name)
        sm.close(
            {f"{name}.{k}": v for k, v in model.state_dict().items()},
            {k: v for k, v in want.items() if k.startswith(f"{name}.")},
            f"offline export {name}",
        )


def test_a_student_beside_a_frozen_zero3_teacher_trains_exactly_and_its_metric_is_exact(
    run: tuple[Path, dict[str, Any]],
) -> None:
    _, result = run
    distill = result["distill"]
    want, accuracy = sm.distill_reference()
    sm.close(distill["student"], want, "student")
    sm.close(distill["teacher"], sm.make_teacher().state_dict(), "teacher (frozen)")
    assert not distill["teacher_requires_grad"]
    assert distill["acc"] == pytest.approx(accuracy, abs=1e-7)
    assert distill["acc_from_checkpoint"] == pytest.approx(accuracy, abs=1e-7)  # validate(ckpt_path=) in a fresh module
    assert (want["0.weight"] - sm.make_student().state_dict()["0.weight"]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------------ bad input
def test_two_optimizers_for_one_model_and_one_optimizer_for_two_models_are_refused() -> None:
    g, d = sm.make_generator(), sm.make_discriminator()
    models = {"generator": g, "discriminator": d}
    with pytest.raises(DeepSpeedConfigError) as err:
        assign_optimizers(models, [torch.optim.SGD(g.parameters(), lr=1), torch.optim.SGD(g.parameters(), lr=1)], "x")
    assert str(err.value) == (
        "Optimizers 0 and 1 from x both train 'generator': two optimizers for one model. A ZeRO engine steps one "
        "optimizer; use one optimizer with several param groups."
    )
    with pytest.raises(DeepSpeedConfigError) as err:
        assign_optimizers(models, [torch.optim.SGD([*g.parameters(), *d.parameters()], lr=1)], "x")
    assert str(err.value) == (
        "Optimizer 0 from x trains parameters of 'discriminator' and 'generator': a model given to two engines. "
        "Each model has its own engine and optimizer; split the optimizer per model."
    )
    with pytest.raises(DeepSpeedConfigError, match="trains parameters outside the models named in `models=`"):
        assign_optimizers({"generator": g}, [torch.optim.SGD(d.parameters(), lr=1)], "x")
    assert assign_optimizers(models, [torch.optim.SGD(d.parameters(), lr=1)], "x") == {
        "generator": None,
        "discriminator": 0,
    }


class _ThreeModels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator, self.discriminator = sm.make_generator(), sm.make_discriminator()
        self.teacher = sm.make_teacher()
        self.loss = nn.MSELoss()  # no parameters: not a model


def test_the_models_are_inferred_from_optimizers_over_one_attribute_each() -> None:
    module = _ThreeModels()
    opts = [torch.optim.SGD(module.discriminator.parameters(), lr=1), torch.optim.SGD(module.generator.parameters())]
    # in the optimizers' order; the child no optimizer trains is a frozen model
    assert infer_models(module, opts, "x") == ["discriminator", "generator", "teacher"]


def test_models_that_cannot_be_inferred_are_refused_with_the_reason() -> None:
    module = _ThreeModels()
    both = [*module.generator.parameters(), *module.discriminator.parameters()]
    with pytest.raises(DeepSpeedConfigError) as err:
        infer_models(module, [torch.optim.SGD(both, lr=1), torch.optim.SGD(module.teacher.parameters(), lr=1)], "x")
    assert str(err.value) == (
        "Optimizer 0 from x does not train exactly the parameters of one attribute of _ThreeModels (its children "
        "with parameters: generator, discriminator, teacher), so the models to give one engine each cannot be "
        "inferred"
    )
    module.scale = nn.Parameter(torch.ones(1))
    opts = [torch.optim.SGD(module.generator.parameters(), lr=1), torch.optim.SGD(module.teacher.parameters(), lr=1)]
    with pytest.raises(DeepSpeedConfigError, match=r"has parameters of its own outside its child modules \(scale\)"):
        infer_models(module, opts, "x")


def test_a_loss_reaching_two_trained_models_is_refused_with_what_to_do() -> None:
    g, d = sm.make_generator(), sm.make_discriminator()
    loss = sm.generator_loss(d, g, torch.randn(2, sm.NOISE))
    trained = {"generator": ("G", list(g.parameters())), "discriminator": ("D", list(d.parameters()))}
    with pytest.raises(DeepSpeedConfigError, match=r"reaches trainable parameters of 'generator' and 'discriminator'"):
        engine_for_backward(loss, trained)
    d.requires_grad_(False)  # what toggle_optimizer does
    assert engine_for_backward(sm.generator_loss(d, g, torch.randn(2, sm.NOISE)), trained) == "G"


def test_model_options_are_checked_when_the_strategy_is_made() -> None:
    with pytest.raises(DeepSpeedConfigError) as err:
        lightspeed.strategies.ZeroStrategy(models={"generator": {"stgae": 3}, "discriminator": {}})
    assert str(err.value) == (
        "ZeroStrategy(models=...)['generator'] has unknown option(s) 'stgae'; a model takes stage, "
        "offload_optimizer, offload_parameters. Everything else is set on the strategy for all models."
    )
    with pytest.raises(DeepSpeedConfigError, match="names 1 model"):
        lightspeed.strategies.ZeroStrategy(models={"generator": {}})
    with pytest.raises(DeepSpeedConfigError, match=r"asks for ZeRO stage 3, but the DeepSpeed config sets"):
        lightspeed.strategies.ZeroStrategy(
            models={"a": {"stage": 3}, "b": {}}, config={"zero_optimization": {"stage": 2}}
        )
    with pytest.raises(DeepSpeedConfigError, match=r"cannot be combined with compile yet"):
        lightspeed.strategies.ZeroStrategy(models=["a", "b"], compile=True)
    assert parse_model_options(["a", "b"], "m") == parse_model_options({"a": {}, "b": {}}, "m")


def test_a_module_without_a_named_model_is_a_clear_error() -> None:
    module = nn.Module()
    strategy = lightspeed.strategies.ZeroStrategy(models={"generator": {}, "critic": {}})
    strategy._lightning_module = module  # type: ignore[assignment]
    with pytest.raises(DeepSpeedConfigError, match=r"`models=` names 'generator', but Module.generator is missing"):
        strategy._named_models()
