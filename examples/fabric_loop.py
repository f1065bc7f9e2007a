"""A hand-written Lightning Fabric loop with lightspeed (the Accelerate quick-tour shape): ZeRO on the CPU or on
GPUs, exact gradient accumulation weighted by tokens, exact distributed metrics, crash-safe checkpoints, resume and
export to safetensors.

    python examples/fabric_loop.py                          # zero2, 2 CPU processes, bf16-mixed
    python examples/fabric_loop.py --strategy zero3_offload --epochs 2 --out out/fabric

Accelerate -> Fabric + lightspeed: ``accelerator.prepare`` -> ``fabric.setup`` / ``fabric.setup_dataloaders``,
``with accelerator.accumulate(model)`` -> ``for batch, step in lightspeed.fabric.accumulate(...)``,
``accelerator.backward(loss)`` -> ``step.backward(loss)``, ``accelerator.gather_for_metrics`` ->
``lightspeed.gather_for_metrics``, ``accelerator.save_state`` -> ``fabric.save``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import lightning as L
import torch
from tiny_lm import ALPHABET, CharWindows, TinyGPT, generate_corpus
from torch import nn
from torch.utils.data import DataLoader

import lightspeed
from lightspeed.export import export_checkpoint, load_exported


def evaluate(fabric: L.Fabric, model: nn.Module, loader: DataLoader) -> float:
    """Perplexity over exactly the validation set: the sampler's padded duplicates are dropped by the gather."""
    model.eval()
    losses = []
    with torch.no_grad():
        for ids, target in lightspeed.track(loader):
            logits = model(ids).float()
            per_sample = nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none").mean(1)
            losses.append(lightspeed.gather_for_metrics(per_sample, dataloader=loader))
    model.train()
    return math.exp(torch.cat(losses).mean().item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero2")
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("out/fabric_loop"))
    args = parser.parse_args()

    fabric = L.Fabric(
        strategy=args.strategy, accelerator=args.accelerator, devices=args.devices, precision=args.precision
    )
    fabric.launch()
    fabric.seed_everything(0)

    text = generate_corpus(2000, seed=0)
    split = int(len(text) * 0.9)
    train = DataLoader(CharWindows(text[:split], args.context), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(CharWindows(text[split:], args.context), batch_size=args.batch_size)
    train, val = fabric.setup_dataloaders(train, val)

    # A model too big for one process: build it under `with fabric.init_module():` and ZeRO-3 creates each rank's
    # shard only (nn.TransformerEncoder, used here, deep-copies its layer: the copies are partitioned too).
    with fabric.init_module():
        model = TinyGPT(len(ALPHABET), args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)  # CPU Adam under offload
    model, optimizer = fabric.setup(model, optimizer)

    ckpt = args.out / "last.ckpt"
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    resume = lightspeed.fabric.last_checkpoint(fabric, args.out)  # the newest complete checkpoint; None: fresh start
    if resume is not None:
        fabric.load(resume, state)  # resume: weights, optimizer state and "epoch" (checked first)
        fabric.print(f"resumed from {resume} after epoch {state['epoch']}")

    for epoch in range(state["epoch"], args.epochs):
        for (ids, target), step in lightspeed.fabric.accumulate(fabric, model, train, steps=args.accumulate):
            logits = model(ids)
            loss_sum = nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="sum")
            step.backward(loss_sum, num_items=target.numel())  # mean over every token of the window, all ranks
            if step.sync_gradients:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
        state["epoch"] = epoch + 1
        fabric.print(f"epoch {epoch}: validation perplexity {evaluate(fabric, model, val):.3f}")
        fabric.save(ckpt, state)  # staged, committed only when every rank has written its shard

    if fabric.is_global_zero:
        result = export_checkpoint(ckpt, args.out / "export", overwrite=True)
        fresh = TinyGPT(len(ALPHABET), args.context)
        load_exported(fresh, args.out / "export")
        print(f"exported {result.num_tensors} tensors to {result.output_dir}; reloaded into a plain TinyGPT")
    fabric.barrier()


if __name__ == "__main__":
    main()
