"""A GAN under ZeRO with one engine per model: the generator and the discriminator in one LightningModule, each with
its own optimizer and ZeRO stage (``ZeroStrategy(models=...)``).

The data is a ring of 8 Gaussians in the plane, generated here. Manual optimization, the usual GAN step: the
discriminator learns real from generated points, then the generator learns to fool it while the discriminator is
frozen (``toggle_optimizer``). The generator trains under ZeRO-2, the discriminator under ZeRO-3 (its parameters
partitioned); ``ZeroExport`` writes each trained model to its own folder (``OUT/generator``, ``OUT/discriminator``),
which loads into a plain module without DeepSpeed. The script prints, before training and after every epoch, how far
generated points are from the ring (0: on it) and how many of the 8 modes they cover.

    python examples/gan.py                           # 2 CPU processes, about a minute
    python examples/gan.py --epochs 20 --devices 2
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed

NOISE, RADIUS, MODES, SPREAD = 8, 2.0, 8, 0.05


def ring(n: int, seed: int) -> torch.Tensor:
    """``n`` points from 8 Gaussians on a circle of radius 2."""
    generator = torch.Generator().manual_seed(seed)
    angle = torch.randint(0, MODES, (n,), generator=generator).float() * (2 * math.pi / MODES)
    centers = torch.stack([angle.cos(), angle.sin()], dim=1) * RADIUS
    return centers + SPREAD * torch.randn(n, 2, generator=generator)


def mlp(inputs: int, outputs: int, width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(inputs, width),
        nn.LeakyReLU(0.2),
        nn.Linear(width, width),
        nn.LeakyReLU(0.2),
        nn.Linear(width, outputs),
    )


def ring_distance(points: torch.Tensor) -> float:
    """Mean distance of ``points`` from the ring (0: every point on it)."""
    return float((points.norm(dim=1) - RADIUS).abs().mean())


def modes_covered(points: torch.Tensor) -> int:
    """How many of the 8 modes have at least 1 % of the points within 0.5 of their center."""
    angle = torch.arange(MODES).float() * (2 * math.pi / MODES)
    centers = torch.stack([angle.cos(), angle.sin()], dim=1) * RADIUS
    nearest = torch.cdist(points, centers)
    close = nearest.min(dim=1).values < 0.5
    counts = torch.bincount(nearest.argmin(dim=1)[close], minlength=MODES)
    return int((counts >= 0.01 * len(points)).sum())


class GAN(L.LightningModule):
    def __init__(self, width: int, lr: float) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lr = lr
        torch.manual_seed(0)
        self.generator = mlp(NOISE, 2, width)
        self.discriminator = mlp(2, 1, width)
        self.probe = torch.randn(2000, NOISE, generator=torch.Generator().manual_seed(1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        noise = torch.randn(len(real), NOISE, device=real.device)
        bce = nn.functional.binary_cross_entropy_with_logits
        with torch.no_grad():
            fake = self.generator(noise)
        real_logits, fake_logits = self.discriminator(real), self.discriminator(fake)
        d_loss = bce(real_logits, torch.ones_like(real_logits)) + bce(fake_logits, torch.zeros_like(fake_logits))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.toggle_optimizer(opt_g)  # the discriminator is frozen while the generator learns to fool it
        logits = self.discriminator(self.generator(noise))
        g_loss = bce(logits, torch.ones_like(logits))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)

    def configure_optimizers(self) -> Any:
        betas = (0.5, 0.999)
        return [
            torch.optim.Adam(self.generator.parameters(), lr=self.lr, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.lr, betas=betas),
        ]

    def on_train_epoch_end(self) -> None:
        report(f"epoch {self.current_epoch}", self.sample())

    def sample(self) -> torch.Tensor:
        with torch.no_grad():
            return self.generator(self.probe.to(self.device)).float().cpu()


@rank_zero_only
def report(when: str, points: torch.Tensor) -> None:
    print(f"{when}: distance from the ring {ring_distance(points):.3f}, modes covered {modes_covered(points)}/{MODES}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("out/gan"))
    args = parser.parse_args()

    module = GAN(args.width, args.lr)
    report("before training", module.sample())
    strategy = lightspeed.strategies.ZeroStrategy(stage=2, models={"generator": {}, "discriminator": {"stage": 3}})
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[lightspeed.callbacks.ZeroExport(args.out, overwrite=True)],
    )
    loader = DataLoader(TensorDataset(ring(args.samples, seed=2)), batch_size=args.batch_size, shuffle=True)
    trainer.fit(module, loader)
    if trainer.is_global_zero:
        generator = mlp(NOISE, 2, args.width)  # a plain module: the export needs no DeepSpeed to load
        lightspeed.export.load_exported(generator, args.out / "generator")
        with torch.no_grad():
            report("exported generator, reloaded", generator(module.probe))
        print(f"exported to {args.out}: {sorted(p.name for p in args.out.iterdir())}")


if __name__ == "__main__":
    main()
