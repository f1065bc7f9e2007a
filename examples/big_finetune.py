"""Fine-tune a model whose training state is larger than this machine's memory: ZeRO-3 with the parameters and the
optimizer states on NVMe (``zero3_nvme``, ZeRO-Infinity), 2 CPU processes.

Step 1 stands in for a download: a Llama-style model with random weights, written with ``save_pretrained`` as
sharded safetensors (by default 2.09B parameters: hidden size 2560, 24 layers, a 32000-token vocabulary; 8.4 GB of
fp32 weights and, with AdamW, 33.5 GB of fp32 training state). Step 2 fine-tunes all of it for a few steps on random
tokens (stand-ins for your data): ``configure_model`` calls ``from_pretrained``, which lightspeed builds straight into
the ZeRO-3 partitions (each rank reads only its slices of the files), activation checkpointing is on, the states
are swapped between RAM and ``--nvme-path`` (sized from the model: ``lightspeed estimate --zero-init`` says how much
each process needs), the partitioned model generates a few tokens greedily at the end of training, and
``ZeroExport`` streams the fine-tuned weights into safetensors shards with ``config.json``. Step 3 reloads the export
with ``from_pretrained`` in one plain process and generates the same tokens.

    python examples/big_finetune.py --nvme-path /mnt/nvme/lightspeed        # 2.09B; 13 minutes in all here
    python examples/big_finetune.py --hidden 64 --layers 2 --vocab 256 --steps 2   # seconds

``bench/big_model.py`` measures the same run: peak memory against the training state, step time against disk I/O.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

import lightspeed
from lightspeed.callbacks import ZeroExport

PROMPT = [1, 5, 9, 2, 7]
"""Token ids the fine-tuned model continues (the vocabulary is the model's own, random weights have no tokenizer)."""


def llama_config(hidden: int, layers: int, vocab: int, context: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 128, 1),
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=context,
        tie_word_embeddings=False,
    )


def write_pretrained(folder: Path, config: Any, shard_size: str) -> int:
    """Random weights as sharded safetensors, as a published checkpoint comes; returns the parameter count."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size=shard_size)
    return sum(p.numel() for p in model.parameters())


def greedy(model: Any, new_tokens: int) -> list[int]:
    """``PROMPT`` continued by ``new_tokens`` greedy tokens (the same number on every rank: no early stop)."""
    ids = torch.tensor([PROMPT])
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


class FineTune(L.LightningModule):
    def __init__(self, pretrained: str, lr: float, new_tokens: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.generated: list[int] = []

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        if hasattr(self, "model"):
            return
        # under ZeRO-3 each rank builds and loads only its partition of every weight
        self.model = AutoModelForCausalLM.from_pretrained(self.hparams.pretrained)
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()  # from_pretrained returns the model in eval mode

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_train_end(self) -> None:
        self.model.eval()
        with torch.no_grad():  # every rank runs the same steps: DeepSpeed gathers each layer as it is reached
            self.generated = greedy(self.model, self.hparams.new_tokens)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=128, help="tokens per sample")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shard-size", default="500MB", help="largest safetensors file of the pretrained model")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--nvme-path", type=Path, default=None, help="a fast local disk (default: OUT/nvme)")
    parser.add_argument("--out", type=Path, default=Path("out/big_finetune"))
    args = parser.parse_args()
    pretrained_dir, export_dir = args.out / "pretrained", args.out / "export"
    nvme_path = args.nvme_path or args.out / "nvme"
    config = llama_config(args.hidden, args.layers, args.vocab, args.context + args.new_tokens + len(PROMPT))

    # Step 1: the "downloaded" checkpoint, written by the process that starts the run (rank 0) before the others exist
    if rank_zero_only.rank == 0:
        shutil.rmtree(pretrained_dir, ignore_errors=True)
        count = write_pretrained(pretrained_dir, config, args.shard_size)
        shards = len(list(pretrained_dir.glob("*.safetensors")))
        print(f"pretrained {pretrained_dir}: {count / 1e9:.3f}B parameters in {shards} safetensors files")

    # Step 2: fine-tune every weight with the parameters and optimizer states on NVMe
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.steps * args.devices, args.context), generator=generator)
    trainer = L.Trainer(
        strategy=lightspeed.strategies.ZeroStrategy(
            stage=3, offload_optimizer="nvme", offload_parameters="nvme", nvme_path=nvme_path
        ),
        accelerator="cpu",
        devices=args.devices,
        precision="32-true",
        max_steps=args.steps,
        default_root_dir=args.out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ZeroExport(export_dir, strip_prefix="model.", overwrite=True)],  # the HF keys and config.json
    )
    module = FineTune(str(pretrained_dir), lr=args.lr, new_tokens=args.new_tokens)
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=1))

    # Step 3: the export is an ordinary HuggingFace directory
    if trainer.is_global_zero:
        from transformers import AutoModelForCausalLM

        print(f"generated while partitioned: {module.generated}")
        reloaded = AutoModelForCausalLM.from_pretrained(export_dir).eval()
        with torch.no_grad():
            again = greedy(reloaded, args.new_tokens)
        print(f"export {export_dir}: {sorted(p.name for p in export_dir.iterdir())}")
        print(f"generated after from_pretrained: {again}")
        if again != module.generated:
            raise SystemExit("the reloaded export generates other tokens than the partitioned model")


if __name__ == "__main__":
    main()
