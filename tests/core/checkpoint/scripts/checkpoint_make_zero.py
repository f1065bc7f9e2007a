"""Worker (torchrun, gloo, DS_ACCELERATOR=cpu): train plain DeepSpeed engines for a few steps and save real ZeRO
checkpoints, one configuration after another, plus the live weights gathered from each engine as the reference.

Usage: torchrun --nproc_per_node=N checkpoint_make_zero.py OUT_DIR CONFIG [CONFIG ...]

A CONFIG is ``s<stage>_<offload>_<dtype>`` (offload: none, cpu, nvme; dtype: fp32, bf16), optionally with a model
prefix: ``lit_`` (a LightningModule as the engine's module, saved like Lightning's DeepSpeedStrategy into
``<name>.ckpt/checkpoint``), ``litwrap_`` (the same wrapped under ``_forward_module`` as Lightning < 2.1 did),
``hf_`` (a module holding a tiny GPT-2 under ``self.model``) or ``shared_`` (one block registered twice in one parent;
the live engine is also exported to ``<config>/live_export``, as ZeroExport does). ``big`` in the name adds a layer
large enough to be swapped to NVMe. Rank 0 writes OUT_DIR/<config>/reference.pt with the gathered fp32 master
weights, the gathered module weights, the buffers and the module's state_dict keys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_models import HFWrapper, SharedBlocks, TinyLM, batch  # noqa: E402


class UserHyperparameter:
    """Stands for an object in Lightning's hyper_parameters whose class the exporter cannot import."""

    def __init__(self, value: int) -> None:
        self.value = value


def build_model(config: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if config.startswith("hf_"):
        return HFWrapper()
    if config.startswith("shared_"):
        return SharedBlocks()
    model = TinyLM(big="big" in config)
    if config.startswith(("lit_", "litwrap_")):
        import lightning.pytorch as pl

        class LitTiny(pl.LightningModule):
            def __init__(self, net: TinyLM) -> None:
                super().__init__()
                self.net = net

            def forward(self, tokens):
                return self.net(tokens)

            def param_groups(self):
                return self.net.param_groups()

        model = LitTiny(model)
        if config.startswith("litwrap_"):

            class Wrapper(torch.nn.Module):
                def __init__(self, inner):
                    super().__init__()
                    self._forward_module = inner

                def forward(self, tokens):
                    return self._forward_module(tokens)

                def param_groups(self):
                    return self._forward_module.param_groups()

            model = Wrapper(model)
    return model


def parse(config: str) -> tuple[int, str, str]:
    parts = config.split("_")
    stage_part = next(p for p in parts if p.startswith("s") and p[1:].isdigit())
    index = parts.index(stage_part)
    return int(stage_part[1:]), parts[index + 1], parts[index + 2]


def ds_config(config: str, out: Path) -> dict:
    stage, offload, dtype = parse(config)
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["sub_group_size"] = 2000  # several sub-groups per parameter group
        zero["stage3_param_persistence_threshold"] = 0
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    elif offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(out / f"nvme_{config}"), "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 1000000,
    }


def gathered(engine, stage: int) -> tuple[dict, dict]:
    """Full fp32 master weights (trainable) / module weights of every parameter, gathered on every rank."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    fp32, module_weights = {}, {}
    for name, param in engine.module.named_parameters():
        if stage == 3:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                module_weights[name] = param.detach().clone()
        else:
            module_weights[name] = param.detach().clone()
        master = safe_get_full_fp32_param(param) if param.requires_grad else None
        fp32[name] = master.detach().clone().float() if master is not None else module_weights[name].float()
    return fp32, module_weights


def run(config: str, out: Path, rank: int) -> None:
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    stage, offload, dtype = parse(config)
    model = build_model(config)
    groups = model.param_groups()
    if offload == "none":
        optimizer = torch.optim.AdamW(groups, lr=1e-2)
    else:
        optimizer = DeepSpeedCPUAdam(groups, lr=1e-2, adamw_mode=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(config, out))
    vocab = 61 if config.startswith("hf_") else 53
    steps = 3 if "mix" in config else 2
    target = out / config
    for step in range(steps):
        tokens = batch(step * 10 + rank, vocab=vocab)
        logits = engine(tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        tiny = getattr(engine.module, "net", engine.module)
        tiny = getattr(tiny, "_forward_module", tiny)
        tiny = getattr(tiny, "net", tiny)
        if hasattr(tiny, "seen_batches"):
            tiny.seen_batches += 1
        if "mix" in config and step == 1:
            engine.save_checkpoint(str(target), tag="step2")
    client_state = {}
    ckpt_dir, tag = target, f"step{steps}"
    if config.startswith(("lit_", "litwrap_")):
        ckpt_dir, tag = target / "epoch=0-step=2.ckpt", "checkpoint"
        client_state = {
            "epoch": 0,
            "global_step": steps,
            "hyper_parameters": {"lr": 0.01, "obj": UserHyperparameter(3)},
        }
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state)
    fp32, module_weights = gathered(engine, stage)
    if config.startswith("shared_"):  # what ZeroExport writes from the live engine, for comparison
        from lightspeed.core.checkpoint.live import export_engine

        export_engine(engine, target / "live_export")
    if rank == 0:
        state_dict = engine.module.state_dict()
        buffers = {name: buf.detach().clone() for name, buf in engine.module.named_buffers() if name in state_dict}
        torch.save(
            {
                "fp32": fp32,
                "module": module_weights,
                "buffers": buffers,
                "state_dict_keys": list(state_dict.keys()),
                "frozen": [n for n, p in engine.module.named_parameters() if not p.requires_grad],
                "world_size": dist.get_world_size(),
            },
            target / "reference.pt",
        )
        (target / "info.json").write_text(json.dumps({"checkpoint": str(ckpt_dir.relative_to(target)), "tag": tag}))
    dist.barrier()
    engine.destroy() if hasattr(engine, "destroy") else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("configs", nargs="+")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")  # before DeepSpeed, which otherwise may pick its shared-memory backend
    import deepspeed

    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    for config in args.configs:
        run(config, args.out, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
