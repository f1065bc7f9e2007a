"""Worker: Ulysses sequence parallelism under the Trainer's ZeRO strategies, ``sequence_parallel_size=2``.

usage: zero_sequence_parallel.py OUT RUNS   (OUT/pretrained: written by the test; RUNS: comma-separated names)

Runs, one after another in this launch (each installs the attention again after the previous one removed it): ``zero2``
/ ``zero3`` (2 steps), ``zero3_tiled`` (``tiled_mlp=True``), ``zero3_lora`` (peft's LoRA on q_proj/v_proj),
``zero3_one_kv_head`` (OUT/one_kv_head: 4 attention heads sharing 1 key/value head, fewer than the group's ranks),
``zero3_tiled_logits`` (``tiled_logits_loss=4``), ``zero2_accumulate_tiled_logits`` (``tiled_logits_loss=True``,
accumulation 2), ``zero3_tiled_logits_data_parallel`` (``tiled_logits_loss=5`` without sequence parallelism),
``zero3_checkpointed`` (every decoder layer checkpointed, ``cpu_checkpointing=True``), ``zero3_clip``
(gradient_clip_val=0.05), ``zero2_accumulate`` (accumulate_grad_batches=2, 2 steps), ``zero3_resume`` (1 step saved to
OUT/ck, a new Trainer resumes it to step 2 with ``ZeroExport(OUT/export)``, then ``validate`` logs ``val_loss``),
``gather_metrics`` (``validate`` with ``GatherForMetrics`` over per-token predictions of whole sequences); errors:
``generate`` (``generate()`` inside ``training_step``), ``rank_rows`` (an IterableDataset split by global rank),
``gather_per_sequence`` (``GatherForMetrics`` given one value per sequence computed from a slice), ``own_loss`` (a
cross-entropy computed in the step from the slice's logits), ``rebuilt`` (``validate`` after ``fit`` with a
``configure_model`` that builds the model again), ``bad_world`` (sequence_parallel_size=4 on 2 ranks), ``one_head``
(OUT/one_head: a model with one attention head), ``eager`` (the model built with eager attention). Each rank writes
OUT/result_<rank>.pt: the gathered weights after each run, its logged losses, the metrics and the errors.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset, Subset

import lightspeed
from _support import long_context
from _support.models import full_state_dict
from _support.outcomes import error_text
from _support.trainers import quiet_trainer


class CausalLM(L.LightningModule):
    def __init__(
        self,
        pretrained: Path,
        attn_implementation: str = "sdpa",
        generate: bool = False,
        rebuild: bool = False,
        own_loss: bool = False,
        lora: bool = False,
    ) -> None:
        super().__init__()
        self.own_loss, self.lora = own_loss, lora
        self.pretrained, self.attn_implementation, self.generate = pretrained, attn_implementation, generate
        self.rebuild = rebuild  # configure_model builds a new model in every stage (not idempotent)
        self.losses: list[float] = []
        self.had_logits: list[bool] = []  # whether each training step's output held logits

    def configure_model(self) -> None:
        if getattr(self, "model", None) is not None and not self.rebuild:
            return
        self.model = long_context.load(self.pretrained, self.attn_implementation, lora=self.lora)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.generate:
            self.model.generate(batch["input_ids"][:, :4], max_new_tokens=2)
        if self.own_loss:
            logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        else:
            output = self.model(**batch)
            loss = output.loss
            self.had_logits.append(output.logits is not None)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return long_context.optimizer(self)


def trainer_for(
    stage: int,
    steps: int,
    size: int = 2,
    tiled_mlp: bool = False,
    checkpointed: bool = False,
    tiled_logits: int | bool = False,
    **settings: Any,
) -> L.Trainer:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    strategy = lightspeed.strategies.ZeroStrategy(
        stage=stage,
        sequence_parallel_size=size,
        tiled_mlp=tiled_mlp,
        tiled_logits_loss=tiled_logits,
        activation_checkpointing_policy={LlamaDecoderLayer} if checkpointed else None,
        cpu_checkpointing=True if checkpointed else "auto",
    )
    world = int(os.environ["WORLD_SIZE"])
    return quiet_trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=steps, **settings)


def loader(shuffle: bool = True) -> DataLoader:
    return DataLoader(long_context.PaddedTokens(), batch_size=long_context.BATCH, shuffle=shuffle)


def fit(
    out: Path,
    stage: int,
    steps: int,
    accumulate: int = 1,
    size: int = 2,
    pretrained: str = "pretrained",
    tiled_mlp: bool = False,
    clip: float | None = None,
    checkpointed: bool = False,
    tiled_logits: int | bool = False,
    **model: Any,
) -> dict[str, Any]:
    module = CausalLM(out / pretrained, **model)
    trainer = trainer_for(
        stage,
        steps,
        size,
        tiled_mlp,
        checkpointed,
        tiled_logits,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
    )
    trainer.fit(module, loader())
    return {"state": full_state_dict(module.model), "losses": module.losses, "had_logits": module.had_logits}


def resume(out: Path) -> dict[str, Any]:
    every_step = ModelCheckpoint(out / "ck", every_n_train_steps=1, save_top_k=-1)
    trainer_for(3, 1, callbacks=[every_step], enable_checkpointing=True).fit(CausalLM(out / "pretrained"), loader())
    module = CausalLM(out / "pretrained")
    trainer = trainer_for(3, 2, callbacks=[lightspeed.callbacks.ZeroExport(out / "export", strip_prefix="model.")])
    trainer.fit(module, loader(), ckpt_path=next((out / "ck").iterdir()))
    state = full_state_dict(module.model)
    trainer.validate(module, loader(shuffle=False))
    return {"state": state, "val_loss": float(trainer.callback_metrics["val_loss"])}


class Scored(CausalLM):
    """validation_step returns per-token predictions and targets of its slice (``per_sequence``: one value per
    sequence, computed from the slice)."""

    def __init__(self, pretrained: Path, per_sequence: bool = False) -> None:
        super().__init__(pretrained)
        self.per_sequence = per_sequence

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        preds, target = self.model(**batch).logits.argmax(-1), batch["shift_labels"]
        if self.per_sequence:
            return {"preds": preds[:, -1], "target": target[:, -1]}
        return {"preds": preds, "target": target}


def gather_metrics(out: Path, per_sequence: bool = False) -> dict[str, Any]:
    """validate with GatherForMetrics: token accuracy (torchmetrics) and the counts behind it (a plain callable), on
    all rows but the last (with 2 data-parallel groups, the sampler repeats one row to even them out)."""
    callback = lightspeed.callbacks.GatherForMetrics(long_context.token_metrics(), gather_every=1)
    module = Scored(out / "pretrained", per_sequence)
    rows = Subset(long_context.PaddedTokens(), range(long_context.SAMPLES - 1))
    trainer_for(3, 1, callbacks=[callback]).validate(module, DataLoader(rows, batch_size=long_context.BATCH))
    return callback.results["validate"]


class RowsByGlobalRank(IterableDataset):
    """Every rank reads its own rows (split by global rank, as a data-parallel IterableDataset does)."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        data = long_context.PaddedTokens()
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return (data[row] for row in range(rank, len(data), world))


def rank_rows(out: Path) -> None:
    """fit on an IterableDataset split by global rank: a group's ranks would splice different sequences."""
    trainer_for(2, 1).fit(CausalLM(out / "pretrained"), DataLoader(RowsByGlobalRank(), batch_size=long_context.BATCH))


def rebuilt(out: Path) -> None:
    """fit, then validate with a configure_model that builds the model again."""
    module = CausalLM(out / "pretrained", rebuild=True)
    trainer = trainer_for(2, 1)
    trainer.fit(module, loader())
    trainer.validate(module, loader(shuffle=False))


def main(out: Path, runs: list[str]) -> None:
    result: dict[str, Any] = {}
    for run in runs:
        if run == "zero2_accumulate":
            result[run] = fit(out, 2, 2, accumulate=2)
        elif run == "zero3_tiled":
            result[run] = fit(out, 3, 2, tiled_mlp=True)
        elif run == "zero3_lora":
            result[run] = fit(out, 3, 2, lora=True)
        elif run == "zero3_one_kv_head":
            result[run] = fit(out, 3, 2, pretrained="one_kv_head")
        elif run == "zero3_tiled_logits":
            result[run] = fit(out, 3, 2, tiled_logits=4)
        elif run == "zero2_accumulate_tiled_logits":
            result[run] = fit(out, 2, 2, accumulate=2, tiled_logits=True)
        elif run == "zero3_tiled_logits_data_parallel":
            result[run] = fit(out, 3, 2, size=1, tiled_logits=5)
        elif run == "zero3_checkpointed":
            result[run] = fit(out, 3, 2, checkpointed=True)
        elif run == "zero3_clip":
            result[run] = fit(out, 3, 2, clip=0.05)
        elif run == "zero3_resume":
            result[run] = resume(out)
        elif run == "rebuilt":
            result[run] = error_text(lambda: rebuilt(out))
        elif run == "rank_rows":
            result[run] = error_text(lambda: rank_rows(out))
        elif run == "gather_metrics":
            result[run] = gather_metrics(out)
        elif run == "gather_per_sequence":
            result[run] = error_text(lambda: gather_metrics(out, per_sequence=True))
        elif run == "own_loss":
            result[run] = error_text(lambda: fit(out, 2, 1, own_loss=True))
        elif run == "generate":
            result[run] = error_text(lambda: fit(out, 2, 1, generate=True))
        elif run == "bad_world":
            result[run] = error_text(lambda: fit(out, 2, 1, size=4))
        elif run == "one_head":
            result[run] = error_text(lambda: fit(out, 2, 1, pretrained="one_head"))
        elif run == "eager":
            result[run] = error_text(lambda: fit(out, 3, 1, attn_implementation="eager"))
        else:
            result[run] = fit(out, int(run[-1]), 2)
    torch.save(result, out / f"result_{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
