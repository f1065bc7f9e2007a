"""Worker: several models with their parameters on NVMe in one process (2 CPU ranks).

usage: nvme_models.py OUT   (LIGHTSPEED_NVME_PATH set by the test)

* Fabric, for ``zero3_nvme`` and ``zero3_offload``: model A is set up and runs a forward, model B is set up (a
  second parameter swapper), A runs the same forward again, then A and B take STEPS steps in turn; the final
  weights of both.
* The Trainer under ``zero3_nvme``: a fit, the swap files its engine holds (its optimizer swapper's and its
  parameters'), then a second Trainer's fit, which releases the first engine: how many of them remain then, and
  once the first run's Trainer and model are freed; how many the second engine holds; then a third Trainer fits
  the second run's model again (what it raised, if anything).

Rank 0 writes OUT/result.pt.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import full_state_dict
from _support.outcomes import error_text
from _support.trainers import quiet_trainer

STEPS, WIDTH = 2, 1024  # a 1024 x 1024 partition per rank is 2 MiB: swapped (DeepSpeed's minimum is 1 MiB)


def make_net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 16, generator=generator), torch.randn(4, 4, generator=generator)


def fabric_models(strategy: str) -> dict[str, Any]:
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()

    def build(seed: int) -> tuple[Any, Any]:
        with fabric.init_module():
            net = make_net(seed)
        return fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))

    (a, a_optimizer), x = build(0), batch(0, fabric.global_rank)[0]
    before = a(x).detach().clone()
    b, b_optimizer = build(1)
    after = a(x).detach().clone()
    for step in range(STEPS):
        for model, optimizer in ((a, a_optimizer), (b, b_optimizer)):
            x, y = batch(step, fabric.global_rank)
            fabric.backward(nn.functional.mse_loss(model(x), y), model=model)
            optimizer.step()
            optimizer.zero_grad()
    return {"same_forward": torch.equal(before, after), "a": full_state_dict(a), "b": full_state_dict(b)}


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net(0)

    def training_step(self, data: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(data[0]), data[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def swap_files(engine: Any) -> dict[str, list[str]]:
    """The files ``engine`` keeps on NVMe: its optimizer swapper's and its parameters'."""
    swapper = engine.optimizer.optimizer_swapper
    optimizer = [path for info in swapper.swap_params_info.values() for path in info.get_swap_paths()]
    parameters = []
    for parameter in engine.module.parameters():
        own = getattr(getattr(parameter, "nvme_swapper", None), "id_to_path", {})
        parameters += [own[parameter.ds_id]] if parameter.ds_id in own else []
    return {"optimizer": sorted(optimizer), "parameters": sorted(parameters)}


def on_disk(files: dict[str, list[str]]) -> dict[str, int]:
    return {kind: sum(os.path.exists(path) for path in paths) for kind, paths in files.items()}


def trainer_fit(module: L.LightningModule | None = None) -> L.Trainer:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 16, generator=generator), torch.randn(32, 4, generator=generator))
    trainer = quiet_trainer(strategy="zero3_nvme", accelerator="cpu", devices=2, max_steps=STEPS)
    trainer.fit(module or Regressor(), DataLoader(data, batch_size=4))
    return trainer


def main(out: Path) -> None:
    result: dict[str, Any] = {name: fabric_models(name) for name in ("zero3_nvme", "zero3_offload")}
    first = trainer_fit()
    files = swap_files(first.strategy._train_engine)
    result["first_files"] = {kind: len(paths) for kind, paths in files.items()}
    result["first_on_disk"] = on_disk(files)
    second = trainer_fit()  # releases the first run's engine; its model is still held here
    result["first_on_disk_after_release"] = on_disk(files)
    del first
    gc.collect()
    result["first_on_disk_once_freed"] = on_disk(files)
    result["second_on_disk"] = on_disk(swap_files(second.strategy._train_engine))
    # the second run's model trained again by a new Trainer (its parameters' files must still be there)
    result["same_model_again"] = error_text(lambda: trainer_fit(second.lightning_module))
    if second.global_rank == 0:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
