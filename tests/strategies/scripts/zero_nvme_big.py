"""Worker: fine-tune the pretrained Llama of ``_support.big_model`` (built in ``configure_model`` straight into
ZeRO-3 partitions) for a few steps under the Trainer on 2 ranks, export it with ``ZeroExport``, and record each
rank's memory.

usage: zero_nvme_big.py OUT STRATEGY STEPS [--hidden H --layers N --vocab V] [--config JSON]
       (OUT/pretrained: the pretrained files; OUT/nvme: the NVMe path; the export goes to OUT/export)

Each rank writes OUT/memory_<rank>.json: its peak resident size (VmHWM) after the imports, after the model is built
(``configure_model``), after the last step and at the end (the export included), the wall time of each step and of its
forward and backward, the bytes read and written of each step, and when the model was built and the steps ran.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed
from _support import big_model
from _support.process_memory import status_bytes
from _support.trainers import quiet_trainer


def io_bytes() -> tuple[int, int]:
    """Bytes this process (all of its threads: DeepSpeed's async I/O too) has read from and written to storage."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def peak_bytes() -> int:
    return status_bytes("VmHWM")


class FineTune(L.LightningModule):
    def __init__(self, pretrained: Path, record: dict[str, Any]) -> None:
        super().__init__()
        self.pretrained, self.record = pretrained, record
        self._step_started = 0.0
        self._io_started = (0, 0)

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        if hasattr(self, "model"):
            return
        self.model = AutoModelForCausalLM.from_pretrained(self.pretrained)
        self.model.train()
        self.record["built_peak"] = peak_bytes()
        self.record["built_at"] = time.time()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.record.setdefault("steps_from", time.time())
        self._step_started = time.perf_counter()
        self._io_started = io_bytes()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.record["backward_seconds"].append(time.perf_counter() - self._step_started)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.record["step_seconds"].append(time.perf_counter() - self._step_started)
        read, written = io_bytes()
        self.record["step_io"].append((read - self._io_started[0], written - self._io_started[1]))
        self.record["steps_peak"] = peak_bytes()
        self.record["steps_to"] = time.time()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return big_model.lm_loss(self.model, batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return big_model.optimizer(self)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("strategy")
    parser.add_argument("steps", type=int)
    parser.add_argument("--hidden", type=int, default=big_model.BigModelShape.hidden)
    parser.add_argument("--layers", type=int, default=big_model.BigModelShape.layers)
    parser.add_argument("--vocab", type=int, default=big_model.BigModelShape.vocab)
    parser.add_argument("--config", type=json.loads, help="a DeepSpeed config (JSON) merged over STRATEGY's")
    args = parser.parse_args()
    os.environ.setdefault("LIGHTSPEED_NVME_PATH", str(args.out / "nvme"))
    record: dict[str, Any] = {"imported_peak": peak_bytes(), "step_seconds": [], "backward_seconds": [], "step_io": []}
    strategy: Any = args.strategy
    if args.config is not None:  # the named preset (zero3, zero3_nvme) with the given config merged over it
        offload = "nvme" if args.strategy.endswith("nvme") else "none"
        strategy = lightspeed.strategies.ZeroStrategy(
            stage=3, offload_optimizer=offload, offload_parameters=offload, config=args.config
        )
    trainer = quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=big_model.WORLD,
        max_steps=args.steps,
        callbacks=[lightspeed.callbacks.ZeroExport(args.out / "export", strip_prefix="model.")],
    )
    data = DataLoader(TensorDataset(big_model.tokens(args.vocab)), batch_size=big_model.BATCH, shuffle=True)
    trainer.fit(FineTune(args.out / "pretrained", record), data)
    record["end_peak"] = peak_bytes()
    (args.out / f"memory_{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
