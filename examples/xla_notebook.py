"""Train on every TPU core (or any PJRT device) from a notebook, with the model built once and never copied.

In a notebook the model usually lives in a cell of its own, outside the function that trains it. torch_xla's
``xmp.spawn`` sends its arguments to the worker processes through a process pool, which pickles them, so with
Lightning's own XLA strategy each worker receives a full copy of the model (and of the Trainer). lightspeed's
``xla_exact`` strategy forks the workers instead and lets them find the Trainer and the model in the parent's memory,
which ``fork`` shares copy-on-write: the CPU weights exist once, each worker moves them to its own device, and after
``fit`` the trained weights are loaded back into the very model object of the notebook.

The notebook recipe (three cells):

    # cell 1: build the model once, on the CPU
    model = build_model()

    # cell 2: everything that touches the XLA device happens inside fit
    def train(model): ...           # see `train` below: Trainer(accelerator="xla", strategy="xla_exact", ...)

    # cell 3
    train(model)                    # `model` now holds the trained weights

Rules that keep it working:

* Do not use the XLA device in the notebook process before training (no ``torch_xla.device()``, no
  ``model.to("xla")``): ``xmp.spawn`` refuses to fork once the XLA runtime runs in the parent.
* Build the model (and the data) on the CPU, outside the training function; pass the model in.
* Select the device with ``PJRT_DEVICE`` (TPU VMs set it themselves); ``devices="auto"`` uses them all.

Run it as a script:  ``PJRT_DEVICE=CPU python examples/xla_notebook.py``  (CPU), or on a TPU VM without the
variable. Needs torch_xla (``scripts/setup_xla.sh`` creates an environment with it).
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightspeed  # noqa: E402,F401  (registers accelerator="xla" and strategy="xla_exact")
from lightspeed.plugins import XLAPrecision  # noqa: E402


class Classifier(L.LightningModule):
    """A small MLP classifier."""

    def __init__(self, features: int = 16, classes: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def build_model() -> Classifier:
    """Cell 1: the model, built once on the CPU."""
    torch.manual_seed(0)
    return Classifier()


def make_loader(samples: int = 256, batch_size: int = 32) -> DataLoader:
    """Synthetic, learnable data (the label is the argmax of a fixed projection)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 16, generator=gen)
    y = (x @ torch.randn(16, 4, generator=gen)).argmax(dim=1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def train(
    model: L.LightningModule, precision: str = "bf16-mixed", epochs: int = 3, root: str = "lightning_logs/xla_notebook"
) -> L.Trainer:
    """Cell 2: fit ``model`` on all devices of the configured PJRT device; the trained weights land in ``model``."""
    trainer = L.Trainer(
        accelerator="xla",
        devices="auto",
        strategy="xla_exact",  # forks the workers: the model is shared with them, not pickled into each
        plugins=[XLAPrecision(precision)],
        max_epochs=epochs,
        accumulate_grad_batches=2,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, make_loader())
    return trainer


def accuracy(model: L.LightningModule) -> float:
    """Accuracy on the training data, computed on the CPU in the notebook process."""
    x, y = make_loader().dataset.tensors
    with torch.no_grad():
        return float((model(x.to(next(model.parameters()).dtype)).argmax(dim=1) == y).float().mean())


if __name__ == "__main__":
    model = build_model()
    before = accuracy(model)
    train(model)
    print(f"same model object trained in the workers: accuracy {before:.2f} -> {accuracy(model):.2f}")
