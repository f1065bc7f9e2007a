"""A job for ``lightspeed tune``: the regression module and a shuffled loader of its data."""

from __future__ import annotations

from torch.utils.data import DataLoader

from _support.models import RegressionModule, make_regression_data


def job() -> tuple[RegressionModule, DataLoader]:
    return RegressionModule(), DataLoader(make_regression_data(), batch_size=4, shuffle=True)


def not_a_job() -> RegressionModule:
    return RegressionModule()
