"""LoRA on a pretrained causal LM under ZeRO-3, shared by the Trainer's and Fabric's tests: a tiny Llama written as
pretrained files, the adapter config (q_proj/v_proj, gaussian init), the data, and the one-process reference the
ZeRO runs (2 CPU ranks) are compared with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from _support.models import rank_batches

VOCAB, SEQ, SAMPLES, BATCH, WORLD, STEPS, LR, EPS = 64, 8, 16, 2, 2, 4, 1e-2, 1e-3
LORA_SEED = 5  # the seed peft's initialisation of the adapters draws from, in every run


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )


def write_pretrained(path: Path) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    LlamaForCausalLM(llama_config()).save_pretrained(path)


def lora_config(target_modules: tuple[str, ...] = ("q_proj", "v_proj")) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=4, lora_alpha=8, target_modules=list(target_modules), init_lora_weights="gaussian", lora_dropout=0.0
    )


def lora_model(pretrained: Path, target_modules: tuple[str, ...] = ("q_proj", "v_proj")) -> Any:
    """``get_peft_model(from_pretrained(pretrained))``, the adapters drawn from :data:`LORA_SEED`."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(pretrained)
    torch.manual_seed(LORA_SEED)
    return get_peft_model(base, lora_config(target_modules))


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(3))


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over the trainable (adapter) parameters; ``eps`` large enough that reduction-order noise cannot flip a
    near-zero update."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)


def lm_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def reference(pretrained: Path, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """One plain process on the global batches (both ranks' micro-batches, each rank's loss averaged): every weight
    of the PEFT model after ``steps`` steps."""
    model = lora_model(pretrained)
    opt = optimizer(model)
    data = tokens()
    for step_batches in rank_batches(SAMPLES, WORLD, BATCH, epoch=0)[:steps]:
        loss = sum(lm_loss(model, data[indices]) for indices in step_batches) / WORLD
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def merged(pretrained: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What peft's ``merge_and_unload()`` makes of the PEFT model with ``state``: the base model's weights."""
    model = lora_model(pretrained)
    model.load_state_dict(state)
    return {key: value.detach().clone() for key, value in model.merge_and_unload().state_dict().items()}


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, expected in want.items():
        torch.testing.assert_close(got[key], expected, rtol=0, atol=1e-5, msg=lambda m, k=key: f"{what} {k}: {m}")


def loaded_adapter(pretrained: Path, adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The PEFT model ``PeftModel.from_pretrained`` builds from the pretrained base and an exported adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), adapter_dir)
    return {key: value.detach().clone() for key, value in model.state_dict().items()}
