"""Core accumulation arithmetic and item weighting, single process, against plain PyTorch full-batch gradients."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from lightspeed.core.accumulation.exact import ExactAccumulator, scale_gradients, skip_gradient_sync

_spec = importlib.util.spec_from_file_location(
    "accumulation_cases", Path(__file__).parents[2] / "strategies" / "scripts" / "accumulation_cases.py"
)
_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cases)
AccumulationWindows = _cases.AccumulationWindows  # the plain-loop reference windows (test-only)

TOL = dict(rtol=0.0, atol=1e-6)


# ------------------------------------------------------------------- window arithmetic of the reference windows
def test_ten_batches_with_four_per_window_end_in_a_short_window_of_two():
    windows = AccumulationWindows(4, num_batches=10)
    assert [b for b in range(10) if windows.is_boundary(b)] == [3, 7, 9]
    assert [windows.window_size(b) for b in range(10)] == [4] * 8 + [2] * 2
    assert [windows.window_index(b) for b in range(10)] == [0] * 4 + [1] * 4 + [2] * 2
    assert [b for b in range(10) if windows.opens_window(b)] == [0, 4, 8]
    assert windows.loss_scale(0) == 1.0 and windows.loss_scale(9) == 2.0  # (loss / 4) * 2 == loss / 2
    assert windows.steps_per_pass() == 3 and windows.total_steps(2) == 6


def test_windows_restart_with_every_pass_when_syncing_with_the_dataloader():
    windows = AccumulationWindows(4, num_batches=10)
    assert windows.window_index(0, epoch=1) == 0 and windows.opens_window(0, epoch=1)
    assert windows.is_boundary(9, epoch=1)


def test_windows_run_across_passes_without_syncing_with_the_dataloader():
    windows = AccumulationWindows(4, num_batches=10, sync_with_dataloader=False)
    # stream positions 8, 9 | 10, 11 form one full window across the pass boundary
    assert not windows.is_boundary(9, epoch=0)
    assert windows.window_index(9, epoch=0) == windows.window_index(1, epoch=1) == 2
    assert windows.is_boundary(1, epoch=1)
    assert windows.window_size(9) == 4
    assert windows.total_steps(2) == 5  # 20 micro-batches: 5 full windows
    with pytest.raises(ValueError, match="With sync_with_dataloader=False windows span passes"):
        windows.steps_per_pass()


def test_unknown_length_learns_the_last_window_only_when_the_data_ends():
    windows = AccumulationWindows(4)
    assert not windows.is_boundary(5)
    assert windows.is_boundary(5, is_last_batch=True)
    assert windows.is_boundary(7)
    with pytest.raises(ValueError, match="The size of the last window is unknown because the dataloader has no length"):
        windows.window_size(5)
    with pytest.raises(ValueError, match="windows continue across passes, so the number of batches per pass must be"):
        AccumulationWindows(4, sync_with_dataloader=False).window_index(0, epoch=1)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_accumulate_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=r"accumulate must be a positive integer \(accumulate_grad_batches\), got"):
        AccumulationWindows(bad)


def test_batch_index_past_the_end_of_the_pass_is_rejected():
    with pytest.raises(ValueError, match="batch_idx 10 is past the end of a pass of 10 batches"):
        AccumulationWindows(4, num_batches=10).is_boundary(10)


# ------------------------------------------------------------------------------------------------ item weighting
def _data(n: int = 9):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=gen), torch.randn(n, 1, generator=gen)


def _model() -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(3, 1)


def _full_batch_grads(x, y):
    model = _model()
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("normalized_by", [1, 4])
def test_mean_losses_of_uneven_micro_batches_weigh_by_sample_count(normalized_by):
    x, y = _data(9)
    model = _model()
    accumulator = ExactAccumulator()
    for start in range(0, 9, 2):  # micro-batches of 2, 2, 2, 2, 1 samples
        xb, yb = x[start : start + 2], y[start : start + 2]
        loss = nn.functional.mse_loss(model(xb), yb) / normalized_by  # what a framework hands to backward
        (loss * accumulator.record(loss, num_samples=len(xb), normalized_by=normalized_by)).backward()
    factor = accumulator.finish_window(model.parameters())
    assert factor == pytest.approx(1 / 9)
    for got, expected in zip((p.grad for p in model.parameters()), _full_batch_grads(x, y), strict=True):
        torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("normalized_by", [1, 4])
def test_weights_relative_to_a_full_window_need_no_factor(normalized_by):
    """``window_items``: a full window of configured micro-batches gets multipliers and a factor of exactly 1 (the
    gradients are right when backward ends); a window holding fewer samples still gets its exact factor."""
    x, y = _data(8)
    accumulator = ExactAccumulator()
    multipliers = []
    for start in range(0, 8, 2):
        loss = nn.functional.mse_loss(_model()(x[start : start + 2]), y[start : start + 2]) / normalized_by
        multipliers.append(accumulator.record(loss, num_samples=2, normalized_by=normalized_by, window_items=8))
    assert multipliers == [normalized_by / 4] * 4 and accumulator.window_factor() == 1.0
    x, y = _data(9)
    model = _model()
    for start in range(0, 9, 2):  # the same expected size, but 2, 2, 2, 2, 1 samples: the factor makes it exact
        loss = nn.functional.mse_loss(model(x[start : start + 2]), y[start : start + 2])
        (loss * accumulator.record(loss, num_samples=len(x[start : start + 2]), window_items=10)).backward()
    assert accumulator.finish_window(model.parameters()) == pytest.approx(10 / 9)
    for got, expected in zip((p.grad for p in model.parameters()), _full_batch_grads(x, y), strict=True):
        torch.testing.assert_close(got, expected, **TOL)


def test_ranks_or_micro_batches_that_disagree_on_the_window_size_are_an_error():
    changed = ExactAccumulator()
    changed.record(torch.tensor(1.0), num_samples=2, window_items=8)
    with pytest.raises(ValueError, match=r"^window_items changed inside an accumulation window \(8, then 4\)"):
        changed.record(torch.tensor(1.0), num_samples=2, window_items=4)

    def other_rank_expects_four(tensor):  # a second rank with the same counts but a window of 4 samples
        other = tensor.clone()
        other[3] = 4.0
        return tensor + other

    disagree = ExactAccumulator(world_size=2, all_reduce_sum=other_rank_expects_four)
    disagree.record(torch.tensor(1.0), num_samples=2, window_items=8)
    with pytest.raises(
        ValueError,
        match=r"^The ranks weighted this accumulation window against different sizes \(this rank: 8 samples per "
        r"window; all ranks together: 12\)\. Every rank must run the same micro-batch size",
    ):
        disagree.window_factor()


def test_summed_losses_with_num_items_give_the_mean_over_all_items():
    x, y = _data(9)
    model = _model()
    accumulator = ExactAccumulator()
    for indices in ([0, 1, 2, 3, 4], [5], [6, 7, 8]):
        loss_sum = nn.functional.mse_loss(model(x[indices]), y[indices], reduction="sum")
        (loss_sum * accumulator.record(loss_sum, num_items=torch.tensor(len(indices)))).backward()
    accumulator.finish_window(model.parameters())
    for got, expected in zip((p.grad for p in model.parameters()), _full_batch_grads(x, y), strict=True):
        torch.testing.assert_close(got, expected, **TOL)


def test_the_window_factor_averages_back_over_ranks_and_counts_once():
    calls = []

    def fake_sum(tensor):  # two ranks that saw the same counts
        calls.append(tensor.clone())
        return tensor * 2

    accumulator = ExactAccumulator(world_size=2, all_reduce_sum=fake_sum)
    for items in (3, 5):
        accumulator.record(torch.tensor(1.0), num_items=items)
    assert accumulator.window_factor() == pytest.approx(2 / 16)  # DDP averaged: * W / T
    assert len(calls) == 1
    summing = ExactAccumulator(world_size=2, all_reduce_sum=lambda t: t * 2, gradients_averaged=False)
    summing.record(torch.tensor(1.0), num_items=4)
    assert summing.window_factor() == pytest.approx(1 / 8)


def test_a_new_window_forgets_the_previous_counts():
    accumulator = ExactAccumulator()
    accumulator.record(torch.tensor(1.0), num_items=3)
    assert accumulator.window_factor() == pytest.approx(1 / 3)
    accumulator.record(torch.tensor(1.0), num_items=4)
    accumulator.start_window()
    accumulator.record(torch.tensor(1.0), num_items=5)
    assert accumulator.micro_batches == 1
    assert accumulator.window_factor() == pytest.approx(1 / 5)
    assert accumulator.window_factor() == 1.0  # an empty window scales nothing


def test_zero_items_in_a_window_is_an_error():
    accumulator = ExactAccumulator()
    accumulator.record(torch.tensor(0.0), num_items=0)
    accumulator.record(torch.tensor(0.0), num_items=torch.tensor(0))
    with pytest.raises(
        ValueError,
        match=r"num_items summed to 0 over an accumulation window \(2 micro-batches on all ranks\), so the window's "
        r"mean loss is undefined\. Every window of accumulate_grad_batches micro-batches needs at least one item",
    ):
        accumulator.window_factor()


def test_num_items_from_only_some_micro_batches_is_an_error():
    accumulator = ExactAccumulator()
    accumulator.record(torch.tensor(1.0), num_items=2)
    accumulator.record(torch.tensor(1.0), num_samples=2)
    with pytest.raises(ValueError, match=r"training_step returned num_items for 1 of the window's 2 micro-batches"):
        accumulator.window_factor()


@pytest.mark.parametrize(
    ("loss", "error", "message"),
    [
        (
            torch.ones(3),
            ValueError,
            r"training_step must return a scalar loss for exact gradient accumulation, got a "
            r"tensor of shape \(3,\)\. Reduce it first: loss\.mean\(\), or loss\.sum\(\)",
        ),
        (
            2.0,
            TypeError,
            "training_step must return the loss as a torch.Tensor for exact gradient accumulation, got float",
        ),
    ],
)
def test_non_scalar_loss_is_an_error(loss, error, message):
    with pytest.raises(error, match=message):
        ExactAccumulator().record(loss)


@pytest.mark.parametrize(
    ("num_items", "error", "message"),
    [
        (-1, ValueError, r"num_items must be a finite count >= 0, got -1"),
        (float("nan"), ValueError, r"num_items must be a finite count >= 0, got nan"),
        (torch.ones(2), ValueError, r"num_items must be a single count, got a tensor of shape \(2,\)"),
        ("3", TypeError, r"num_items must be a number or a one-element tensor, got str"),
    ],
)
def test_bad_num_items_is_an_error(num_items, error, message):
    with pytest.raises(error, match=message):
        ExactAccumulator().record(torch.tensor(1.0), num_items=num_items)


# --------------------------------------------------------------------------------------------------- small tools
def test_scale_gradients_multiplies_existing_gradients_only():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3, dtype=torch.float64))
    frozen = nn.Parameter(torch.ones(1))
    a.grad, b.grad = torch.full((2,), 3.0), torch.full((3,), 2.0, dtype=torch.float64)
    scale_gradients([a, b, frozen], 0.5)
    assert a.grad.tolist() == [1.5, 1.5] and b.grad.tolist() == [1.0, 1.0, 1.0] and frozen.grad is None


def test_skip_gradient_sync_uses_no_sync_when_the_module_has_it():
    events = []

    class FakeDDP(nn.Module):
        def no_sync(self):
            events.append("enter")
            return _Recorder(events)

    with skip_gradient_sync(FakeDDP()):
        events.append("backward")
    assert events == ["enter", "backward", "exit"]
    with skip_gradient_sync(nn.Linear(1, 1)):  # plain module: nothing to skip
        pass


class _Recorder:
    def __init__(self, events):
        self.events = events

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.events.append("exit")
