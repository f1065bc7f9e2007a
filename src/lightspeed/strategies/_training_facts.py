"""What the Trainer and the LightningModule decide, read into :class:`TrainingFacts` so that the core's config
resolution needs no Lightning."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.trainer.states import TrainerFn

from lightspeed.core.zero.config import AUTO, OptimizerFacts, TrainingFacts, find_hidden_size

__all__ = ["collect_training_facts"]


def collect_training_facts(
    module: pl.LightningModule | None,
    world_size: int,
    precision: str,
    config: dict[str, Any],
    micro_batch_size: int | None = None,
) -> TrainingFacts:
    """The facts ``config``'s ``"auto"`` values are resolved from. Outside ``fit`` (or without a Trainer) the
    training-only facts (batch size, optimizer, total steps) are unknown and left ``None``. ``micro_batch_size``:
    the size training uses instead of the training DataLoader's (``zero_auto``'s tuner re-batches it)."""
    trainer = module.trainer if module is not None and module._trainer is not None else None
    if module is None or trainer is None:
        return TrainingFacts(
            world_size=world_size,
            micro_batch_size=None,
            accumulate_grad_batches=1,
            gradient_clip_val=None,
            precision=precision,
            hidden_size=find_hidden_size(module) if module is not None else None,
        )
    fitting = trainer.state.fn == TrainerFn.FITTING
    return TrainingFacts(
        world_size=world_size,
        micro_batch_size=(micro_batch_size or _train_micro_batch_size(trainer)) if fitting else None,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        gradient_clip_val=trainer.gradient_clip_val,
        precision=precision,
        hidden_size=find_hidden_size(module),
        optimizer=_optimizer_facts(module, config) if fitting else None,
        total_steps=_total_steps(trainer, config) if fitting else None,
    )


def _train_micro_batch_size(trainer: pl.Trainer) -> int | None:
    data_source = trainer.fit_loop._data_source
    if not data_source.is_defined():
        return None
    loader = data_source.dataloader()
    batch_sampler = getattr(loader, "batch_sampler", None)
    batch_size = getattr(batch_sampler, "batch_size", None) or getattr(loader, "batch_size", None)
    return int(batch_size) if batch_size else None


def _optimizer_facts(module: pl.LightningModule, config: dict[str, Any]) -> OptimizerFacts | None:
    # Only needed when the DeepSpeed config defines its own optimizer with "auto" hyperparameters.
    section = config.get("optimizer")
    if not section or AUTO not in json.dumps(section):
        return None
    optimizers, _ = _init_optimizers_and_lr_schedulers(module)
    if not optimizers:
        return None
    defaults = optimizers[0].defaults
    return OptimizerFacts(
        type_name=type(optimizers[0]).__name__,
        lr=float(defaults["lr"]),
        betas=tuple(defaults["betas"]) if "betas" in defaults else None,
        eps=defaults.get("eps"),
        weight_decay=defaults.get("weight_decay"),
    )


def _total_steps(trainer: pl.Trainer, config: dict[str, Any]) -> int | None:
    if AUTO not in json.dumps(config.get("scheduler", {})):
        return None
    steps = trainer.estimated_stepping_batches
    return int(steps) if steps != float("inf") else None
