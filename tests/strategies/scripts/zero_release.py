"""Worker: ZeRO runs one after another in one process (as in a notebook); prints one JSON line of what stayed alive,
by strategy name (the arguments).

For each: a Trainer's fit, its validate (the kept engine), then the objects dropped and a second Trainer's fit:
were the first run's Trainer, model, engine and a parameter freed? Then an earlier Trainer kept by the user validates
after another run (refused), the same Trainer fits twice, and a Fabric loop keeps working while a second one starts."""

from __future__ import annotations

import gc
import json
import sys
import weakref
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401
from _support.models import RegressionModule, make_regression_data
from _support.trainers import quiet_trainer
from lightspeed.errors import EngineReleasedError


def data() -> DataLoader:
    return DataLoader(make_regression_data(16), batch_size=4)


def fit(strategy: str) -> L.Trainer:
    trainer = quiet_trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2)
    trainer.fit(RegressionModule(), data())
    return trainer


def alive(refs: dict[str, weakref.ref]) -> dict[str, bool]:
    gc.collect()
    return {name: ref() is not None for name, ref in refs.items()}


def refs_of(trainer: L.Trainer) -> dict[str, weakref.ref]:
    module = trainer.lightning_module
    return {
        "trainer": weakref.ref(trainer),
        "module": weakref.ref(module),
        "engine": weakref.ref(trainer.strategy._train_engine),
        "parameter": weakref.ref(next(module.parameters())),
    }


def refusal(call: Any, *args: Any, **kwargs: Any) -> str:
    try:
        call(*args, **kwargs)
    except EngineReleasedError as error:
        return str(error)
    return "no error"


def fabric_step(strategy: str) -> tuple[L.Fabric, Any]:
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.launch()
    module = RegressionModule()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    x, y = make_regression_data(4)[:]
    fabric.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    return fabric, model


def runs(stage: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    first = fit(stage)
    out["validate_after_fit"] = first.validate(first.lightning_module, data(), verbose=False)[0]["val_loss"]
    refs = refs_of(first)
    out["kept_until_the_next_run"] = alive(refs)
    del first
    second = fit(stage)
    out["after_the_next_run"] = alive(refs)

    third = fit(stage)  # `second` is kept: its engine is released by this run
    out["earlier_trainer_validates"] = refusal(second.validate, second.lightning_module, data(), verbose=False)
    released = second.strategy.model  # the released engine (the strategy let go of it as its training engine)
    out["released_engine_saves"] = refusal(released.save_checkpoint, "unused", tag="checkpoint")
    out["released_engine_loads"] = refusal(released.load_checkpoint, "unused", tag="checkpoint")
    refs = {"engine": weakref.ref(third.strategy._train_engine)}
    third.fit(third.lightning_module, data())  # the same Trainer fits again: a new engine, the last one released
    out["same_trainer_fits_again"] = alive(refs)
    del second, third

    fabric, model = fabric_step(stage)  # a Fabric loop never reports its end: it is never released under it
    refs = {"engine": weakref.ref(fabric._strategy._deepspeed_engine)}
    fabric_step(stage)
    out["earlier_fabric_model_still_runs"] = tuple(model(make_regression_data(4)[:][0]).shape)
    del fabric, model
    out["earlier_fabric_engine_kept"] = alive(refs)
    return out


if __name__ == "__main__":
    print(json.dumps({stage: runs(stage) for stage in sys.argv[1:]}), flush=True)
