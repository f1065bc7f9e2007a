"""The ``lightspeed`` logger's switch (``LIGHTSPEED_LOG_LEVEL``) and the one-line summary of a resolved config."""

from __future__ import annotations

import logging

import pytest

from lightspeed.core.common import logs
from lightspeed.core.zero.config import summarize_config


@pytest.fixture
def clean_logger():
    before = (logs.logger.level, list(logs.logger.handlers))
    yield logs.logger
    logs.logger.setLevel(before[0])
    logs.logger.handlers[:] = before[1]


def test_the_environment_sets_the_level_and_one_handler(clean_logger, monkeypatch) -> None:
    monkeypatch.setenv("LIGHTSPEED_LOG_LEVEL", "debug")
    logs.configure_from_environment()
    logs.configure_from_environment()  # once only: no second handler
    assert clean_logger.level == logging.DEBUG
    assert sum(getattr(h, "_lightspeed", False) for h in clean_logger.handlers) == 1


def test_unset_leaves_the_logger_alone(clean_logger, monkeypatch) -> None:
    monkeypatch.delenv("LIGHTSPEED_LOG_LEVEL", raising=False)
    level, handlers = clean_logger.level, list(clean_logger.handlers)
    logs.configure_from_environment()
    assert (clean_logger.level, clean_logger.handlers) == (level, handlers)


def test_a_level_that_does_not_exist_is_named(monkeypatch) -> None:
    monkeypatch.setenv("LIGHTSPEED_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match=r"^LIGHTSPEED_LOG_LEVEL='loud' is not a log level; use one of DEBUG, INFO"):
        logs.configure_from_environment()


def test_the_summary_names_stage_offload_batch_precision_and_clipping() -> None:
    config = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}},
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
    }
    assert summarize_config(config) == (
        "ZeRO-3, optimizer states on cpu, parameters on nvme, micro-batch 8 x 4 accumulated, bf16, clipping at 1"
    )
    plain = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0}
    assert summarize_config(plain) == "ZeRO-1, micro-batch 2 x 1 accumulated, fp32, no clipping"
