"""Worker: ``from_pretrained`` of a sharded Llama checkpoint straight into ZeRO-3 partitions (2 CPU ranks), in the
Trainer's ``configure_model`` or in Fabric's ``init_module``. Each rank records how far its resident memory rose above
where it stood while the model was loaded (the peak, ``VmHWM``, reset first) and the weights it ended with (gathered).

usage: hf_shard_loading.py OUT trainer|fabric      (OUT/pretrained: the checkpoint; writes OUT/<front end>_<rank>.pt)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import full_state_dict
from _support.process_memory import reset_peak, status_bytes
from _support.trainers import quiet_trainer


def load(path: Path) -> tuple[Any, int]:
    """The model and how many bytes the process's resident memory rose to above its level before the load."""
    from transformers import AutoModelForCausalLM

    before = status_bytes("VmRSS")
    reset_peak()
    model = AutoModelForCausalLM.from_pretrained(path)
    return model, status_bytes("VmHWM") - before


class Loaded(L.LightningModule):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.rise = 0

    def configure_model(self) -> None:
        self.model, self.rise = load(self.path)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


def main(out: Path, front_end: str) -> None:
    path = out / "pretrained"
    if front_end == "trainer":
        module = Loaded(path)
        trainer = quiet_trainer(strategy="zero3", accelerator="cpu", devices=2)
        trainer.validate(module, DataLoader(torch.zeros(1, 1)))
        model, rise, rank = module.model, module.rise, trainer.global_rank
    else:
        fabric = L.Fabric(strategy="zero3", accelerator="cpu", devices=2)
        fabric.launch()
        with fabric.init_module():
            model, rise = load(path)
        rank = fabric.global_rank
    torch.save({"rise": rise, "weights": full_state_dict(model)}, out / f"{front_end}_{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
