"""Several models trained together (a GAN; a student beside a frozen teacher): the models, data, losses and the
single-process references that the Trainer's and Fabric's several-model runs are compared with."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from _support.models import rank_batches

NOISE, FEATURES, HIDDEN = 4, 6, 8
EPOCHS, BATCH, BATCHES = 2, 4, 2  # GAN: epochs; batch size and batches per rank and epoch
DISTILL_SAMPLES, DISTILL_BATCH, DISTILL_WINDOW = 40, 4, 2  # 5 batches per rank, windows of 2 (the last one short)


def make_generator() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(NOISE, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, FEATURES))


def make_discriminator() -> nn.Module:
    torch.manual_seed(12)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def gan_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(13)
    n = BATCHES * BATCH * 2
    real = torch.randn(n, FEATURES, generator=generator) + 1.0
    return TensorDataset(real, torch.randn(n, NOISE, generator=generator))


def discriminator_loss(d: nn.Module, g: nn.Module, real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        fake = g(noise)
    return ((d(real) - 1) ** 2).mean() + (d(fake) ** 2).mean()


def generator_loss(d: nn.Module, g: nn.Module, noise: torch.Tensor) -> torch.Tensor:
    return ((d(g(noise)) - 1) ** 2).mean()


def gan_optimizers(g: nn.Module, d: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return torch.optim.Adam(g.parameters(), lr=1e-2), torch.optim.Adam(d.parameters(), lr=2e-2)


def gan_steps(epochs: int) -> list[list[list[int]]]:
    """Per step, each rank's sample indices, as the shuffled distributed sampler deals them (epoch by epoch)."""
    n = len(gan_data())
    return [ranks for epoch in range(epochs) for ranks in rank_batches(n, 2, BATCH, epoch=epoch)]


def gan_reference(epochs: int, generator_first: bool = False) -> dict[str, torch.Tensor]:
    """The GAN after ``epochs`` epochs in one process, each step on both ranks' batches at once: the discriminator's
    step first, or the generator's (as in Lightning's basic GAN example)."""
    g, d = make_generator(), make_discriminator()
    opt_g, opt_d = gan_optimizers(g, d)
    real, noise = gan_data().tensors
    for ranks in gan_steps(epochs):
        index = torch.tensor([i for rank in ranks for i in rank])
        for which in ("generator", "discriminator") if generator_first else ("discriminator", "generator"):
            if which == "discriminator":
                opt_d.zero_grad()
                discriminator_loss(d, g, real[index], noise[index]).backward()
                opt_d.step()
            else:
                d.requires_grad_(False)
                opt_g.zero_grad()
                generator_loss(d, g, noise[index]).backward()
                opt_g.step()
                d.requires_grad_(True)
    return {
        **{f"generator.{k}": v for k, v in g.state_dict().items()},
        **{f"discriminator.{k}": v for k, v in d.state_dict().items()},
    }


def make_teacher() -> nn.Module:
    torch.manual_seed(21)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 3))


def make_student() -> nn.Module:
    torch.manual_seed(22)
    return nn.Sequential(nn.Linear(FEATURES, 3))


def distill_data(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, FEATURES, generator=generator), torch.randint(0, 3, (n,), generator=generator))


def distill_train_data() -> TensorDataset:
    return distill_data(DISTILL_SAMPLES, 31)


def distill_val_data() -> TensorDataset:
    return distill_data(9, 32)  # 9 samples on 2 ranks: the distributed sampler pads one


def distill_loss(student: nn.Module, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        target = teacher(x).softmax(-1)
    return torch.nn.functional.cross_entropy(student(x), target)


def student_optimizer(student: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(student.parameters(), lr=0.5)


def distill_reference() -> tuple[dict[str, torch.Tensor], float]:
    """The student after one epoch of exact accumulation (windows of 2 micro-batches on both ranks, the last one
    short) in one process, and its accuracy on the validation data."""
    student, teacher = make_student(), make_teacher()
    optimizer = student_optimizer(student)
    x, _ = distill_train_data().tensors
    batches = rank_batches(len(x), 2, DISTILL_BATCH, epoch=0)
    for start in range(0, len(batches), DISTILL_WINDOW):
        index = torch.tensor([i for step in batches[start : start + DISTILL_WINDOW] for rank in step for i in rank])
        optimizer.zero_grad()
        distill_loss(student, teacher, x[index]).backward()
        optimizer.step()
    vx, vy = distill_val_data().tensors
    accuracy = (student(vx).argmax(-1) == vy).float().mean().item()
    return student.state_dict(), accuracy


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, tolerance: float = 1e-5) -> None:
    """Every tensor of ``got`` within ``tolerance`` of ``want`` (same keys)."""
    assert got.keys() == want.keys(), f"{what}: {sorted(got)} != {sorted(want)}"
    for key in want:
        diff = (got[key] - want[key]).abs().max().item()
        assert diff <= tolerance, f"{what} {key}: {diff:.3e} off the single-process run"
