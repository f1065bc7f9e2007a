"""Entry point of examples/slurm/train.sbatch: one process per task started by ``srun``.

Lightning detects SLURM from the environment srun gives each task (SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID,
SLURM_NODEID, SLURM_JOB_NODELIST, ...): no launcher runs, every task is one rank. ``--nodes`` and
``--ntasks-per-node`` of the batch script must equal ``--num-nodes`` and ``--devices`` here (lightspeed refuses a
mismatch before training).

    srun python examples/slurm/train.py --num-nodes 2 --devices 8 --strategy zero3_offload
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed  # noqa: F401  (registers the zero*/ddp_exact strategies)
from lightspeed.callbacks import ZeroExport
from lightspeed.strategies.zero import ZeroStrategy


class Regression(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-nodes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--accelerator", default="cuda")
    parser.add_argument("--strategy", default="zero3_offload")
    parser.add_argument("--node-local-checkpoints", action="store_true", help="nodes share no filesystem")
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4096, help="size of the generated dataset")
    args = parser.parse_args()

    L.seed_everything(0)
    strategy = (
        ZeroStrategy(stage=3, offload_optimizer="cpu", node_local_storage=True)
        if args.node_local_checkpoints
        else args.strategy
    )
    data = TensorDataset(torch.randn(args.samples, args.width), torch.randn(args.samples, args.width))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_epochs=args.epochs,
        callbacks=[ModelCheckpoint(args.checkpoint_dir, save_last=True), ZeroExport("export")],
    )
    trainer.fit(Regression(args.width), DataLoader(data, batch_size=32))


if __name__ == "__main__":
    main()
