"""Worker: ``from_pretrained`` of a sharded Llama checkpoint straight into ZeRO-3 partitions (2 CPU ranks), in the
Trainer's ``configure_model`` or in Fabric's ``init_module``. Each rank records the bytes of the tensors it read from
the checkpoint files (meta tensors, shapes only, do not count): in all, and the most alive at once; and the weights it
ended with (gathered).

usage: hf_shard_loading.py OUT trainer|fabric      (OUT/pretrained: the checkpoint; writes OUT/<front end>_<rank>.pt)
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401  (registers the strategy names)
from _support.models import full_state_dict
from _support.trainers import quiet_trainer


class ReadBytes:
    """Bytes of the tensors read from the checkpoint files: in all, alive now, the most alive at once."""

    total = alive = peak = 0

    @classmethod
    def count(cls, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        cls.total, cls.alive = cls.total + size, cls.alive + size
        cls.peak = max(cls.peak, cls.alive)
        weakref.finalize(tensor, cls.drop, size)

    @classmethod
    def drop(cls, size: int) -> None:
        cls.alive -= size


def count_reads() -> None:
    """transformers' reads of checkpoint files (which lightspeed's loader calls) count what they return."""
    from transformers import modeling_utils

    read = modeling_utils.load_state_dict

    def counted(checkpoint_file: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        tensors = read(checkpoint_file, *args, **kwargs)
        for tensor in tensors.values():
            if tensor.device.type != "meta":
                ReadBytes.count(tensor)
        return tensors

    modeling_utils.load_state_dict = counted


def load(path: Path) -> tuple[Any, dict[str, int]]:
    """The model and what it read: ``{"total": bytes, "peak": bytes alive at once}``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    return model, {"total": ReadBytes.total, "peak": ReadBytes.peak}


class Loaded(L.LightningModule):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.read: dict[str, int] = {}

    def configure_model(self) -> None:
        self.model, self.read = load(self.path)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


def main(out: Path, front_end: str) -> None:
    path = out / "pretrained"
    count_reads()
    if front_end == "trainer":
        module = Loaded(path)
        trainer = quiet_trainer(strategy="zero3", accelerator="cpu", devices=2)
        trainer.validate(module, DataLoader(torch.zeros(1, 1)))
        model, read, rank = module.model, module.read, trainer.global_rank
    else:
        fabric = L.Fabric(strategy="zero3", accelerator="cpu", devices=2)
        fabric.launch()
        with fabric.init_module():
            model, read = load(path)
        rank = fabric.global_rank
    torch.save({"read": read, "weights": full_state_dict(model)}, out / f"{front_end}_{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
