"""Sequence parallelism on a tiny pretrained Llama, shared by the Trainer's and Fabric's tests: the pretrained files,
right-padded batches whose prompts are masked out of the labels (``-100``), and the one-process reference on the whole
sequences that every sequence-parallel run must equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from _support.models import rank_batches

VOCAB, SEQ, SAMPLES, BATCH, LR, EPS = 64, 31, 8, 2, 1e-3, 1e-3
PROMPT = 3  # the first tokens of every row are a prompt: label -100


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    settings: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return LlamaConfig(**{**settings, **overrides})


def write_pretrained(path: Path, **overrides: Any) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    LlamaForCausalLM(llama_config(**overrides)).save_pretrained(path)


def load(pretrained: Path, attn_implementation: str = "sdpa", lora: bool = False) -> Any:
    """The pretrained model (``lora``: with LoRA adapters on the attention's query and value projections, drawn from
    one seed, every other weight frozen)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pretrained, attn_implementation=attn_implementation)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    return get_peft_model(model, config)


class PaddedTokens(Dataset):
    """Rows of 8 to :data:`SEQ` real tokens, right-padded with 0, as a HuggingFace collator makes them."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, VOCAB, (SAMPLES, SEQ), generator=generator)
        lengths = torch.randint(8, SEQ + 1, (SAMPLES,), generator=generator)
        self.mask = (torch.arange(SEQ) < lengths[:, None]).long()
        self.ids = self.ids * self.mask
        self.labels = self.ids.masked_fill(self.mask == 0, -100)
        self.labels[:, :PROMPT] = -100

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index], "labels": self.labels[index]}


def collate(data: PaddedTokens, rows: list[int]) -> dict[str, torch.Tensor]:
    """The batch of ``data``'s ``rows``, as the default collate makes it."""
    return {key: torch.stack([data[i][key] for i in rows]) for key in ("input_ids", "attention_mask", "labels")}


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)


def reference(
    pretrained: Path,
    data_parallel: int,
    steps: int,
    accumulate: int = 1,
    clip: float | None = None,
    lora: bool = False,
) -> dict[str, torch.Tensor]:
    """One plain process on whole sequences: each step's loss is the mean of the token-mean losses of the
    micro-batches every data-parallel rank trains on in the step's window (as data parallelism averages them); the
    gradient's norm clipped to ``clip`` when given."""
    model = load(pretrained, lora=lora)
    opt = optimizer(model)
    data = PaddedTokens()
    micro_batches = rank_batches(SAMPLES, data_parallel, BATCH, epoch=0)
    for step in range(steps):
        window = micro_batches[step * accumulate : (step + 1) * accumulate]
        losses = [model(**collate(data, rows)).loss for ranks in window for rows in ranks]
        opt.zero_grad()
        (sum(losses) / len(losses)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def token_metrics() -> dict[str, Any]:
    """Metrics over per-token predictions ``[rows, positions]`` and targets (-100: not a target): token accuracy
    (torchmetrics) and the counts behind it (a plain callable, so a doubled or cut sequence shows)."""
    from torchmetrics.classification import MulticlassAccuracy

    accuracy = MulticlassAccuracy(VOCAB, ignore_index=-100, average="micro", multidim_average="global")
    return {"acc": accuracy, "n": _token_counts}


def token_scores(model: torch.nn.Module, rows: int = SAMPLES) -> dict[str, float]:
    """:func:`token_metrics` of ``model`` on the first ``rows`` of :class:`PaddedTokens` in one plain process, by
    logged name."""
    data = PaddedTokens()
    batch = collate(data, list(range(rows)))
    with torch.no_grad():
        preds = model(**batch).logits.argmax(-1)
    target = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    counts = {name: int(value) for name, value in _token_counts(preds, target).items()}
    return {"acc": counts["hits"] / counts["tokens"], **{f"n/{name}": value for name, value in counts.items()}}


def _token_counts(preds: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Hits, real targets, positions per row and an order-sensitive checksum of predictions and targets."""
    real = target != -100
    return {
        "hits": (preds[real] == target[real]).sum(),
        "tokens": real.sum(),
        "positions": torch.tensor(preds.shape[1]),
        "checksum": _checksum(preds.masked_fill(~real, -1)) + 1000 * _checksum(target),
    }


def _checksum(values: torch.Tensor) -> torch.Tensor:
    """Every value weighted by its place: another order, a lost or doubled row gives another sum (exact in float64).
    Predictions count only at real targets: after a row's last token, sequence parallelism attends over the pads
    (one process masks them), and nothing is scored there."""
    weights = torch.arange(1, values.numel() + 1, dtype=torch.int64).view(values.shape)
    return (values.to(torch.int64) * weights).sum()


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, expected in want.items():
        torch.testing.assert_close(got[key], expected, rtol=0, atol=1e-5, msg=lambda m, k=key: f"{what} {k}: {m}")
