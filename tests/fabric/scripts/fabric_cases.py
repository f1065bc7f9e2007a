"""Worker: hand-written Lightning Fabric loops under lightspeed's strategy names, on the ranks of one launch.

usage: fabric_cases.py OUT_DIR SCENARIO[,SCENARIO...] [--accelerator cpu|cuda] [--devices N] [--train-steps K]
       (defaults: cpu, 2, 4)
Scenarios (each writes OUT_DIR/<scenario>.json and, for weights, OUT_DIR/<scenario>.pt from rank 0):
  train:NAME[@PRECISION]  K plain steps (AdamW, batch 4), ZeRO-3 names build the model under fabric.init_module();
                      the JSON records the steps fp16 loss scaling skipped (from 0) and the parameters' dtypes, and
                      <scenario>.initial.pt the weights the model was built with
  accum:NAME          lightspeed.fabric.accumulate: the toy (w=0, x=1..8, y=2x, batch 2, steps 4, SGD 0.02), a
                      10-batch epoch (steps 4) with mean losses and with num_items, a clipped window
  resume:NAME         2 steps, fabric.save, 2 more steps; then a fresh Fabric loads and does the same 2 steps
  full:NAME           load_full_weights=True: a fabric.save-style file, a plain state dict and a safetensors export
                      loaded into the model (and the optimizer's masters), one step after each; strict=False
  config_opt:NAME     the optimizer and scheduler of the DeepSpeed config (config_optimizer()), 6 steps
  tune:NAME           ZeroAutoFabricStrategy(tune=True): zero1 and zero2 measured, the chosen one trains 4 steps;
                      then the same 4 steps under the chosen option as a fixed strategy
  torch_sched:NAME    torch's StepLR built on the optimizer fabric.setup returned, 6 steps, saved with the
                      checkpoint after 3 and loaded back into a fresh StepLR
  errors:NAME         two optimizers, clip_gradients(clip_val=...), a config contradicting Fabric's precision;
                      ZeRO-3: a module deep-copied under fabric.init_module()
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed
from _support.models import full_state_dict, make_net, make_regression_data

TOY_LR, ACCUM_LR, CLIP = 0.02, 0.05, 0.05
#: where the launch runs (``--accelerator``, ``--devices``) and how many steps the train scenario takes
PLACE = {"accelerator": "cpu", "devices": 2, "train_steps": 4}


def make_fabric(name: str, precision: str = "32-true", strategy: Any = None) -> L.Fabric:
    fabric = L.Fabric(
        strategy=strategy if strategy is not None else name,
        precision=precision,
        accelerator=PLACE["accelerator"],
        devices=PLACE["devices"],
    )
    fabric.launch()
    return fabric


def engine_module(model: Any) -> nn.Module:
    inner = model._forward_module
    return inner.module if hasattr(inner, "module") else inner


def weights_of(model: Any) -> dict[str, torch.Tensor]:
    return full_state_dict(engine_module(model))


def inner_optimizer_name(optimizer: Any) -> str:
    opt = optimizer.optimizer  # what Fabric wraps: DeepSpeed's ZeRO optimizer (or the torch one)
    return type(getattr(opt, "optimizer", opt)).__name__


# ----------------------------------------------------------------------------------------------------- train
def scenario_train(spec: str, out: Path) -> tuple[dict, dict]:
    name, _, precision = spec.partition("@")
    fabric = make_fabric(name, precision or "32-true")
    sharded = name.startswith("zero3")
    if sharded:
        with fabric.init_module():
            model = make_net()
        partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    else:
        model = make_net()
        partitioned = False
    # built under init_module() on a GPU, the weights come from the CUDA generator: the reference starts from them
    initial = full_state_dict(model)
    if fabric.global_rank == 0:
        torch.save(initial, out / f"train_{spec}.initial.pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(make_regression_data(), batch_size=4, shuffle=True))
    engine, skipped = model._forward_module, []
    for step, (x, y) in enumerate(loader):
        if step == PLACE["train_steps"]:
            break
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if getattr(engine, "skipped_steps", 0) > len(skipped):  # fp16 overflow: DeepSpeed skipped this update
            skipped.append(step)
    meta = {
        "world_size": fabric.world_size,
        "skipped": skipped,
        "loss_scale": getattr(optimizer.optimizer, "loss_scale", None),
        "param_dtypes": sorted({str(p.dtype) for p in engine_module(model).parameters()}),
        "device": str(next(engine_module(model).parameters()).device),
        "config": fabric.strategy.config,
        "optimizer": inner_optimizer_name(optimizer),
        "stage": fabric.strategy.config["zero_optimization"]["stage"],
        "sharded_init": partitioned,
        "offload": sorted(k for k in fabric.strategy.config["zero_optimization"] if k.startswith("offload")),
    }
    chosen = getattr(fabric.strategy, "chosen_option", None)
    if chosen is not None:
        meta["chosen"] = {"stage": chosen.stage, "offload_optimizer": chosen.offload_optimizer}
    return meta, weights_of(model)


# ----------------------------------------------------------------------------------------------------- accum
def toy_data() -> TensorDataset:
    x = torch.arange(1, 9, dtype=torch.float32).reshape(8, 1)
    return TensorDataset(x, 2 * x)


def accum_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, 3, generator=gen)
    y = torch.randn(40, 1, generator=gen)
    items = torch.randint(1, 5, (40,), generator=gen).float()
    return TensorDataset(x, y, items)


def linear(features: int, zero: bool) -> nn.Linear:
    torch.manual_seed(3)
    layer = nn.Linear(features, 1, bias=not zero)
    if zero:
        nn.init.zeros_(layer.weight)
    return layer


def run_accumulation(name: str, data: TensorDataset, model: nn.Module, lr: float, mode: str) -> dict:
    fabric = make_fabric(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=2, shuffle=False))
    steps, factors, windows, syncs, norms, grads = 0, [], [], [], [], []
    inner = model._forward_module  # DDP or DeepSpeed's engine
    for batch, step in lightspeed.fabric.accumulate(fabric, model, loader, steps=4):
        x, y = batch[0], batch[1]
        pred = model(x)
        # will this micro-batch's backward reduce gradients across ranks?
        if hasattr(inner, "require_backward_grad_sync"):
            syncs.append(bool(inner.require_backward_grad_sync))
        else:
            syncs.append(bool(inner.is_gradient_accumulation_boundary()))
        if mode == "items":
            items = batch[2]
            loss = ((pred - y).pow(2).squeeze(1) * items).sum()
            step.backward(loss, num_items=items.sum())
        else:
            step.backward(nn.functional.mse_loss(pred, y))
        if step.sync_gradients:
            grads.append(visible_gradients(model))  # what a user logs between backward and the step
            norm = fabric.clip_gradients(model, optimizer, max_norm=CLIP) if mode == "clip" else None
            optimizer.step()
            if norm is not None:  # the total norm before clipping (ZeRO: filled in by the step)
                norms.append(float(norm))
            optimizer.zero_grad()
            steps += 1
            factors.append(step.factor)
            windows.append(step.position + 1)
    return {
        "steps": steps,
        "factors": factors,
        "window_sizes": windows,
        "syncs": syncs,
        "norms": norms,
        "grads": grads,
        "weights": {k: v.flatten().tolist() for k, v in weights_of(model).items()},
    }


def visible_gradients(model: nn.Module) -> dict[str, list[float]]:
    """Each parameter's full gradient as a user reads it before the step: ``deepspeed.utils.safe_get_full_grad``
    under ZeRO (a collective under ZeRO-3: every rank reads), ``.grad`` otherwise."""
    from deepspeed.utils import safe_get_full_grad

    named = dict(model.named_parameters())
    zero = any(hasattr(p, "_hp_mapping") or hasattr(p, "ds_id") for p in named.values())
    grads = {n: safe_get_full_grad(p) if zero else p.grad for n, p in named.items()}
    return {n.removeprefix("_forward_module.").removeprefix("module."): g.flatten().tolist() for n, g in grads.items()}


def run_no_backward_sync(name: str, data: TensorDataset, model: nn.Module, lr: float, steps: int = 4) -> dict:
    """Fabric's own accumulation idiom: ``fabric.no_backward_sync`` around every micro-batch but each window's last,
    the loss divided by ``steps``, one optimizer step per window (the short last window of the epoch included)."""
    fabric = make_fabric(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=2, shuffle=False))
    for index, (x, y, *_) in enumerate(loader):
        boundary = (index + 1) % steps == 0 or index + 1 == len(loader)
        with fabric.no_backward_sync(model, enabled=not boundary):
            fabric.backward(nn.functional.mse_loss(model(x), y) / steps, model=model)
        if boundary:
            optimizer.step()
            optimizer.zero_grad()
    return {"weights": {k: v.flatten().tolist() for k, v in weights_of(model).items()}}


def scenario_accum(name: str, out: Path) -> tuple[dict, None]:
    return {
        "toy": run_accumulation(name, toy_data(), linear(1, zero=True), TOY_LR, "mean"),
        "mean": run_accumulation(name, accum_data(), linear(3, zero=False), ACCUM_LR, "mean"),
        "items": run_accumulation(name, accum_data(), linear(3, zero=False), ACCUM_LR, "items"),
        "clip": run_accumulation(name, accum_data(), linear(3, zero=False), ACCUM_LR, "clip"),
        "no_backward_sync": run_no_backward_sync(name, accum_data(), linear(3, zero=False), ACCUM_LR),
    }, None


# ----------------------------------------------------------------------------------------------------- resume
def resume_part(name: str, ckpt: Path, load: bool) -> tuple[dict, dict[str, torch.Tensor], dict]:
    fabric = make_fabric(name)
    model = make_net(seed=5 if load else 0)  # the resumed run starts from other weights: the load must restore them
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(make_regression_data(), batch_size=4, shuffle=False))
    batches = list(loader)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    info: dict[str, Any] = {}
    if load:
        remainder = fabric.load(ckpt, state)
        info["loaded_step"] = state["step"]
        info["remainder_keys"] = sorted(remainder)
    saved = None
    for index in range(4):
        if index < state["step"]:
            continue
        if index == 2 and not load:
            state["step"] = 2
            fabric.save(ckpt, state)
            saved = weights_of(model)
        x, y = batches[index]
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    info["optimizer"] = inner_optimizer_name(optimizer)
    info["engine_steps"] = int(model._forward_module.global_steps)  # DeepSpeed's own step counter
    return info, weights_of(model), saved or {}


def scenario_resume(name: str, out: Path) -> tuple[dict, dict]:
    ckpt = out / f"ckpt_{name}"
    first, straight, at_save = resume_part(name, ckpt, load=False)
    second, resumed, _ = resume_part(name, ckpt, load=True)
    meta = {"first": first, "second": second, "ckpt": str(ckpt)}
    weights = {f"straight.{k}": v for k, v in straight.items()}
    weights.update({f"resumed.{k}": v for k, v in resumed.items()})
    weights.update({f"saved.{k}": v for k, v in at_save.items()})
    return meta, weights


# ----------------------------------------------------------------------------------------------------- errors
def error_of(fn: Any) -> dict:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test compares type and message
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": None}


def scenario_errors(name: str, out: Path) -> tuple[dict, None]:
    result: dict[str, Any] = {}
    fabric = make_fabric(name)
    model = make_net()
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model.parameters(), lr=0.1)
    result["two_optimizers"] = error_of(lambda: fabric.setup(model, opt_a, opt_b))

    fabric = make_fabric(name)
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = make_regression_data(4).tensors
    fabric.backward(nn.functional.mse_loss(model(x), y))
    result["clip_by_value"] = error_of(lambda: fabric.clip_gradients(model, optimizer, clip_val=1.0))

    fabric = make_fabric(name)
    wide = make_net().double()  # float64 parameters: refused before Fabric's precision casts them to float32
    result["float64_parameters"] = error_of(lambda: fabric.setup(wide, torch.optim.SGD(wide.parameters(), lr=0.1)))

    strategy = lightspeed.fabric.ZeroFabricStrategy(stage=2, config={"bf16": {"enabled": True}})
    result["precision_mismatch"] = error_of(lambda: make_fabric(name, precision="32-true", strategy=strategy))
    return result, None


# ----------------------------------------------------------------------------------------------------- full weights
def scenario_full(name: str, out: Path) -> tuple[dict, dict]:
    """``load_full_weights=True``: consolidated files written without DeepSpeed (Fabric's layout, a plain state dict,
    a safetensors export) go into the (partitioned) model and the optimizer's master copies; then one step.
    ``strict=False`` on a file with one key too many and one too few reports both."""
    from safetensors.torch import save_file

    from lightspeed.core.zero.config import ZERO_PRESETS

    strategy = lightspeed.fabric.ZeroFabricStrategy(**ZERO_PRESETS[name].init_params(), load_full_weights=True)
    fabric = make_fabric(name, strategy=strategy)
    folder = out / f"full_{name}"
    source = make_net(seed=9).state_dict()
    if fabric.global_rank == 0:
        (folder / "export").mkdir(parents=True, exist_ok=True)
        torch.save({"model": source, "step": 5}, folder / "fabric.ckpt")
        torch.save(source, folder / "plain.pt")
        save_file({k: v.contiguous() for k, v in source.items()}, folder / "export" / "model.safetensors")
        partial = {k: v for k, v in source.items() if k != "2.bias"}
        torch.save({"model": {**partial, "extra.weight": torch.zeros(2)}}, folder / "partial.ckpt")
    fabric.barrier()
    x, y = make_regression_data(8).tensors
    rows = slice(4 * fabric.global_rank, 4 * fabric.global_rank + 4)
    meta: dict[str, Any] = {}
    weights: dict[str, torch.Tensor] = {}
    for label, file in (("fabric", "fabric.ckpt"), ("plain", "plain.pt"), ("export", "export")):
        net = make_net(seed=0)
        model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01))
        # only Fabric's layout holds "step"; the others are weights alone
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, **({"step": 0} if label == "fabric" else {})}
        fabric.load(folder / file, state)
        meta[label] = {"step": state.get("step")}
        weights.update({f"{label}.loaded.{k}": v for k, v in weights_of(model).items()})
        fabric.backward(nn.functional.mse_loss(model(x[rows]), y[rows]), model=model)
        optimizer.step()
        optimizer.zero_grad()
        weights.update({f"{label}.stepped.{k}": v for k, v in weights_of(model).items()})
    net = make_net(seed=0)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(folder / "partial.ckpt", {"model": model}, strict=False)
    meta["partial_warnings"] = [str(w.message) for w in caught if "lightspeed" in str(w.message)]
    meta["partial_strict"] = error_of(lambda: fabric.load(folder / "partial.ckpt", {"model": model}))
    # strict (the default): a requested entry the file lacks is an error naming it, before anything is loaded
    meta["missing_key_strict"] = error_of(lambda: fabric.load(folder / "plain.pt", {"model": model, "step": 0}))
    meta["missing_key_lenient"] = error_of(
        lambda: fabric.load(folder / "plain.pt", {"model": model, "step": 0}, strict=False)
    )
    return meta, weights


# ----------------------------------------------------------------------------------------------- config optimizer
CONFIG_OPTIMIZER = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}}
CONFIG_SCHEDULER = {
    "type": "WarmupDecayLR",
    "params": {"warmup_min_lr": 0.0, "warmup_max_lr": "auto", "warmup_num_steps": 2, "total_num_steps": 6},
}


def scenario_config_opt(name: str, out: Path) -> tuple[dict, dict]:
    """The optimizer and scheduler of the DeepSpeed config (``lightspeed.fabric.config_optimizer()``), 6 steps."""
    config = {"optimizer": CONFIG_OPTIMIZER, "scheduler": CONFIG_SCHEDULER}
    fabric = make_fabric(name, strategy=lightspeed.fabric.ZeroFabricStrategy(stage=int(name[-1]), config=config))
    model, optimizer = fabric.setup(make_net(), lightspeed.fabric.config_optimizer())
    loader = fabric.setup_dataloaders(DataLoader(make_regression_data(), batch_size=4, shuffle=False))
    for step, (x, y) in enumerate(loader):
        if step == 6:
            break
        fabric.backward(nn.functional.mse_loss(model(x), y), model=model)
        optimizer.step()
        optimizer.zero_grad()
    engine = model._forward_module
    meta = {
        "lr": [group["lr"] for group in engine.optimizer.param_groups],
        "warmup_max_lr": fabric.strategy.config["scheduler"]["params"]["warmup_max_lr"],
        "global_steps": int(engine.global_steps),
    }
    return meta, weights_of(model)


# ----------------------------------------------------------------------------------------------- torch scheduler
TORCH_SCHEDULER_SGD = {"lr": 0.05, "momentum": 0.9}
TORCH_SCHEDULER_STEPLR = {"step_size": 2, "gamma": 0.5}


def scenario_torch_sched(name: str, out: Path) -> tuple[dict, dict]:
    """``StepLR(optimizer)`` on the ZeRO optimizer ``fabric.setup`` returned, stepped after every optimizer step;
    its state saved with the checkpoint after 3 steps and loaded back into a fresh ``StepLR``."""
    fabric = make_fabric(name)
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), **TORCH_SCHEDULER_SGD))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, **TORCH_SCHEDULER_STEPLR)
    loader = fabric.setup_dataloaders(DataLoader(make_regression_data(), batch_size=4, shuffle=False))
    lrs, ckpt = [], out / f"torch_sched_{name}"
    for step, (x, y) in enumerate(loader):
        if step == 6:
            break
        if step == 3:
            fabric.save(ckpt, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
        fabric.backward(nn.functional.mse_loss(model(x), y), model=model)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    weights = weights_of(model)
    restored = torch.optim.lr_scheduler.StepLR(optimizer, **TORCH_SCHEDULER_STEPLR)
    fabric.load(ckpt, {"model": model, "optimizer": optimizer, "scheduler": restored})
    meta = {
        "lrs": lrs,
        "restored_epoch": restored.last_epoch,
        "restored_lr": restored.get_last_lr(),
        "is_torch_optimizer": isinstance(optimizer, torch.optim.Optimizer),
        "repr": repr(optimizer.optimizer).split(" object at ")[0],
    }
    return meta, weights


# ----------------------------------------------------------------------------------------------- zero_auto tuning
def scenario_tune(name: str, out: Path) -> tuple[dict, dict]:
    """zero_auto's measured mode in a Fabric loop, and the chosen option without tuning: equal bit for bit."""
    import logging

    from lightspeed.fabric import ZeroAutoFabricStrategy, ZeroFabricStrategy

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    # lightning_utilities logs through the logger of whichever of Lightning's rank_zero modules was imported last
    loggers = [logging.getLogger(f"lightning.{part}.utilities.rank_zero") for part in ("fabric", "pytorch")]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)

    def mse(model: nn.Module, batch: Any) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    def train(strategy: Any) -> dict[str, torch.Tensor]:
        fabric = make_fabric(name, strategy=strategy)
        L.seed_everything(0, verbose=False)
        net = make_net()
        model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        loader = fabric.setup_dataloaders(DataLoader(make_regression_data(), batch_size=4, shuffle=True))
        for step, batch in enumerate(loader):
            if step == 4:
                break
            fabric.backward(mse(model, batch), model=model)
            optimizer.step()
            optimizer.zero_grad()
        return weights_of(model)

    tuned_strategy = ZeroAutoFabricStrategy(
        tune=True,
        tune_steps=1,
        tune_options=["zero1", "zero2"],
        tune_cache=out / "tune_cache.json",
        host_memory="20GB",
        tune_batches=DataLoader(make_regression_data(), batch_size=4),
        tune_loss=mse,
        tune_micro_batches=[1, 2],
    )
    tuned = train(tuned_strategy)
    for logger in loggers:
        logger.removeHandler(handler)
    chosen = tuned_strategy.chosen_option
    assert chosen is not None
    fixed = train(ZeroFabricStrategy(stage=chosen.stage))
    meta = {
        "chosen": chosen.name,
        "logs": [m for m in messages if "zero_auto: measured" in m],
        "micro_batch_report": [m for m in messages if "trained fastest" in m],
        "tuned_micro_batch": [tuned_strategy.tuned_micro_batch, tuned_strategy.tuned_accumulation],
    }
    return meta, {**{f"tuned.{k}": v for k, v in tuned.items()}, **{f"fixed.{k}": v for k, v in fixed.items()}}


SCENARIOS = {
    "config_opt": scenario_config_opt,
    "tune": scenario_tune,
    "torch_sched": scenario_torch_sched,
    "train": scenario_train,
    "accum": scenario_accum,
    "resume": scenario_resume,
    "errors": scenario_errors,
    "full": scenario_full,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("specs")
    parser.add_argument("--accelerator", default=PLACE["accelerator"])
    parser.add_argument("--devices", type=int, default=PLACE["devices"])
    parser.add_argument("--train-steps", type=int, default=PLACE["train_steps"])
    args = parser.parse_args()
    PLACE.update(accelerator=args.accelerator, devices=args.devices, train_steps=args.train_steps)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for spec in args.specs.split(","):
        kind, _, name = spec.partition(":")
        label = f"{kind}_{name}"
        try:
            meta, weights = SCENARIOS[kind](name, out)
        except Exception:
            meta, weights = {"crash": traceback.format_exc()}, None
            print(meta["crash"], file=sys.stderr)
        if torch.distributed.get_rank() == 0:
            (out / f"{label}.json").write_text(json.dumps(meta, indent=1, default=str))
            if weights is not None:
                torch.save(weights, out / f"{label}.pt")


if __name__ == "__main__":
    main()
