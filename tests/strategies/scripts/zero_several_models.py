"""Worker: several models in one LightningModule, one engine each (``ZeroStrategy(models=...)``), 2 CPU ranks, fp32.

* GAN, manual optimization, two optimizers, the generator under ZeRO-2 and the discriminator under ZeRO-3: 2 epochs
  of 2 batches uninterrupted (with ``ZeroExport``), and 1 epoch, a checkpoint, then resumed to 2 from it; the
  generator-first GAN with ``models=`` and under the plain names ``zero2`` and ``zero3`` (models inferred);
* teacher/student, automatic optimization: the student under ZeRO-2 with ``accumulate_grad_batches=2`` over 5
  batches per rank (a short last window), the frozen teacher under ZeRO-3 with its parameters offloaded to the CPU,
  validation through ``GatherForMetrics`` on 9 samples (the sampler pads one); then ``validate`` of a fresh module
  from the checkpoint.

Rank 0 writes OUT/result.pt: the weights of each run (gathered), the metric, and what the checkpoint holds.

usage: zero_several_models.py OUT
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightspeed
from _support import several_models as sm
from _support.models import full_state_dict
from _support.trainers import quiet_trainer

GAN_MODELS = {"generator": {"stage": 2}, "discriminator": {"stage": 3}}


class GAN(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = sm.make_generator()
        self.discriminator = sm.make_discriminator()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, noise = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        d_loss = sm.discriminator_loss(self.discriminator, self.generator, real, noise)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.toggle_optimizer(opt_g)  # the discriminator is frozen for the generator's loss
        g_loss = sm.generator_loss(self.discriminator, self.generator, noise)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

    def configure_optimizers(self) -> Any:
        return list(sm.gan_optimizers(self.generator, self.discriminator))


class GeneratorFirstGAN(GAN):
    """Lightning's basic GAN example: the generator's step first, each step between toggle and untoggle."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, noise = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        self.toggle_optimizer(opt_g)  # the discriminator's parameters are off while its forward is in the loss
        g_loss = sm.generator_loss(self.discriminator, self.generator, noise)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = sm.discriminator_loss(self.discriminator, self.generator, real, noise)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)


def trainer(max_epochs: int, callbacks: list[Any] | None = None, models: Any = GAN_MODELS) -> L.Trainer:
    return quiet_trainer(
        strategy=lightspeed.strategies.ZeroStrategy(stage=2, models=models),
        accelerator="cpu",
        devices=2,
        max_epochs=max_epochs,
        callbacks=callbacks,
    )


def gan_runs(out: Path) -> dict[str, Any]:
    loader = DataLoader(sm.gan_data(), batch_size=sm.BATCH, shuffle=True)
    result: dict[str, Any] = {}
    module = GAN()
    trainer(sm.EPOCHS, callbacks=[lightspeed.callbacks.ZeroExport(out / "export")]).fit(module, loader)
    result["uninterrupted"] = full_state_dict(module)
    module = GAN()
    first = trainer(sm.EPOCHS // 2)
    first.fit(module, loader)
    first.save_checkpoint(out / "gan.ckpt")
    result["half"] = full_state_dict(module)
    module = GAN()
    trainer(sm.EPOCHS).fit(module, loader, ckpt_path=out / "gan.ckpt")
    result["resumed"] = full_state_dict(module)
    ckpt = out / "gan.ckpt"
    result["checkpoint_dirs"] = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    result["manifest"] = json.loads((ckpt / "lightspeed_complete.json").read_text())
    module = GeneratorFirstGAN()  # both models under ZeRO-2, named in a list
    trainer(sm.EPOCHS, models=["generator", "discriminator"]).fit(module, loader)
    result["generator_first"] = full_state_dict(module)
    for name in ("zero2", "zero3"):  # plain names: the models are inferred from the two optimizers
        module, lines = GeneratorFirstGAN(), LinesLogged("lightspeed: `configure_optimizers` returned")
        quiet_trainer(strategy=name, accelerator="cpu", devices=2, max_epochs=sm.EPOCHS).fit(module, loader)
        result[f"inferred_{name}"] = full_state_dict(module)
        result[f"inferred_{name}_log"] = lines.close()
    return result


class LinesLogged(logging.Handler):
    """The lines Lightning's rank-zero logger writes that start with ``prefix``, until :meth:`close`."""

    def __init__(self, prefix: str) -> None:
        super().__init__(logging.INFO)
        self.prefix, self.lines = prefix, []
        self.logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.prefix):
            self.lines.append(record.getMessage())

    def close(self) -> list[str]:  # type: ignore[override]
        self.logger.removeHandler(self)
        return self.lines


class Distill(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.student = sm.make_student()
        self.teacher = sm.make_teacher()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return sm.distill_loss(self.student, self.teacher, x)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"preds": self.student(x).argmax(-1), "target": y}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return sm.student_optimizer(self.student)


def distill_trainer(**kwargs: Any) -> L.Trainer:
    import torchmetrics

    gather = lightspeed.callbacks.GatherForMetrics(
        {"acc": torchmetrics.classification.MulticlassAccuracy(3, average="micro")}
    )
    return quiet_trainer(
        strategy=lightspeed.strategies.ZeroStrategy(
            stage=2, models={"student": {}, "teacher": {"stage": 3, "offload_parameters": "cpu"}}
        ),
        accelerator="cpu",
        devices=2,
        callbacks=[gather],
        **kwargs,
    )


def distill_run(out: Path) -> dict[str, Any]:
    module = Distill()
    run = distill_trainer(max_epochs=1, accumulate_grad_batches=sm.DISTILL_WINDOW)
    train = DataLoader(sm.distill_train_data(), batch_size=sm.DISTILL_BATCH, shuffle=True)
    val = DataLoader(sm.distill_val_data(), batch_size=2)
    run.fit(module, train, val)
    run.save_checkpoint(out / "distill.ckpt")
    result = {
        "student": full_state_dict(module.student),
        "teacher": full_state_dict(module.teacher),
        "acc": float(run.callback_metrics["val/acc"]),
        "teacher_requires_grad": any(p.requires_grad for p in module.teacher.parameters()),
    }
    evaluation = distill_trainer()  # a fresh module evaluated from the checkpoint (the teacher is rebuilt)
    evaluation.validate(Distill(), val, ckpt_path=out / "distill.ckpt")
    result["acc_from_checkpoint"] = float(evaluation.callback_metrics["val/acc"])
    return result


def main(out: Path) -> None:
    result = {"gan": gan_runs(out), "distill": distill_run(out)}
    if torch.distributed.get_rank() == 0:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
