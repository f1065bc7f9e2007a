"""Fine-tune a pretrained HuggingFace causal LM under ZeRO-3 with CPU offload, generate from it while it is
partitioned, export it to safetensors and load the export back with ``from_pretrained``.

Step 1 stands in for downloading a checkpoint: a small GPT-2 with a character-level tokenizer is trained for a few
steps on plain sentences and written with ``save_pretrained`` (sharded safetensors with an index). Step 2 fine-tunes
it on arithmetic ("12+30=42.") with ``strategy="zero3_offload"`` on 2 CPU processes: ``configure_model`` calls
``AutoModelForCausalLM.from_pretrained``, which lightspeed builds straight into the ZeRO-3 partitions;
``validation_step`` generates a few continuations with ``self.model.generate(...)`` (no ``synced_gpus``: the ranks'
prompts end at different steps and lightspeed keeps them in step) and the perplexity is exact over the validation set
(``GatherForMetrics``). ``ZeroExport`` writes the fine-tuned weights and ``config.json``; step 3 reloads them with
``AutoModelForCausalLM.from_pretrained`` in one plain process and generates again.

    python examples/finetune_pretrained.py                        # zero3_offload, 2 CPU processes
    python examples/finetune_pretrained.py --epochs 4 --out out/finetune
    python examples/finetune_pretrained.py --pretrain-steps 20 --lines 400 --epochs 1 --width 32   # seconds
"""

from __future__ import annotations

import argparse
import math
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.utilities import rank_zero_only
from tiny_hf import EOS, TokenWindows, char_tokenizer, perplexity, write_pretrained
from tiny_lm import generate_corpus
from torch import nn
from torch.utils.data import DataLoader

import lightspeed
from lightspeed.callbacks import GatherForMetrics, ZeroExport

PROMPTS = ["12+30=", "7+5=", "the robot ", "41+8=", "a bird ", "3+3="]


def prompts_of(rank: int, world_size: int) -> list[str]:
    """This rank's share of ``PROMPTS`` (the same number on every rank: each rank calls ``generate`` once)."""
    per_rank = math.ceil(len(PROMPTS) / world_size)
    return [PROMPTS[(rank + k * world_size) % len(PROMPTS)] for k in range(per_rank)]


def complete(model: Any, tokenizer: Any, prompts: list[str], new_tokens: int) -> list[str]:
    """Greedy continuations of ``prompts`` up to the end of the line, in one batched ``generate`` call."""
    batch = tokenizer(prompts, padding=True, return_tensors="pt").to(model.device)
    out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False)
    return [text.split(EOS)[0] for text in tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :])]


class FineTune(L.LightningModule):
    def __init__(self, pretrained: str, lr: float = 3e-3, new_tokens: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.samples: list[tuple[str, str]] = []

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if hasattr(self, "model"):
            return
        # under ZeRO-3 each rank builds and loads only its partition of every weight
        self.model = AutoModelForCausalLM.from_pretrained(self.hparams.pretrained)
        self.model.train()  # from_pretrained returns the model in eval mode
        self.tokenizer = AutoTokenizer.from_pretrained(self.hparams.pretrained)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, target = batch
        logits = self.model(ids, attention_mask=torch.ones_like(ids)).logits  # no padding ("\n" is the pad token)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        if batch_idx == 0:  # every rank has a batch 0 (the distributed sampler gives each rank as many batches)
            prompts = prompts_of(self.global_rank, self.trainer.world_size)
            continuations = complete(self.model, self.tokenizer, prompts, self.hparams.new_tokens)
            mine = list(zip(prompts, continuations, strict=True))
            self.samples = [pair for rank_pairs in lightspeed.gather_object(mine) for pair in rank_pairs]
        ids, target = batch
        logits = self.model(ids, attention_mask=torch.ones_like(ids)).logits
        return {"preds": logits.float(), "target": target}  # read by GatherForMetrics

    def on_validation_epoch_end(self) -> None:
        if self.trainer.is_global_zero:
            ppl = float(self.trainer.callback_metrics["val/perplexity"])  # logged by GatherForMetrics
            print(f"\nepoch {self.current_epoch}: validation perplexity {ppl:.3f}")
            for prompt, continuation in self.samples:
                print(f"  sample: {prompt!r} -> {continuation!r}")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)  # CPU Adam under offload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero3_offload")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lines", type=int, default=3000, help="lines of arithmetic to fine-tune on")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=64, help="GPT-2 n_embd")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--new-tokens", type=int, default=8, help="max_new_tokens of the samples")
    parser.add_argument("--out", type=Path, default=Path("out/finetune_pretrained"))
    args = parser.parse_args()
    pretrained_dir, export_dir = args.out / "pretrained", args.out / "export"
    corpus = generate_corpus(2 * args.lines + 2000, seed=1).splitlines(keepends=True)
    sentences = "".join(line for line in corpus if "+" not in line)
    sums = [line for line in corpus if "+" in line][: args.lines]
    split = len(sums) * 9 // 10

    # Step 1: the "downloaded" checkpoint, written by the process that starts the run (rank 0) before the others exist
    # (Lightning starts them in trainer.fit; under torchrun they wait for rank 0 when the process group is created)
    if rank_zero_only.rank == 0:
        shutil.rmtree(pretrained_dir, ignore_errors=True)
        losses = write_pretrained(
            pretrained_dir,
            sentences,
            context=args.context,
            width=args.width,
            layers=args.layers,
            steps=args.pretrain_steps,
        )
        print(
            f"pretrained {pretrained_dir}: {args.pretrain_steps} steps on sentences, loss {losses['first_loss']:.3f} "
            f"-> {losses['last_loss']:.3f}; files {sorted(p.name for p in pretrained_dir.iterdir())}"
        )

    # Step 2: fine-tune on arithmetic under ZeRO-3 with CPU offload
    L.seed_everything(0, verbose=False)
    tokenizer = char_tokenizer()  # the tokenizer the directory holds (built here: the directory may not exist yet)
    train = TokenWindows(tokenizer, "".join(sums[:split]), args.context)
    val = TokenWindows(tokenizer, "".join(sums[split:]), args.context)
    if rank_zero_only.rank == 0:
        from transformers import AutoModelForCausalLM

        before = perplexity(AutoModelForCausalLM.from_pretrained(pretrained_dir), val)
        print(f"pretrained model on the {len(val)} validation windows of arithmetic: perplexity {before:.3f}")

    trainer = L.Trainer(
        strategy=args.strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        precision="32-true",
        max_epochs=args.epochs,
        gradient_clip_val=1.0,
        num_sanity_val_steps=0,
        default_root_dir=args.out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            GatherForMetrics({"perplexity": torchmetrics.text.Perplexity()}),  # over exactly the validation windows
            ZeroExport(export_dir, strip_prefix="model.", overwrite=True),  # the HF model's keys and config.json
        ],
    )
    module = FineTune(str(pretrained_dir), lr=args.lr, new_tokens=args.new_tokens)
    trainer.fit(
        module,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=args.batch_size),
    )

    # Step 3: the export is an ordinary HuggingFace directory
    if trainer.is_global_zero:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        module.tokenizer.save_pretrained(export_dir)
        reloaded = AutoModelForCausalLM.from_pretrained(export_dir)
        reloaded_ppl = perplexity(reloaded, val)
        distributed_ppl = float(trainer.callback_metrics["val/perplexity"])
        match = math.isclose(reloaded_ppl, distributed_ppl, rel_tol=1e-4)
        print(
            f"export {export_dir}: {sorted(p.name for p in export_dir.iterdir())}\n"
            f"reloaded with AutoModelForCausalLM.from_pretrained: perplexity {reloaded_ppl:.4f} "
            f"({'matches' if match else 'DOES NOT MATCH'} the distributed evaluation, {distributed_ppl:.4f})"
        )
        prompt = prompts_of(0, trainer.world_size)
        completions = complete(reloaded, AutoTokenizer.from_pretrained(export_dir), prompt, args.new_tokens)
        for text, continuation in zip(prompt, completions, strict=True):
            print(f"  reloaded: {text!r} -> {continuation!r}")
        if not match:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
