"""Worker: a pretrained HuggingFace causal LM under ZeRO-3 (2 ranks), built with ``from_pretrained`` inside
``configure_model`` (Trainer) or ``fabric.init_module()`` (Fabric), then greedy generation where the ranks stop at
different steps (rank r generates ``NEW_TOKENS[r]`` tokens), without ``synced_gpus``.

A plain ``nn.Module`` built in the same place gets ``lightspeed.load_pretrained(module, directory)``: a good
directory, and one with a missing tensor, an extra tensor and a tensor of another shape.

usage: zero_pretrained_generation.py OUT FRONT_END   (FRONT_END: trainer | fabric)
OUT/pretrained holds the pretrained model (sharded safetensors with an index; the test writes it with
``write_pretrained``), OUT/plain and OUT/plain_bad the plain module's weights (``write_plain``).
Rank 0 writes OUT/<front_end>.json: per rank the generated tokens (validation and predict), whether the weights were
partitioned when built, the largest number of parameter elements the rank held, and whether the gathered weights equal
the files (HF model and plain module), the tokens generated inside ``lightspeed.gathered_for_generation``; the errors
of ``generate(synced_gpus=False)`` and of loading the bad directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed
from _support.models import make_net
from _support.trainers import quiet_trainer

NEW_TOKENS = (2, 6)  # per rank: the ranks stop generating at different steps
PROMPTS = torch.tensor([[5, 9, 13], [7, 2, 40]])


def tiny_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=61, n_positions=16, n_embd=20, n_layer=2, n_head=2, tie_word_embeddings=True)


def write_pretrained(path: Path) -> None:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(11)
    GPT2LMHeadModel(tiny_config()).save_pretrained(path, max_shard_size="20KB")  # several shards and an index


def write_plain(out: Path) -> None:
    """The plain module's weights as two safetensors shards with an index, and a directory that does not fit it."""
    from safetensors.torch import save_file

    weights = make_net(seed=9).state_dict()
    for folder, tensors in (
        ("plain", weights),
        (
            "plain_bad",
            {
                "0.weight": torch.zeros(37, 14),  # another shape
                "0.bias": weights["0.bias"],
                "2.weight": weights["2.weight"],  # 2.bias missing
                "3.weight": torch.zeros(2),  # not in the model
            },
        ),
    ):
        (out / folder).mkdir(parents=True)
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
        for file, keys in shards.items():
            save_file({key: tensors[key].contiguous() for key in keys}, out / folder / file)
        weight_map = {key: file for file, keys in shards.items() for key in keys}
        (out / folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )


def files_of(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def inspect_model(model: torch.nn.Module, path: Path) -> dict[str, Any]:
    """Partitioned? Largest local size? Do the gathered weights equal the files?"""
    import deepspeed

    params = list(model.parameters())
    local = sum(p.numel() for p in params)  # under ZeRO-3 each parameter is an empty placeholder here
    partition = sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_tensor"))
    full = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params)
    files = files_of(path)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    equal = {name: torch.equal(state[name], tensor) for name, tensor in files.items() if name in state}
    return {
        "partitioned": all(hasattr(p, "ds_id") for p in params),
        "local_elements": local,
        "partition_elements": partition,
        "full_elements": full,
        "equal_files": all(equal.values()) and len(equal) == len(files),
        "compared": len(equal),
    }


def generate(model: Any, rank: int, **kwargs: Any) -> list[int]:
    out = model.generate(
        PROMPTS[rank : rank + 1],
        attention_mask=torch.ones_like(PROMPTS[rank : rank + 1]),
        max_new_tokens=NEW_TOKENS[rank],
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
    return out[0].tolist()


def zero_hooks(module: torch.nn.Module) -> int:
    """How many of DeepSpeed's ZeRO-3 module hooks ``module``'s modules carry."""
    from lightspeed.core.zero.generation import _is_zero_hook

    return sum(
        _is_zero_hook(hook)
        for sub in module.modules()
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks)
        for hook in hooks.values()
    )


def counting_collectives() -> tuple[list[str], Any]:
    """A list that records every torch.distributed collective called until ``restore()`` (the second value)."""
    import torch.distributed as dist

    calls: list[str] = []
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "reduce_scatter_tensor")
    originals = {name: getattr(dist, name) for name in names}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counted(name))
    return calls, lambda: [setattr(dist, name, original) for name, original in originals.items()]


def generate_gathered(model: Any, rank: int, enabled: bool | str) -> dict[str, Any]:
    """Generation inside ``lightspeed.gathered_for_generation``: without DeepSpeed's module hooks and without any
    collective; the parameters are partitioned again and the hooks back afterwards. A forward pass with gradients
    inside is refused."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    module = getattr(model, "module", model)
    hooks = [zero_hooks(module)]
    with lightspeed.gathered_for_generation(module, enabled=enabled) as gathered:
        hooks.append(zero_hooks(module))
        calls, restore = counting_collectives()
        try:
            tokens = generate(model, rank)
        finally:
            restore()
        with torch.enable_grad():
            with_grad = error_of(lambda: module(PROMPTS[rank : rank + 1]))
    hooks.append(zero_hooks(module))
    released = all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in module.parameters())
    return {
        "tokens": tokens,
        "gathered": gathered,
        "partitioned_after": released,
        "collectives_inside": calls,
        "zero_hooks": hooks,
        "with_grad": with_grad,
    }


def error_of(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test compares type and message
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": None}


class GeneratingModule(L.LightningModule):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.facts: dict[str, Any] = {}

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(self.path)
        self.facts["built"] = inspect_model(self.model, self.path)
        self.plain = make_net(seed=0)
        lightspeed.load_pretrained(self.plain, self.path.parent / "plain")
        self.facts["plain"] = inspect_model(self.plain, self.path.parent / "plain")
        self.facts["plain_bad"] = error_of(
            lambda: lightspeed.load_pretrained(self.plain, self.path.parent / "plain_bad")
        )

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.facts["validation"] = generate(self.model, self.global_rank)
        self.facts["gathered"] = generate_gathered(self.model, self.global_rank, "auto")

    def predict_step(self, batch: Any, batch_idx: int) -> list[int]:
        self.facts["predict"] = generate(self.model, self.global_rank)
        self.facts["synced_gpus_false"] = error_of(lambda: generate(self.model, self.global_rank, synced_gpus=False))
        return self.facts["predict"]


def run_trainer(path: Path) -> dict[str, Any]:
    module = GeneratingModule(path)
    trainer = quiet_trainer(
        strategy="zero3",
        accelerator="cpu",
        devices=2,
    )
    one_batch = DataLoader(TensorDataset(torch.zeros(2, 1)), batch_size=1)
    trainer.validate(module, one_batch)
    trainer.predict(module, one_batch)
    return module.facts


def run_fabric(path: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    fabric = L.Fabric(strategy="zero3", accelerator="cpu", devices=2)
    fabric.launch()
    with fabric.init_module():
        model = AutoModelForCausalLM.from_pretrained(path)
        plain = make_net(seed=0)
    facts: dict[str, Any] = {"built": inspect_model(model, path)}
    lightspeed.load_pretrained(plain, path.parent / "plain")
    facts["plain"] = inspect_model(plain, path.parent / "plain")
    facts["plain_bad"] = error_of(lambda: lightspeed.load_pretrained(plain, path.parent / "plain_bad"))
    model = fabric.setup_module(model)  # inference only: no optimizer
    model.mark_forward_method("generate")
    facts["validation"] = generate(model, fabric.global_rank)
    facts["gathered"] = generate_gathered(model, fabric.global_rank, True)
    facts["synced_gpus_false"] = error_of(lambda: generate(model, fabric.global_rank, synced_gpus=False))
    return facts


def main(out: Path, front_end: str) -> None:
    path = out / "pretrained"
    facts = run_trainer(path) if front_end == "trainer" else run_fabric(path)
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, facts)
    if torch.distributed.get_rank() == 0:
        (out / f"{front_end}.json").write_text(json.dumps(gathered, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
