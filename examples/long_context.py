"""Train a HuggingFace causal LM on sequences split over 2 processes with Ulysses sequence parallelism
(``ZeroStrategy(sequence_parallel_size=2)``), export it and check the export on whole sequences in one plain process.

The task needs the whole sequence: every row is a random "document" followed by a copy of it, and only the copy is
labelled (the document is a prompt, ``-100``), so predicting a token of the copy means attending back half a
sequence, across the boundary between the two processes' slices. Each process holds half of every sequence (its
activations are half as long); their attention layers exchange heads so that every token still attends to the whole
sequence before it. Rows are right-padded to different lengths, as a collator pads them.

Step 1 stands in for downloading a checkpoint: a small Llama is written with ``save_pretrained``. Step 2 trains it
under ZeRO-3 on 2 CPU processes, logging the validation loss (the token mean over whole sequences, the same on both
ranks) before and after, and ``ZeroExport`` writes the weights. Step 3 reloads them with ``from_pretrained`` in one
process and evaluates the whole sequences without sequence parallelism: the same loss.

    python examples/long_context.py                             # sequences of 512 tokens, 2 CPU processes
    python examples/long_context.py --length 128 --steps 20     # seconds
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import lightspeed
from lightspeed.callbacks import ZeroExport

VOCAB = 64
DOCUMENT_TOKENS = 16  # documents draw from the first 16 tokens of the vocabulary


def write_pretrained(path: Path, length: int, width: int) -> None:
    """A small Llama with sdpa attention (what Ulysses wraps on the CPU), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=length,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(path)


class CopyTask(Dataset):
    """Rows ``document + document``, right-padded to ``length``; labels only on the copy."""

    def __init__(self, rows: int, length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.rows: list[dict[str, torch.Tensor]] = []
        for _ in range(rows):
            half = int(torch.randint(length // 4, length // 2 + 1, (), generator=generator))
            document = torch.randint(1, DOCUMENT_TOKENS + 1, (half,), generator=generator)
            ids = torch.zeros(length, dtype=torch.long)
            ids[: 2 * half] = torch.cat([document, document])
            labels = torch.full((length,), -100)
            labels[half : 2 * half] = document
            mask = (torch.arange(length) < 2 * half).long()
            self.rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


class LongContextLM(L.LightningModule):
    def __init__(self, pretrained: Path, lr: float) -> None:
        super().__init__()
        self.pretrained, self.lr = pretrained, lr

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        if getattr(self, "model", None) is not None:
            return
        self.model = AutoModelForCausalLM.from_pretrained(self.pretrained, attn_implementation="sdpa")

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        # `batch` is this process's half of every row; the loss is the whole micro-batch's token mean
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def whole_sequence_loss(export: Path, data: Dataset, batch_size: int) -> float:
    """The validation loss of the exported model in one plain process, on whole sequences."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export)
    with torch.no_grad():
        losses = [float(model(**batch).loss) for batch in DataLoader(data, batch_size=batch_size)]
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--out", type=Path, default=Path("out/long_context"))
    args = parser.parse_args()

    pretrained, export = args.out / "pretrained", args.out / "export"
    train, val = CopyTask(args.steps * args.batch_size, args.length, 1), CopyTask(4, args.length, 2)
    module = LongContextLM(pretrained, args.lr)
    trainer = L.Trainer(
        strategy=lightspeed.strategies.ZeroStrategy(stage=3, sequence_parallel_size=2),
        accelerator="cpu",
        devices=2,
        max_steps=args.steps,
        callbacks=[ZeroExport(export, strip_prefix="model.", overwrite=True)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if trainer.is_global_zero:  # step 1, before the second process starts
        shutil.rmtree(args.out, ignore_errors=True)
        write_pretrained(pretrained, args.length, args.width)
    val_loader = DataLoader(val, batch_size=args.batch_size)
    before = trainer.validate(module, val_loader, verbose=False)[0]["val_loss"]
    trainer.fit(module, DataLoader(train, batch_size=args.batch_size, shuffle=True), val_loader)
    after = float(trainer.callback_metrics["val_loss"])
    if trainer.is_global_zero:
        print(f"validation loss on whole sequences of {args.length} tokens, split over 2 processes:")
        print(f"  before training: {before:.4f}")
        print(f"  after {args.steps} steps: {after:.4f}")
        reloaded = whole_sequence_loss(export, val, args.batch_size)
        print(f"the export, in one plain process without sequence parallelism: {reloaded:.4f}")


if __name__ == "__main__":
    main()
