"""Worker: several models in one Fabric loop, one ``fabric.setup`` (one engine) each, 2 CPU ranks, fp32.

* GAN: the generator under the strategy's ZeRO-2, the discriminator under ZeRO-3 through
  ``lightspeed.fabric.model_options``; 2 epochs uninterrupted; 1 epoch, ``fabric.save`` of both models, their
  optimizers and the step, then fresh models and optimizers loaded with ``fabric.load`` and trained the second epoch;
* teacher/student: the student under ZeRO-2 with ``lightspeed.fabric.accumulate`` (windows of 2, the last short), the
  frozen teacher set up alone (no optimizer) under ZeRO-3 with its parameters offloaded to the CPU; validation through
  ``lightspeed.gather_for_metrics`` on 9 samples split as a distributed sampler splits them (one padded); then
  ``fabric.save`` of the student, its optimizer and the frozen teacher, loaded into a fresh student.

Rank 0 writes OUT/result.pt.

usage: fabric_several_models.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

import lightspeed
from _support import several_models as sm
from _support.models import full_state_dict


def engine_module(model: Any) -> torch.nn.Module:
    return model._forward_module.module


def gan_setup(fabric: L.Fabric) -> tuple[Any, Any, Any, Any]:
    g = sm.make_generator()
    d = lightspeed.fabric.model_options(sm.make_discriminator(), stage=3)
    opt_g, opt_d = sm.gan_optimizers(g, d)
    g, opt_g = fabric.setup(g, opt_g)
    d, opt_d = fabric.setup(d, opt_d)
    return g, d, opt_g, opt_d


def gan_epochs(fabric: L.Fabric, g: Any, d: Any, opt_g: Any, opt_d: Any, epochs: range) -> None:
    real, noise = sm.gan_data().tensors
    steps = sm.gan_steps(epochs.stop)[epochs.start * sm.BATCHES :]
    for ranks in steps:
        index = torch.tensor(ranks[fabric.global_rank])
        r, z = real[index], noise[index]
        opt_d.zero_grad()
        fabric.backward(sm.discriminator_loss(d, g, r, z), model=d)
        opt_d.step()
        d.requires_grad_(False)
        opt_g.zero_grad()
        fabric.backward(sm.generator_loss(d, g, z), model=g)
        opt_g.step()
        d.requires_grad_(True)


def generator_first_gan(fabric: L.Fabric) -> dict[str, torch.Tensor]:
    """Both models under the strategy's ZeRO-2, the generator's step first, its loss through the frozen
    discriminator's engine."""
    g, d = sm.make_generator(), sm.make_discriminator()
    opt_g, opt_d = sm.gan_optimizers(g, d)
    g, opt_g = fabric.setup(g, opt_g)
    d, opt_d = fabric.setup(d, opt_d)
    real, noise = sm.gan_data().tensors
    for ranks in sm.gan_steps(sm.EPOCHS):
        index = torch.tensor(ranks[fabric.global_rank])
        d.requires_grad_(False)
        opt_g.zero_grad()
        fabric.backward(sm.generator_loss(d, g, noise[index]), model=g)
        opt_g.step()
        d.requires_grad_(True)
        opt_d.zero_grad()
        fabric.backward(sm.discriminator_loss(d, g, real[index], noise[index]), model=d)
        opt_d.step()
    return gan_weights(g, d)


def gan_weights(g: Any, d: Any) -> dict[str, torch.Tensor]:
    return {
        **{f"generator.{k}": v for k, v in full_state_dict(engine_module(g)).items()},
        **{f"discriminator.{k}": v for k, v in full_state_dict(engine_module(d)).items()},
    }


def gan_runs(fabric: L.Fabric, out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    g, d, opt_g, opt_d = gan_setup(fabric)
    gan_epochs(fabric, g, d, opt_g, opt_d, range(0, sm.EPOCHS))
    result["uninterrupted"] = gan_weights(g, d)

    g, d, opt_g, opt_d = gan_setup(fabric)
    gan_epochs(fabric, g, d, opt_g, opt_d, range(0, sm.EPOCHS // 2))
    state = {"generator": g, "discriminator": d, "opt_g": opt_g, "opt_d": opt_d, "epoch": 1}
    fabric.save(out / "gan.ckpt", state)
    result["half"] = gan_weights(g, d)

    g, d, opt_g, opt_d = gan_setup(fabric)
    state = {"generator": g, "discriminator": d, "opt_g": opt_g, "opt_d": opt_d, "epoch": 0}
    remainder = fabric.load(out / "gan.ckpt", state)
    result["loaded_epoch"] = state["epoch"]
    result["remainder"] = sorted(remainder)
    gan_epochs(fabric, g, d, opt_g, opt_d, range(state["epoch"], sm.EPOCHS))
    result["resumed"] = gan_weights(g, d)
    ckpt = out / "gan.ckpt"
    result["checkpoint_dirs"] = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    result["manifest"] = json.loads((ckpt / "lightspeed_complete.json").read_text())
    errors = {}
    try:
        fabric.setup(g.module if hasattr(g, "module") else g)
    except Exception as err:  # noqa: BLE001 - reported to the test
        errors["setup_twice"] = f"{type(err).__name__}: {err}"
    result["errors"] = errors
    result["generator_first"] = generator_first_gan(fabric)
    return result


def distill_run(fabric: L.Fabric, out: Path) -> dict[str, Any]:
    student = sm.make_student()
    teacher = lightspeed.fabric.model_options(sm.make_teacher(), stage=3, offload_parameters="cpu")
    teacher.requires_grad_(False)
    optimizer = sm.student_optimizer(student)
    student, optimizer = fabric.setup(student, optimizer)
    teacher = fabric.setup(teacher)
    sampler = DistributedSampler(sm.distill_train_data(), 2, fabric.global_rank, shuffle=True, seed=0)
    loader = DataLoader(sm.distill_train_data(), batch_size=sm.DISTILL_BATCH, sampler=sampler)
    for (xb, _), step in lightspeed.fabric.accumulate(fabric, student, loader, steps=sm.DISTILL_WINDOW):
        step.backward(sm.distill_loss(student, teacher, xb))
        if step.sync_gradients:
            optimizer.step()
            optimizer.zero_grad()
    val_sampler = DistributedSampler(sm.distill_val_data(), 2, fabric.global_rank, shuffle=False)
    val = DataLoader(sm.distill_val_data(), batch_size=2, sampler=val_sampler)
    preds, targets = [], []
    with torch.no_grad():
        for vx, vy in lightspeed.track(val):
            p, t = lightspeed.gather_for_metrics((student(vx).argmax(-1), vy), dataloader=val)
            preds.append(p)
            targets.append(t)
    accuracy = (torch.cat(preds) == torch.cat(targets)).float().mean().item()
    # the frozen teacher in the saved state is listed, not written; a fresh student loads the trained one
    fabric.save(out / "distill.ckpt", {"student": student, "teacher": teacher, "optimizer": optimizer})
    fresh = sm.make_student()
    fresh, fresh_optimizer = fabric.setup(fresh, sm.student_optimizer(fresh))
    foreign = "no error"
    try:  # an optimizer over another model's parameters
        fabric.setup(sm.make_student(), sm.student_optimizer(sm.make_student()))
    except Exception as err:  # noqa: BLE001 - reported to the test
        foreign = f"{type(err).__name__}: {err}"
    fabric.load(out / "distill.ckpt", {"student": fresh, "teacher": teacher, "optimizer": fresh_optimizer})
    ckpt = out / "distill.ckpt"
    return {
        "student": full_state_dict(engine_module(student)),
        "teacher": full_state_dict(engine_module(teacher)),
        "loaded_student": full_state_dict(engine_module(fresh)),
        "foreign_optimizer": foreign,
        "acc": accuracy,
        "count": int(torch.cat(preds).numel()),
        "checkpoint_dirs": sorted(p.name for p in ckpt.iterdir() if p.is_dir()),
        "manifest": json.loads((ckpt / "lightspeed_complete.json").read_text()),
    }


def main(out: Path) -> None:
    fabric = L.Fabric(strategy=lightspeed.fabric.ZeroFabricStrategy(stage=2), accelerator="cpu", devices=2)
    fabric.launch()
    result = {"gan": gan_runs(fabric, out), "distill": distill_run(fabric, out)}
    if fabric.global_rank == 0:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
