"""Knowledge distillation under ZeRO: a frozen teacher and the student it teaches in one LightningModule.

The teacher is a small GPT-2 trained here for a few steps and written with ``save_pretrained`` (it stands in for a
downloaded checkpoint); the student is a smaller GPT-2 built from a config. ``configure_model`` builds both (under
ZeRO-3 straight into their partitions; the teacher's frozen weights are partitioned too, and gathered for its forward
pass like the student's). One optimizer over the student's parameters; the teacher has ``requires_grad=False`` and
stays in eval mode. The student learns from the teacher's softened distribution (KL divergence at temperature T) and
from the text itself (cross-entropy). Validation measures, exactly over the validation set (``gather_for_metrics``),
the KL divergence from the teacher to the student and both perplexities, before training and after every epoch.
``ZeroExport(strip_prefix="student.")`` writes the distilled student alone, loadable with ``from_pretrained``.

    python examples/distill.py                                   # zero2, 2 CPU processes
    python examples/distill.py --strategy zero3 --epochs 4
    python examples/distill.py --teacher-steps 30 --lines 600 --epochs 2   # seconds
"""

from __future__ import annotations

import argparse
import math
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from tiny_hf import TokenWindows, char_tokenizer, gpt2_config, perplexity, write_pretrained
from tiny_lm import generate_corpus
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import lightspeed
from lightspeed.callbacks import GatherForMetrics, ZeroExport


def kl_per_token(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions softened by ``temperature``, per position (B, T)."""
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return (teacher.exp() * (teacher - student)).sum(-1)


class Distill(L.LightningModule):
    def __init__(
        self, teacher: str, student_config: Any, temperature: float = 2.0, alpha: float = 0.5, lr: float = 3e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["student_config"])
        self.student_config = student_config
        self.measured: list[torch.Tensor] = []

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        if hasattr(self, "student"):
            return
        self.teacher = AutoModelForCausalLM.from_pretrained(self.hparams.teacher)
        self.teacher.requires_grad_(False)  # frozen: no gradients, no optimizer state
        self.teacher.eval()  # Lightning keeps it in eval mode (it warns that it found modules in eval mode)
        self.student = AutoModelForCausalLM.from_config(self.student_config)

    def on_fit_start(self) -> None:
        def size(model: nn.Module) -> int:  # ds_numel: a ZeRO-3 parameter's full size (its local tensor is empty)
            return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())

        if self.trainer.is_global_zero:
            teacher, student = size(self.teacher), size(self.student)
            print(f"teacher {teacher} parameters (frozen), student {student} parameters (trained)")

    def logits(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.ones_like(ids)  # no padding ("\n" is the pad token)
        with torch.no_grad():
            teacher = self.teacher(ids, attention_mask=mask).logits
        return teacher, self.student(ids, attention_mask=mask).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, target = batch
        teacher, student = self.logits(ids)
        t = self.hparams.temperature
        kl = kl_per_token(teacher, student, t).mean() * t**2  # T^2 keeps the gradient scale of the soft targets
        ce = F.cross_entropy(student.flatten(0, 1), target.flatten())
        loss = self.hparams.alpha * kl + (1 - self.hparams.alpha) * ce
        self.log_dict({"train_kl": kl, "train_ce": ce}, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, target = batch
        teacher, student = self.logits(ids)
        per_window = torch.stack(
            [
                kl_per_token(teacher, student, 1.0).mean(1),
                F.cross_entropy(student.float().transpose(1, 2), target, reduction="none").mean(1),
                F.cross_entropy(teacher.float().transpose(1, 2), target, reduction="none").mean(1),
            ],
            dim=1,
        )
        # every rank receives every window's values exactly once (the sampler's padded duplicates are dropped)
        self.measured.append(lightspeed.gather_for_metrics(per_window))

    def on_validation_epoch_end(self) -> None:
        kl, student_ce, teacher_ce = torch.cat(self.measured).mean(0).tolist()
        windows = sum(len(m) for m in self.measured)
        self.measured.clear()
        when = "before training" if self.trainer.sanity_checking else f"epoch {self.current_epoch}"
        if self.trainer.is_global_zero:
            print(
                f"\n{when}: KL(teacher || student) {kl:.4f}, student perplexity {math.exp(student_ce):.3f}, "
                f"teacher perplexity {math.exp(teacher_ce):.3f} ({windows} validation windows)"
            )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # one optimizer over the student's parameters only
        return torch.optim.AdamW(self.student.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero2")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lines", type=int, default=3000, help="lines of text to distill on")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--alpha", type=float, default=0.5, help="weight of the KL term (1 - alpha: cross-entropy)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--teacher-width", type=int, default=64)
    parser.add_argument("--teacher-layers", type=int, default=2)
    parser.add_argument("--teacher-steps", type=int, default=200)
    parser.add_argument("--student-width", type=int, default=32)
    parser.add_argument("--student-layers", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("out/distill"))
    args = parser.parse_args()
    teacher_dir, student_dir = args.out / "teacher", args.out / "student"
    text = generate_corpus(args.lines, seed=3)
    split = len(text) * 9 // 10

    # the teacher, written by the process that starts the run before the others exist (see finetune_pretrained.py)
    if rank_zero_only.rank == 0:
        shutil.rmtree(teacher_dir, ignore_errors=True)
        losses = write_pretrained(
            teacher_dir,
            generate_corpus(args.lines, seed=4),
            context=args.context,
            width=args.teacher_width,
            layers=args.teacher_layers,
            steps=args.teacher_steps,
        )
        print(
            f"teacher {teacher_dir}: {args.teacher_steps} steps, loss {losses['first_loss']:.3f} -> "
            f"{losses['last_loss']:.3f}"
        )

    L.seed_everything(0, verbose=False)
    tokenizer = char_tokenizer()
    train = TokenWindows(tokenizer, text[:split], args.context)
    val = TokenWindows(tokenizer, text[split:], args.context)
    student_config = gpt2_config(tokenizer, args.context, args.student_width, args.student_layers)
    module = Distill(str(teacher_dir), student_config, args.temperature, args.alpha, args.lr)
    trainer = L.Trainer(
        strategy=args.strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        precision="32-true",
        max_epochs=args.epochs,
        gradient_clip_val=1.0,
        num_sanity_val_steps=-1,  # the whole validation set before training: where the student starts
        default_root_dir=args.out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            GatherForMetrics(),  # tracks the validation loader for gather_for_metrics
            ZeroExport(student_dir, strip_prefix="student.", overwrite=True),  # the student alone, with config.json
        ],
    )
    trainer.fit(
        module,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=args.batch_size),
    )
    if trainer.is_global_zero:
        from transformers import AutoModelForCausalLM

        reloaded = perplexity(AutoModelForCausalLM.from_pretrained(student_dir), val)
        print(f"student exported to {student_dir}; reloaded with from_pretrained: perplexity {reloaded:.3f}")


if __name__ == "__main__":
    main()
