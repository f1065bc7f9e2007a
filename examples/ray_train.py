"""Ray Train with lightspeed: the tiny transformer LM of ``train_lm.py`` trained by a Lightning Trainer inside
``ray.train.torch.TorchTrainer`` under ZeRO, built as Ray's Lightning guide builds it (``RayLightningEnvironment``,
``RayTrainReportCallback``, ``prepare_trainer``) with ``lightspeed.ray.RayZeroStrategy``. Every worker reports its own
ZeRO shard at each epoch's end; a failed worker makes Ray restart the workers, which resume from the last checkpoint.
The checkpoint Ray keeps is exported to safetensors and reloaded into a plain model.

    pip install 'lightspeed[ray]'
    python examples/ray_train.py                            # 2 CPU workers (GPU workers where CUDA is present)
    python examples/ray_train.py --stage 2 --epochs 3 --out out/ray
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

import lightning as L
import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback, prepare_trainer
from ray.train.torch import TorchTrainer
from tiny_lm import CharWindows, generate_corpus
from torch import nn
from torch.utils.data import DataLoader
from train_lm import LanguageModel

from lightspeed.export import export_checkpoint, load_exported
from lightspeed.ray import RayZeroStrategy

CONTEXT = 64


def train_func(config: dict[str, Any]) -> None:
    """What every Ray worker runs: an ordinary Trainer, resumed from Ray's checkpoint after a restart."""
    L.seed_everything(0, verbose=False)
    train = CharWindows(generate_corpus(config["lines"], seed=1), CONTEXT)
    val = CharWindows(generate_corpus(config["lines"] // 10, seed=2), CONTEXT)
    trainer = L.Trainer(
        strategy=RayZeroStrategy(stage=config["stage"]),
        accelerator="auto",
        devices="auto",
        plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()],
        max_epochs=config["epochs"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer = prepare_trainer(trainer)
    loaders = DataLoader(train, batch_size=16, shuffle=True), DataLoader(val, batch_size=16)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.fit(LanguageModel(CONTEXT), *loaders)
    else:
        with checkpoint.as_directory() as directory:
            trainer.fit(LanguageModel(CONTEXT), *loaders, ckpt_path=os.path.join(directory, "checkpoint.ckpt"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lines", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=Path("out/ray"))
    args = parser.parse_args()
    out = args.out.resolve()

    # the workers import this folder's modules (tiny_lm, train_lm) as the script does
    ray.init(include_dashboard=False, runtime_env={"working_dir": str(Path(__file__).resolve().parent)})
    try:
        result = TorchTrainer(
            train_func,
            train_loop_config={"stage": args.stage, "epochs": args.epochs, "lines": args.lines},
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=torch.cuda.is_available()),
            run_config=RunConfig(storage_path=str(out), name="tiny_lm", failure_config=FailureConfig(max_failures=1)),
        ).fit()
    finally:
        ray.shutdown()
    assert result.checkpoint is not None
    print(f"Ray Train: {args.workers} workers, ZeRO-{args.stage}, last checkpoint {result.checkpoint.path}")

    export_dir = out / "export"
    export_checkpoint(Path(result.checkpoint.path) / "checkpoint.ckpt", export_dir, overwrite=True)
    model = LanguageModel(CONTEXT)
    load_exported(model, export_dir)
    model.eval()
    val = CharWindows(generate_corpus(args.lines // 10, seed=2), CONTEXT)
    ids, target = next(iter(DataLoader(val, batch_size=len(val))))
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten())
    print(
        f"export: {sorted(p.name for p in export_dir.iterdir())} reloaded into a plain model: validation perplexity "
        f"{math.exp(loss.item()):.3f} (uniform guess: {model.model.tokens.num_embeddings})"
    )


if __name__ == "__main__":
    main()
