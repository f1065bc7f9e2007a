"""The main job: train a small transformer language model with a lightspeed ZeRO strategy, evaluate it with exact
distributed metrics, export the weights to safetensors and reload them into a fresh model.

Runs on 2 CPU processes with ``zero3_offload`` by default, on 2 GPUs when CUDA is present (``--devices N`` for
another count, ``--devices 0`` for all of them). The training text is generated here (a small grammar of arithmetic
facts and sentences), so nothing is downloaded.

    python examples/train_lm.py                     # defaults: zero3_offload, 2 CPU processes
    python examples/train_lm.py --strategy zero2 --devices 2 --epochs 3 --out out/
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from tiny_lm import ALPHABET, CharWindows, TinyGPT, generate_corpus
from torch import nn
from torch.utils.data import DataLoader

import lightspeed
from lightspeed.callbacks import GatherForMetrics, ZeroExport


class LanguageModel(L.LightningModule):
    """An ordinary LightningModule: nothing in it knows about ZeRO, offload or the number of processes."""

    def __init__(self, context: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyGPT(len(ALPHABET), context)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)

    def training_step(self, batch, batch_idx):
        ids, target = batch
        logits = self(ids)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, target = batch
        logits = self(ids)
        return {"preds": logits.float(), "target": target}

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class NextTokenAccuracy(torchmetrics.classification.MulticlassAccuracy):
    """Accuracy over every (position, next token) pair of (B, T, V) logits."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(preds.flatten(0, 1), target.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="zero3_offload")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--lines", type=int, default=6000)
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args()
    if args.accelerator == "cuda":
        args.devices = min(args.devices, torch.cuda.device_count()) if args.devices > 0 else torch.cuda.device_count()

    L.seed_everything(0, verbose=False)
    context = 64
    train = CharWindows(generate_corpus(args.lines, seed=1), context)
    val = CharWindows(generate_corpus(args.lines // 10, seed=2), context)  # length not a multiple of the ranks

    vocab = len(ALPHABET)
    metrics = GatherForMetrics(
        {
            "next_token_accuracy": NextTokenAccuracy(num_classes=vocab, average="micro"),
            "perplexity": torchmetrics.text.Perplexity(),
        }
    )
    export_dir = args.out / "export"
    trainer = L.Trainer(
        strategy=args.strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        precision="bf16-mixed" if args.accelerator == "cuda" else "32-true",
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0,
        default_root_dir=args.out,
        logger=False,
        enable_checkpointing=False,
        callbacks=[metrics, ZeroExport(export_dir, overwrite=True)],
    )
    model = LanguageModel(context)
    trainer.fit(
        model,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=args.batch_size),
    )
    results = {k: float(v) for k, v in trainer.callback_metrics.items()}

    if trainer.is_global_zero:
        print(
            f"\nvalidation over all {len(val)} windows (no duplicates): "
            f"next-token accuracy {results['val/next_token_accuracy']:.4f}, "
            f"perplexity {results['val/perplexity']:.3f} (uniform guess: {vocab})"
        )
        fresh = LanguageModel(context)
        lightspeed.export.load_exported(fresh, export_dir)
        fresh.eval()
        ids, target = next(iter(DataLoader(val, batch_size=len(val))))
        with torch.no_grad():
            logits = fresh(ids)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        reloaded_ppl = math.exp(loss.item())
        match = math.isclose(reloaded_ppl, results["val/perplexity"], rel_tol=2e-3)
        print(
            f"export: {sorted(p.name for p in export_dir.iterdir())} -> reloaded into a fresh model without "
            f"DeepSpeed: perplexity {reloaded_ppl:.3f} -> {'matches' if match else 'DOES NOT MATCH'} the "
            "distributed evaluation"
        )
        if not match:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
