"""Worker: resuming Trainer runs with something on NVMe (2 CPU ranks, one process each).

usage: zero_nvme_resume.py OUT   (LIGHTSPEED_NVME_PATH set by the test)

The model has one layer whose partition the optimizer swapper keeps on NVMe (1024 x 1024: 2 MiB per rank, above its
1 MiB minimum) and small ones it keeps in memory; AdamW with a per-step learning-rate schedule. In order:

* ``first``: zero3_nvme, SAVE_AT steps saving OUT/ck/nvme.ckpt;
* ``full``: zero3_nvme, STEPS steps uninterrupted; its engine (it has stepped, its states are registered with the
  swapper) then loads OUT/ck/nvme.ckpt with ``engine.load_checkpoint`` (what node-local and several-model resumes
  call) and saves it again as OUT/ck/direct.ckpt;
* ``resumed``: a new Trainer resumes OUT/ck/nvme.ckpt to STEPS; ``engine_direct``: another one OUT/ck/direct.ckpt;
* ``params_on_nvme``: the parameters on NVMe and the optimizer on the CPU, SAVE_AT steps saving OUT/ck/params.ckpt,
  then resumed to STEPS by a new Trainer;
* the refusals: a zero3_offload run resuming the NVMe checkpoint, zero3_nvme resuming a zero3_offload checkpoint
  (OUT/ck/offload.ckpt), a copy without lightspeed's marker whose swap file of rank 1 is cut short
  (OUT/ck/short.ckpt), a copy whose marker says 4 processes wrote it (OUT/ck/four.ckpt).

Rank 0 writes OUT/weights.pt (each run's final weights, gathered, and ``plain``: the same STEPS steps of plain
torch AdamW in this one process on the global batches); every rank OUT/errors_<rank>.json (what each refused resume
raised).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import rank_batches
from _support.outcomes import error_text
from _support.trainers import quiet_trainer
from lightspeed.core.reliability.staging import COMPLETE_MARKER
from lightspeed.strategies import ZeroStrategy

STEPS, SAVE_AT, BATCH, WORLD, WIDTH = 6, 3, 4, 2, 1024


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 16, generator=generator), torch.randn(64, 4, generator=generator))


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def schedule(step: int) -> float:
    return 1.0 / (1 + step)


def make_optimizer(parameters: Any) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW(parameters, lr=1e-3, eps=1e-3)  # eps: reduction-order noise cannot flip updates
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        optimizer, scheduler = make_optimizer(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(strategy: Any, steps: int, save: Path | None = None, ckpt_path: Path | None = None) -> tuple[L.Trainer, Any]:
    """A fit of ``steps`` steps (``save``: a checkpoint there at the last one); returns the Trainer and weights."""
    callbacks = [ModelCheckpoint(save.parent, filename=save.stem, every_n_train_steps=steps)] if save else []
    trainer = quiet_trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=steps, callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
    )  # fmt: skip
    module = Regressor()
    trainer.fit(module, DataLoader(data(), batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer, gathered(module)


def gathered(module: L.LightningModule) -> dict[str, torch.Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {key: value.detach().clone() for key, value in module.state_dict().items()}


def plain_reference() -> dict[str, torch.Tensor]:
    """The same training in this process alone: torch's AdamW on each step's global batch (the ranks' micro-batches
    together, as Lightning's distributed sampler hands them out)."""
    net = make_net()
    optimizer, scheduler = make_optimizer(net.parameters())
    x, y = data().tensors
    for step in rank_batches(len(x), WORLD, BATCH, epoch=0)[:STEPS]:
        batch = torch.tensor([index for indices in step for index in indices])
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x[batch]), y[batch]).backward()
        optimizer.step()
        scheduler.step()
    return {f"net.{key}": value.detach().clone() for key, value in net.state_dict().items()}


def shortened(source: Path, target: Path, rank: int) -> Path:
    """A copy of ``source`` whose swap file of rank 1's exp_avg is one block short, without lightspeed's completion
    marker (whose record of the file sizes would refuse it first): a plain DeepSpeed checkpoint (rank 0 writes it)."""
    if rank == 0:
        shutil.copytree(source, target)
        (target / COMPLETE_MARKER).unlink()
        (file,) = (target / "checkpoint" / "offloaded_tensors" / "rank01").glob("exp_avg-*.tensor.swp")
        with file.open("r+b") as handle:
            handle.truncate(file.stat().st_size - 4096)
    torch.distributed.barrier()
    return target


def said_four_processes(source: Path, target: Path, rank: int) -> Path:
    """A copy of ``source`` whose completion marker says 4 processes wrote it (rank 0 writes it)."""
    if rank == 0:
        shutil.copytree(source, target)
        marker = target / COMPLETE_MARKER
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "world_size": 4}))
    torch.distributed.barrier()
    return target


def main(out: Path) -> None:
    ck = out / "ck"
    weights: dict[str, Any] = {}
    first, _ = fit("zero3_nvme", SAVE_AT, save=ck / "nvme.ckpt")
    rank = first.global_rank
    full, weights["full"] = fit("zero3_nvme", STEPS)
    engine = full.strategy.deepspeed_engine  # the last run's: not released until the next run builds its own
    _, client_state = engine.load_checkpoint(str(ck / "nvme.ckpt"), tag="checkpoint")
    client_state.pop("checkpoint_parallel_dimensions")  # DeepSpeed's own, which it returns with the client's
    engine.save_checkpoint(str(ck / "direct.ckpt"), client_state=client_state, tag="checkpoint")
    _, weights["resumed"] = fit("zero3_nvme", STEPS, ckpt_path=ck / "nvme.ckpt")
    _, weights["engine_direct"] = fit("zero3_nvme", STEPS, ckpt_path=ck / "direct.ckpt")
    params_on_nvme = {"stage": 3, "offload_optimizer": "cpu", "offload_parameters": "nvme"}
    fit(ZeroStrategy(**params_on_nvme), SAVE_AT, save=ck / "params.ckpt")
    _, weights["params_on_nvme"] = fit(ZeroStrategy(**params_on_nvme), STEPS, ckpt_path=ck / "params.ckpt")
    fit("zero3_offload", SAVE_AT, save=ck / "offload.ckpt")
    resumes = {
        "nvme_into_offload": ("zero3_offload", ck / "nvme.ckpt"),
        "offload_into_nvme": ("zero3_nvme", ck / "offload.ckpt"),
        "short_swap_file": ("zero3_nvme", shortened(ck / "nvme.ckpt", ck / "short.ckpt", rank)),
        "four_processes": ("zero3_nvme", said_four_processes(ck / "nvme.ckpt", ck / "four.ckpt", rank)),
    }
    errors = {
        name: error_text(lambda strategy=strategy, path=path: fit(strategy, STEPS, ckpt_path=path))
        for name, (strategy, path) in resumes.items()
    }
    (out / f"errors_{rank}.json").write_text(json.dumps(errors))
    if rank == 0:
        torch.save({**weights, "plain": plain_reference()}, out / "weights.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
