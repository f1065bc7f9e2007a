"""Exact accumulation under ``ddp_exact`` and ``zero1``/``zero2``/``zero3`` against a plain single-process PyTorch
loop on the big batches, on 1 and 2 real gloo ranks.

Two launches (one per world size) run every Lightning configuration (tests/strategies/scripts/accumulation_fit.py);
each test compares one saved result with a reference computed here (accumulation_cases.reference_training).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from _support.launch import run_torchrun

SCRIPTS = Path(__file__).parent / "scripts"
_spec = importlib.util.spec_from_file_location("accumulation_cases", SCRIPTS / "accumulation_cases.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

TOL = dict(rtol=0.0, atol=1e-6)
ZERO = ("zero1", "zero2", "zero3")
OFFLOAD = ("zero2_offload", "zero3_offload")


def case(name, task, batch_size, accumulate, lr, epochs=1, strategy="ddp_exact", **extra):
    return dict(
        name=name,
        task=task,
        batch_size=batch_size,
        accumulate=accumulate,
        lr=lr,
        epochs=epochs,
        strategy=strategy,
        **extra,
    )


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
        *[case(f"{z}_toy_b8_n1", "toy", 8, 1, 0.02, strategy=z) for z in ZERO],
        *[case(f"{z}_toy_b2_n4", "toy", 2, 4, 0.02, strategy=z) for z in ZERO],
        case("zero2_scheduler", "regression", 2, 4, 0.05, epochs=2, scheduler="steps", strategy="zero2"),
        case("zero2_clip", "toy", 2, 4, 0.02, clip=50.0, strategy="zero2"),
        case("zero3_tokens", "tokens", 2, 4, 0.1, return_num_items=True, strategy="zero3"),
        *[case(f"{z}_toy9_b2_n5", "toy9", 2, 5, 0.02, strategy=z) for z in ZERO],  # a last micro-batch of 1
        # errors last: a failed fit leaves nothing behind that the next one needs
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
        *[case(f"{z}_toy_b4_n1", "toy", 4, 1, 0.02, strategy=z) for z in ZERO],
        *[case(f"{z}_toy_b1_n4", "toy", 1, 4, 0.02, strategy=z) for z in ZERO + OFFLOAD],
        *[case(f"{z}_scheduler", "regression", 1, 4, 0.05, epochs=2, scheduler="steps", strategy=z) for z in ZERO],
        case("zero3_tokens", "tokens", 2, 4, 0.1, return_num_items=True, strategy="zero3"),
        *[case(f"{z}_tokens", "tokens", 2, 4, 0.1, return_num_items=True, strategy=z) for z in ("zero1", "zero2")],
        # clipping reads the norms offload takes while it copies the gradients: they must see the window's factor
        *[case(f"{z}_tokens_clip", "tokens", 2, 4, 0.1, return_num_items=True, clip=0.05, strategy=z) for z in OFFLOAD],
        *[case(f"{z}_bf16", "regression", 1, 4, 0.05, precision="bf16-mixed", strategy=z) for z in ("zero1", "zero3")],
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


def assert_matches_reference(results, world_size: int, name: str) -> dict:
    result = results[world_size][name]
    expected, _, steps = cases.reference_training(find(world_size, name), world_size)
    for key, value in expected.items():
        torch.testing.assert_close(result["state_dict"][key], value, **TOL)
    assert result["global_step"] == steps
    return result


def assert_hooks_and_scheduler_once_per_step(results, world_size: int, name: str) -> None:
    result = assert_matches_reference(results, world_size, name)
    spec = find(world_size, name)
    _, expected_lr, steps = cases.reference_training(spec, world_size)
    assert steps == 3 * spec["epochs"]  # ceil(10 / 4) per epoch
    assert result["lr"] == pytest.approx(spec["lr"] * steps) == pytest.approx(expected_lr)
    assert result["counts"] == {
        "optimizer_step": steps,
        "on_before_optimizer_step": steps,
        "optimizer_zero_grad": steps,
        "lr_step": steps,
    }


TOY = [(1, "toy_b8_n1"), (1, "toy_b2_n4"), (2, "toy_b4_n1"), (2, "toy_b1_n4"), (2, "toy_b2_n2")]
TOY += [(1, f"{z}_toy_b8_n1") for z in ZERO] + [(1, f"{z}_toy_b2_n4") for z in ZERO]
TOY += [(2, f"{z}_toy_b4_n1") for z in ZERO] + [(2, f"{z}_toy_b1_n4") for z in ZERO + OFFLOAD]


@pytest.mark.parametrize(("world_size", "name"), TOY)
def test_classic_toy_equals_one_full_batch_step(results, world_size, name):
    expected, _, steps = cases.reference_training(find(world_size, name), world_size)
    assert steps == 1
    torch.testing.assert_close(expected["weight"], torch.tensor([[2.04]]), **TOL)  # w = 0.02 * 4 * mean(x^2)
    torch.testing.assert_close(results[world_size][name]["state_dict"]["weight"], expected["weight"], **TOL)


#: windows of full micro-batches, the short last window of an epoch included
VISIBLE = [(1, f"{z}_toy_b2_n4") for z in ZERO] + [(2, f"{z}_toy_b1_n4") for z in ZERO + OFFLOAD]
VISIBLE += [(2, f"{z}_scheduler") for z in ZERO] + [(1, "uneven"), (2, "uneven")]
#: windows whose factor is not 1 (a smaller last micro-batch; num_items), scaled where ZeRO keeps the gradients
RESCALED = [(1, f"{z}_toy9_b2_n5") for z in ZERO] + [(w, "zero3_tokens") for w in (1, 2)]
RESCALED += [(2, f"{z}_tokens") for z in ("zero1", "zero2")] + [(2, f"{z}_tokens_clip") for z in OFFLOAD]


@pytest.mark.parametrize(("world_size", "name"), VISIBLE + RESCALED)
def test_gradients_read_before_the_step_are_the_big_batch_gradient(results, world_size, name):
    """What ``on_before_optimizer_step`` reads (``deepspeed.utils.safe_get_full_grad`` under ZeRO, ``.grad`` under
    ``ddp_exact``) is the window's big-batch gradient, also for an epoch's short last window: under ZeRO the
    micro-batches are weighted relative to the window's expected samples, so nothing is left to rescale later; a
    window with a smaller micro-batch or ``num_items`` has its factor applied where ZeRO keeps the reduced gradients,
    before the hook runs."""
    want = cases.reference_gradients(find(world_size, name), world_size)
    got = results[world_size][name]["hook_grads"]
    assert len(got) == len(want) > 0
    for step, (seen, expected) in enumerate(zip(got, want, strict=True)):
        assert sorted(seen) == sorted(expected)
        for key, value in expected.items():
            torch.testing.assert_close(seen[key], value, rtol=1e-6, atol=1e-6, msg=f"step {step}, {key}")


@pytest.mark.parametrize("world_size", [1, 2])
def test_short_last_window_is_scaled_to_its_real_size(results, world_size):
    # 10 batches, N=4, two epochs: windows of 4, 4 and 2 micro-batches in each epoch
    result = assert_matches_reference(results, world_size, "uneven")
    assert result["counts"]["optimizer_step"] == 6


@pytest.mark.parametrize("world_size", [1, 2])
def test_lightning_ddp_underweights_the_short_window(results, world_size):
    """The same run on Lightning's own ``ddp`` misses the reference: the configuration really exercises the fix."""
    expected, _, _ = cases.reference_training(find(world_size, "uneven_ddp"), world_size)
    actual = results[world_size]["uneven_ddp"]["state_dict"]
    assert max((actual[k] - expected[k]).abs().max().item() for k in expected) > 1e-3


def test_micro_batches_weigh_by_their_sample_count(results):
    assert_matches_reference(results, 1, "toy9_b2_n5")


@pytest.mark.parametrize(
    ("world_size", "name"), [(1, "tokens"), (2, "tokens"), (1, "zero3_tokens"), (2, "zero3_tokens")]
)
def test_num_items_gives_the_token_mean_over_all_ranks(results, world_size, name):
    _, _, mask = cases.make_data("tokens")
    if world_size == 2:  # the ranks really hold different token counts in every window
        for start in (0, 4):
            batches = [cases.rank_batches(len(mask), 2, r, 2)[start : start + 4] for r in range(2)]
            tokens = [sum(int(mask[i].sum()) for b in rank for i in b) for rank in batches]
            assert tokens[0] * 2 < tokens[1]
    assert find(world_size, name)["return_num_items"]
    assert_matches_reference(results, world_size, name)


@pytest.mark.parametrize(
    ("world_size", "name"),
    [(1, "scheduler"), (2, "scheduler"), (1, "zero2_scheduler")] + [(2, f"{z}_scheduler") for z in ZERO],
)
def test_step_scheduler_and_optimizer_hooks_run_once_per_real_step(results, world_size, name):
    assert_hooks_and_scheduler_once_per_step(results, world_size, name)


@pytest.mark.parametrize("name", ["toy_clip", "zero2_clip"])
def test_clipping_applies_once_to_the_accumulated_gradient(results, name):
    # full-batch gradient is -102; clipped to norm 50 the step gives w = 0.02 * 50 = 1.0
    assert_matches_reference(results, 1, name)
    torch.testing.assert_close(results[1][name]["state_dict"]["weight"], torch.tensor([[1.0]]), **TOL)


@pytest.mark.parametrize("name", ["zero1_bf16", "zero3_bf16"])
def test_bf16_zero_keeps_the_exact_update_within_bf16_rounding(results, name):
    """bf16 parameters with fp32 master weights: the window factor goes through the same optimizer path."""
    result = results[2][name]
    expected, _, steps = cases.reference_training(find(2, name), 2)
    assert result["global_step"] == steps == 3
    for key, value in expected.items():
        torch.testing.assert_close(result["state_dict"][key].float(), value, rtol=0.0, atol=2e-3)


@pytest.mark.parametrize("world_size", [1, 2])
def test_iterable_dataset_of_unknown_length_scales_its_short_window(results, world_size):
    assert_matches_reference(results, world_size, "iterable")


def test_ddp_exact_all_reduces_gradients_once_per_window(results):
    exact = results[2]["uneven"]
    assert exact["global_step"] == 6
    assert exact["grad_allreduces"] == 6  # DDP bucket all-reduces (comm hook): boundary micro-batches only
    assert exact["item_allreduces"] == 6  # one small all-reduce of the window's item count
    plain = results[2]["uneven_ddp"]
    assert plain["grad_allreduces"] == 6 and plain["item_allreduces"] == 0
    assert results[1]["uneven"]["item_allreduces"] == 0  # one rank: the count is local


def _collectives_by_role(result: dict) -> tuple[list[list[str]], list[list[str]]]:
    """Collectives ("op:dtype:numel"; "ds.": called through deepspeed.comm) of boundary micro-batches, and the rest."""
    boundary = [c for c, stepped in zip(result["collectives"], result["stepped"], strict=True) if stepped]
    inside = [c for c, stepped in zip(result["collectives"], result["stepped"], strict=True) if not stepped]
    return boundary, inside


def _gradient_reductions(calls: list[str]) -> list[str]:
    """DeepSpeed's gradient reductions (the 1-element all-reduces are the gradient norm)."""
    return [c for c in calls if c.startswith(("ds.all_reduce:", "ds.reduce_scatter_fn:")) and not c.endswith(":1")]


def test_zero1_reduces_gradients_once_per_window_and_not_in_between(results):
    boundary, inside = _collectives_by_role(results[2]["zero1_scheduler"])
    assert len(boundary) == 6 and len(inside) == 14
    assert all(calls == [] for calls in inside)  # non-boundary micro-batches: no communication at all
    for calls in boundary:
        assert len(_gradient_reductions(calls)) == 1, calls  # the whole (one-bucket) model, once per window
        assert calls.count("all_reduce:float64:4") == 1  # the window's item count


@pytest.mark.parametrize("name", ["zero2_scheduler", "zero3_scheduler"])
def test_zero2_and_zero3_reduce_every_micro_batch_by_design(results, name):
    """DeepSpeed partitions gradients after every backward in ZeRO-2/3 (each rank keeps only its shard): measured."""
    boundary, inside = _collectives_by_role(results[2][name])
    assert len(boundary) == 6 and len(inside) == 14
    assert all(len(_gradient_reductions(calls)) == 1 for calls in boundary + inside)
    assert all(calls.count("all_reduce:float64:4") == 1 for calls in boundary)
    assert all("all_reduce:float64:4" not in calls for calls in inside)


def test_sync_with_dataloader_false_accepts_full_windows(results):
    assert_matches_reference(results, 1, "strict_even")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "strict_uneven",
            "ValueError: The accumulation window ending at batch 9 of epoch 0 holds 2 of "
            "accumulate_grad_batches=4 micro-batches, but sync_with_dataloader=False requires full "
            "windows.",
        ),
        (
            "zero_items",
            "ValueError: num_items summed to 0 over an accumulation window (2 micro-batches on all ranks), "
            "so the window's mean loss is undefined.",
        ),
        (
            "non_scalar",
            "ValueError: training_step must return a scalar loss for exact gradient accumulation, got a "
            "tensor of shape (2,). Reduce it first",
        ),
    ],
)
def test_bad_input_raises_a_clear_error(results, name, message):
    error = results[1][name]["error"]
    assert error is not None and error.startswith(message), error


def test_strategies_are_registered_with_exact_accumulation():
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry

    import lightspeed  # noqa: F401
    from lightspeed.strategies.ddp_exact import DDPExactStrategy
    from lightspeed.strategies.exact_accumulation import DeepSpeedExactAccumulationMixin, ExactAccumulationMixin

    assert StrategyRegistry["ddp_exact"]["strategy"] is DDPExactStrategy
    trainer = pl.Trainer(strategy="ddp_exact", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, ExactAccumulationMixin) and trainer.strategy.sync_with_dataloader is True
    for name in ZERO:
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, DeepSpeedExactAccumulationMixin)
        assert strategy.handles_gradient_accumulation is False  # Lightning's loop runs hooks once per real step


@pytest.mark.parametrize(("world_size", "name"), RESCALED)
def test_windows_rescaled_inside_zero_train_like_one_process(results, world_size, name):
    assert_matches_reference(results, world_size, name)
