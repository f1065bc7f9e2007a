"""Worker (torchrun, 2 CPU ranks; 1 rank on a GPU for CUDA_CASES): fit with a lightspeed ZeRO strategy and the
ZeroExport callback, save a checkpoint with ModelCheckpoint, and record the live fp32 master weights gathered after
fit as the reference.

Usage: torchrun --nproc_per_node=2 zero_export_fit.py OUT_DIR CASE [CASE ...]   (cases: CASES, HF_CASES, CUDA_CASES)
Rank 0 writes OUT_DIR/<case>/reference.pt; the export is in OUT_DIR/<case>/export, the checkpoint in
OUT_DIR/<case>/ckpts/last.ckpt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "core" / "checkpoint" / "scripts"))
sys.path.insert(0, str(REPO / "examples"))
from checkpoint_models import VOCAB, TinyLM  # noqa: E402

import lightspeed  # noqa: E402,F401
from _support.trainers import quiet_trainer  # noqa: E402
from lightspeed.callbacks import ZeroExport  # noqa: E402

# case -> (strategy name, model kind, ZeroExport keyword arguments)
CASES = {
    "zero3_offload": ("zero3_offload", "tiny", {"dtype": "fp32"}),
    "zero2_bf16_sharded": ("zero2", "tiny", {"dtype": "bf16", "max_shard_size": "4KB", "on_checkpoint": True}),
    "zero3_nvme": ("zero3_nvme", "tiny_big", {"dtype": "fp32", "max_shard_size": "1MB"}),
    "zero3_tiny_gpt": ("zero3_offload", "tiny_gpt", {"dtype": "fp32"}),
}
#: case -> (strategy name, ZeroExport keyword arguments, precision): TinyLM trained on one GPU (the `gpu` tests)
CUDA_CASES = {
    "cuda_zero3_bf16": ("zero3", {"dtype": "fp32"}, "bf16-mixed"),
    "cuda_zero2_offload_fp16": ("zero2_offload", {"dtype": "fp32", "max_shard_size": "4KB"}, "16-mixed"),
}
TINY_GPT_VOCAB, TINY_GPT_CONTEXT = 29, 12
# case -> strategy name: a Hugging Face GPT-2 as `self.model`, exported with strip_prefix="model." (config.json too)
HF_CASES = {"zero3_offload_hf_gpt2": "zero3_offload"}
HF_GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 100, "n_positions": 32}


def build_net(kind: str) -> torch.nn.Module:
    if kind == "tiny_gpt":
        from tiny_lm import TinyGPT

        return TinyGPT(TINY_GPT_VOCAB, TINY_GPT_CONTEXT, width=32, depth=2, heads=4)
    return TinyLM(big=kind == "tiny_big")


class LitLM(L.LightningModule):
    """A plain LightningModule around a small LM (tied head; TinyLM also has a frozen layer and buffers)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = build_net(kind)

    def vocab(self) -> int:
        return TINY_GPT_VOCAB if self.kind == "tiny_gpt" else VOCAB

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.net(tokens)
        vocab = self.vocab()
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        if self.kind == "tiny_gpt":
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return torch.optim.AdamW(self.net.param_groups(), lr=1e-2)


def loader(kind: str) -> DataLoader:
    generator = torch.Generator().manual_seed(5)
    vocab = TINY_GPT_VOCAB if kind == "tiny_gpt" else VOCAB
    tokens = torch.randint(0, vocab, (18, 7), generator=generator)
    return DataLoader(TensorDataset(tokens), batch_size=3)


def live_reference(engine) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    fp32, frozen = {}, []
    for name, param in engine.module.named_parameters():
        master = safe_get_full_fp32_param(param) if param.requires_grad else None
        if master is None:
            frozen.append(name)
            if hasattr(param, "ds_id"):
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    master = param.detach().clone()
            else:
                master = param.detach().clone()
        fp32[name] = master.detach().float().cpu().clone()
    buffers = {n: b.detach().cpu().clone() for n, b in engine.module.named_buffers()}
    return {"fp32": fp32, "frozen": frozen, "buffers": buffers, "keys": list(engine.module.state_dict().keys())}


def run(case: str, out: Path) -> None:
    if case in CUDA_CASES:
        strategy, export_kwargs, precision = CUDA_CASES[case]
        kind, place = "tiny", {"accelerator": "cuda", "devices": 1}
    else:
        strategy, kind, export_kwargs = CASES[case]
        precision, place = "32-true", {"accelerator": "cpu", "devices": 2}
    root = out / case
    L.seed_everything(0, verbose=False)
    model = LitLM(kind)
    export = ZeroExport(root / "export", **export_kwargs)
    trainer = quiet_trainer(
        strategy=strategy,
        precision=precision,
        **place,
        max_steps=3,
        default_root_dir=root,
        callbacks=[export, ModelCheckpoint(root / "ckpts", save_last=True)],
        enable_checkpointing=True,
    )
    trainer.fit(model, loader(kind))
    reference = live_reference(trainer.strategy.deepspeed_engine)
    reference["export_count"] = export.export_count
    if case == FAILURE_CASE:
        reference["failures"] = failure_outcomes(trainer, export, model, kind, root)
    if trainer.is_global_zero:
        torch.save(reference, root / "reference.pt")
    trainer.strategy.barrier()


class LitHFGPT2(L.LightningModule):
    """A LightningModule holding a tiny Hugging Face GPT-2 (built from a config: nothing is downloaded)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.model = GPT2LMHeadModel(GPT2Config(**HF_GPT2))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def hf_probe_tokens() -> torch.Tensor:
    return torch.randint(0, HF_GPT2["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(11))


def run_hf(case: str, out: Path) -> None:
    """Fit, export with ZeroExport(strip_prefix="model."), and record the trained model's logits on a probe batch
    (computed by the ZeRO-3 partitioned model itself, every rank taking part in the gathers)."""
    root = out / case
    L.seed_everything(0, verbose=False)
    model = LitHFGPT2()
    tokens = torch.randint(0, HF_GPT2["vocab_size"], (12, 9), generator=torch.Generator().manual_seed(5))
    trainer = quiet_trainer(
        strategy=HF_CASES[case],
        accelerator="cpu",
        devices=2,
        max_steps=3,
        default_root_dir=root,
        callbacks=[ZeroExport(root / "export", strip_prefix="model."), ModelCheckpoint(root / "ckpts", save_last=True)],
        enable_checkpointing=True,
    )
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=3))
    module = trainer.strategy.deepspeed_engine.module
    module.eval()
    with torch.no_grad():
        logits = module.model(input_ids=hf_probe_tokens()).logits.detach().clone()
    if trainer.is_global_zero:
        torch.save({"tokens": hf_probe_tokens(), "logits": logits}, root / "reference.pt")
    trainer.strategy.barrier()


FAILURE_CASE = "zero3_offload"


def _outcome(action) -> str:
    try:
        action()
    except BaseException as error:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(error).__name__}: {error}"
    return "ok"


def failure_outcomes(trainer: L.Trainer, export: ZeroExport, model: LitLM, kind: str, root: Path) -> list:
    """What every rank raises when rank 0 fails mid-export and when a second fit meets the first fit's export;
    the all_gather after each proves that no rank was left waiting in a collective."""
    import torch.distributed as dist

    from lightspeed.core.checkpoint import safetensors_writer
    from lightspeed.core.checkpoint.live import export_engine

    rank = dist.get_rank()
    original = safetensors_writer.write_file

    def broken(path, tensors, metadata, progress):
        tensors[0].produce()  # fail after the first collective, while the others wait for the next tensors
        raise OSError("disk full")

    if rank == 0:
        safetensors_writer.write_file = broken
    try:
        failed_write = _outcome(lambda: export_engine(trainer.strategy.deepspeed_engine, root / "broken_export"))
    finally:
        safetensors_writer.write_file = original
    second = quiet_trainer(
        strategy=CASES[FAILURE_CASE][0],
        accelerator="cpu",
        devices=2,
        max_steps=1,
        callbacks=[export],
    )
    second_fit = _outcome(lambda: second.fit(LitLM(kind), loader(kind)))
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(
        outcomes,
        {
            "failed_write": failed_write,
            "second_fit": second_fit,
            "broken_export_exists": (root / "broken_export").exists(),
        },
    )
    return outcomes


def main() -> None:
    out = Path(sys.argv[1])
    os.environ["LIGHTSPEED_NVME_PATH"] = str(out / "nvme")
    for case in sys.argv[2:]:
        if case in HF_CASES:
            run_hf(case, out)
        else:
            run(case, out)


if __name__ == "__main__":
    main()
