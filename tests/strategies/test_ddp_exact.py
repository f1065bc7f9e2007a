"""``ddp_exact`` against a plain single-process PyTorch loop on the big batches, on 1 and 2 real gloo ranks.

Two launches (one per world size) run every Lightning configuration (tests/strategies/scripts/accumulation_fit.py);
each test compares one saved result with a reference computed here.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from tests._support.launch import run_torchrun

SCRIPTS = Path(__file__).parent / "scripts"
_spec = importlib.util.spec_from_file_location("accumulation_cases", SCRIPTS / "accumulation_cases.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

TOL = dict(rtol=0.0, atol=1e-6)


def case(name, task, batch_size, accumulate, lr, epochs=1, strategy="ddp_exact", **extra):
    return dict(name=name, task=task, batch_size=batch_size, accumulate=accumulate, lr=lr, epochs=epochs,
                strategy=strategy, **extra)


CASES = {
    1: [
        case("toy_b8_n1", "toy", 8, 1, 0.02),
        case("toy_b2_n4", "toy", 2, 4, 0.02),
        case("toy9_b2_n5", "toy9", 2, 5, 0.02),  # micro-batches of 2,2,2,2,1 samples
        case("toy_clip", "toy", 2, 4, 0.02, clip=50.0),
        case("uneven", "regression", 2, 4, 0.1, epochs=2),  # 10 batches, windows 4,4,2
        case("uneven_ddp", "regression", 2, 4, 0.1, epochs=2, strategy="ddp"),
        case("scheduler", "regression", 2, 4, 0.05, scheduler="steps"),
        case("iterable", "regression", 2, 4, 0.1, iterable=True),
        case("tokens", "tokens", 2, 4, 0.1, return_num_items=True),  # 12 batches, windows 4,4,4
        case("strict_even", "regression16", 2, 4, 0.1, sync_with_dataloader=False),
        case("strict_uneven", "regression", 2, 4, 0.1, sync_with_dataloader=False, expect_error=True),
        case("zero_items", "tokens_empty", 2, 2, 0.1, return_num_items=True, expect_error=True),
        case("non_scalar", "toy", 2, 4, 0.02, non_scalar_loss=True, expect_error=True),
    ],
    2: [
        case("toy_b4_n1", "toy", 4, 1, 0.02),
        case("toy_b1_n4", "toy", 1, 4, 0.02),
        case("toy_b2_n2", "toy", 2, 2, 0.02),
        case("uneven", "regression", 1, 4, 0.1, epochs=2),  # 10 batches per rank, windows 4,4,2
        case("uneven_ddp", "regression", 1, 4, 0.1, epochs=2, strategy="ddp"),
        case("scheduler", "regression", 1, 4, 0.05, scheduler="steps"),
        case("iterable", "regression", 1, 4, 0.1, iterable=True),
        case("tokens", "tokens", 2, 4, 0.1, return_num_items=True),  # 6 batches per rank, windows 4,2
    ],
}


def run_cases(world_size: int, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp(f"accumulation_w{world_size}")
    spec = out / "cases.json"
    spec.write_text(json.dumps(CASES[world_size]))
    run_torchrun(SCRIPTS / "accumulation_fit.py", world_size, [spec, out])
    return {c["name"]: torch.load(out / f"{c['name']}.pt") for c in CASES[world_size]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {world: run_cases(world, tmp_path_factory) for world in (1, 2)}


def find(world_size: int, name: str) -> dict:
    return next(c for c in CASES[world_size] if c["name"] == name)


def reference(spec: dict, world_size: int) -> tuple[dict, float, int]:
    """Plain PyTorch, one process: each optimizer step sees the whole window's big batch and its mean loss."""
    data = cases.make_data(spec["task"])
    model = cases.make_model(spec["task"])
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    scheduler = None
    if spec.get("scheduler") == "steps":
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: float(step))
    steps = cases.windows(len(data[0]), world_size, spec["batch_size"], spec["accumulate"])
    for _ in range(spec["epochs"]):
        for indices in steps:
            optimizer.zero_grad()
            loss_sum, items = cases.item_loss(spec["task"], model, tuple(t[indices] for t in data))
            (loss_sum / items).backward()
            if spec.get("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    return model.state_dict(), optimizer.param_groups[0]["lr"], len(steps) * spec["epochs"]


def assert_matches_reference(results, world_size: int, name: str) -> dict:
    result = results[world_size][name]
    expected, _, steps = reference(find(world_size, name), world_size)
    for key, value in expected.items():
        torch.testing.assert_close(result["state_dict"][key], value, **TOL)
    assert result["global_step"] == steps
    return result


TOY = [(1, "toy_b8_n1"), (1, "toy_b2_n4"), (2, "toy_b4_n1"), (2, "toy_b1_n4"), (2, "toy_b2_n2")]


@pytest.mark.parametrize(("world_size", "name"), TOY)
def test_classic_toy_equals_one_full_batch_step(results, world_size, name):
    expected, _, steps = reference(find(world_size, name), world_size)
    assert steps == 1
    torch.testing.assert_close(expected["weight"], torch.tensor([[2.04]]), **TOL)  # w = 0.02 * 4 * mean(x^2)
    torch.testing.assert_close(results[world_size][name]["state_dict"]["weight"], expected["weight"], **TOL)


@pytest.mark.parametrize("world_size", [1, 2])
def test_short_last_window_is_scaled_to_its_real_size(results, world_size):
    # 10 batches, N=4, two epochs: windows of 4, 4 and 2 micro-batches in each epoch
    result = assert_matches_reference(results, world_size, "uneven")
    assert result["counts"]["optimizer_step"] == 6


@pytest.mark.parametrize("world_size", [1, 2])
def test_lightning_ddp_underweights_the_short_window(results, world_size):
    """The same run on Lightning's own ``ddp`` misses the reference: the configuration really exercises the fix."""
    expected, _, _ = reference(find(world_size, "uneven_ddp"), world_size)
    actual = results[world_size]["uneven_ddp"]["state_dict"]
    assert max((actual[k] - expected[k]).abs().max().item() for k in expected) > 1e-3


def test_micro_batches_weigh_by_their_sample_count(results):
    assert_matches_reference(results, 1, "toy9_b2_n5")


@pytest.mark.parametrize("world_size", [1, 2])
def test_num_items_gives_the_token_mean_over_all_ranks(results, world_size):
    spec = find(world_size, "tokens")
    _, _, mask = cases.make_data("tokens")
    if world_size == 2:  # the ranks really hold different token counts in every window
        for start in (0, 4):
            tokens = [sum(int(mask[i].sum()) for b in cases.rank_batches(len(mask), 2, r, 2)[start:start + 4] for i in b)
                      for r in range(2)]
            assert tokens[0] * 2 < tokens[1]
    assert_matches_reference(results, world_size, "tokens")
    assert spec["return_num_items"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_step_scheduler_and_optimizer_hooks_run_once_per_real_step(results, world_size):
    result = assert_matches_reference(results, world_size, "scheduler")
    _, expected_lr, steps = reference(find(world_size, "scheduler"), world_size)
    assert steps == 3  # ceil(10 / 4)
    assert result["lr"] == pytest.approx(0.05 * steps) == pytest.approx(expected_lr)
    assert result["counts"] == {
        "optimizer_step": steps, "on_before_optimizer_step": steps, "optimizer_zero_grad": steps, "lr_step": steps,
    }


def test_clipping_applies_once_to_the_accumulated_gradient(results):
    # full-batch gradient is -102; clipped to norm 50 the step gives w = 0.02 * 50 = 1.0
    assert_matches_reference(results, 1, "toy_clip")
    torch.testing.assert_close(results[1]["toy_clip"]["state_dict"]["weight"], torch.tensor([[1.0]]), **TOL)


@pytest.mark.parametrize("world_size", [1, 2])
def test_iterable_dataset_of_unknown_length_scales_its_short_window(results, world_size):
    assert_matches_reference(results, world_size, "iterable")


def test_one_gradient_allreduce_and_one_count_allreduce_per_window(results):
    exact = results[2]["uneven"]
    assert exact["global_step"] == 6
    assert exact["grad_allreduces"] == 6  # DDP bucket all-reduces: boundary micro-batches only (one bucket)
    assert exact["item_allreduces"] == 6  # the window's item count
    plain = results[2]["uneven_ddp"]
    assert plain["grad_allreduces"] == 6 and plain["item_allreduces"] == 0
    assert results[1]["uneven"]["item_allreduces"] == 0  # one rank: the count is local


def test_sync_with_dataloader_false_accepts_full_windows(results):
    assert_matches_reference(results, 1, "strict_even")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("strict_uneven", "ValueError: The accumulation window ending at batch 9 of epoch 0 holds 2 of "
                          "accumulate_grad_batches=4 micro-batches, but sync_with_dataloader=False requires full windows."),
        ("zero_items", "ValueError: num_items summed to 0 over an accumulation window (2 micro-batches on all ranks), "
                       "so the window's mean loss is undefined."),
        ("non_scalar", "ValueError: training_step must return a scalar loss for exact gradient accumulation, got a "
                       "tensor of shape (2,). Reduce it first"),
    ],
)
def test_bad_input_raises_a_clear_error(results, name, message):
    error = results[1][name]["error"]
    assert error is not None and error.startswith(message), error


def test_ddp_exact_is_registered_and_resolves_from_its_name():
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry

    import lightspeed  # noqa: F401
    from lightspeed.strategies.ddp_exact import DDPExactStrategy

    assert StrategyRegistry["ddp_exact"]["strategy"] is DDPExactStrategy
    trainer = pl.Trainer(strategy="ddp_exact", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, DDPExactStrategy)
    assert trainer.strategy.sync_with_dataloader is True
    assert re.search("exact", StrategyRegistry["ddp_exact"]["description"])
