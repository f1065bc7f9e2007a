"""``unused_parameters=`` without processes: the two modes are the only ones the front ends take (one message naming
the strategy), and which optimizers lightspeed can leave unused parameters alone under exactly. The runs of 2 ranks
are in tests/strategies/test_zero_model_shapes.py, tests/fabric/test_fabric_model_shapes.py and the MoE tests."""

from __future__ import annotations

import pytest
import torch

from lightspeed.core.zero.unused_parameters import _rule, check_unused_parameters_mode
from lightspeed.fabric import ZeroFabricStrategy
from lightspeed.strategies import ZeroStrategy


@pytest.mark.parametrize("strategy", [ZeroStrategy, ZeroFabricStrategy])
def test_a_mode_that_does_not_exist_is_refused_when_the_strategy_is_created(strategy: type) -> None:
    with pytest.raises(ValueError) as info:
        strategy(unused_parameters="ignore")
    assert str(info.value) == (
        f"{strategy.__name__}(unused_parameters='ignore') is not an option: 'skip' (default) leaves the parameters no "
        "rank used in a step, and their optimizer state, as one process leaves them; 'zero_gradient' gives them a "
        "step on a zero gradient (ZeRO's own behaviour)."
    )


@pytest.mark.parametrize("mode", ["skip", "zero_gradient"])
def test_both_modes_are_taken(mode: str) -> None:
    assert check_unused_parameters_mode(mode, "ZeroStrategy") == mode
    assert ZeroStrategy(unused_parameters=mode)._session.unused_parameters == mode


@pytest.mark.parametrize(
    ("optimizer", "rule"),
    [
        (lambda p: torch.optim.AdamW(p), "adam"),
        (lambda p: torch.optim.Adam(p, weight_decay=0.1, amsgrad=True), "adam"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "restore"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), None),
        (lambda p: torch.optim.RMSprop(p), "restore"),
        (lambda p: torch.optim.Adagrad(p), "restore"),
        (lambda p: torch.optim.Adagrad(p, lr_decay=0.01), None),
        (lambda p: torch.optim.Adadelta(p), "restore"),
        (lambda p: torch.optim.NAdam(p), None),
        (lambda p: torch.optim.Adamax(p), None),
    ],
)
def test_which_optimizers_are_exact_by_restoring_or_stepping_adam_again(optimizer: object, rule: str | None) -> None:
    """ "restore": the update reads no step count, so putting the unused pieces back is enough; "adam": also stepped
    again with the parameter's own step count; None: refused at the first unused parameter."""
    made = optimizer([torch.nn.Parameter(torch.zeros(3))])  # type: ignore[operator]
    assert _rule(made, made.param_groups[0]) == rule
