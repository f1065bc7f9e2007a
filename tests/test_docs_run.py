"""Snippets are tests: every fenced Python block of README.md and docs/*.md runs.

A block runs as written, after the prelude that an HTML comment right before its fence names (invisible on the
rendered page, so readers see only the block):

    <!-- doc-test: prelude=NAME -->          the block runs in this process, after PRELUDES[NAME] (and its check)
    <!-- doc-test: script prelude=NAME -->   the block runs as a script of its own in a fresh process (a Trainer
                                             or Fabric with devices=2 launches its second process from it)
    <!-- doc-test: skip REASON -->          not run, for the REASON given (the page says it too)

A prelude defines the names a block uses without defining them (a model, a dataloader, a checkpoint to export) and
stays tiny (a few samples, one epoch). Its check, run after the block, asserts what the block's comments claim.
Blocks without a comment run as written, in this process. Every block runs in a fresh temporary directory. The
README's first block (the quick start) runs in tests/test_docs.py, which checks what it prints.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from _support.launch import REPO_ROOT, run_python

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->\s*$")

_TINY_CLASSIFIER = """
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return {"preds": self.net(x), "target": y}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Data(L.LightningDataModule):
    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 8, generator=generator), torch.randint(0, 10, (32,), generator=generator)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=4)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:14], self.y[:14]), batch_size=4)


model, datamodule = Classifier(), Data()
"""

_FABRIC_LOOP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 10)

    def forward(self, x):
        return self.net(x)


generator = torch.Generator().manual_seed(0)
inputs, labels = torch.randn(32, 8, generator=generator), torch.randint(0, 10, (32,), generator=generator)
samples = [{"ids": inputs[i], "labels": labels[i], "mask": torch.tensor(1)} for i in range(32)]
train_loader = DataLoader(samples, batch_size=2)
val_loader = DataLoader(TensorDataset(inputs[:14], labels[:14]), batch_size=4)


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
"""

#: name -> (code before the block, code after it: the check)
_TINY_LLAMA = """
import os
import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
import lightspeed

if "LOCAL_RANK" not in os.environ:  # the launching process writes the small "pretrained" model, before the launch
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained("checkpoints/tiny-llama")
ids = torch.randint(1, 32, (4, 40), generator=torch.Generator().manual_seed(0))
rows = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids]
"""

PRELUDES: dict[str, tuple[str, str]] = {
    "trainer": ("import lightning as L\nimport lightspeed\n", "assert trainer.strategy is not None\n"),
    "tiny_classifier": (
        _TINY_CLASSIFIER,
        "assert trainer.current_epoch == trainer.max_epochs, trainer.current_epoch\n",
    ),
    "fabric_loop": (
        _FABRIC_LOOP,
        """
import pathlib
assert pathlib.Path("out/last.ckpt").exists()
""",
    ),
    "export": (
        """
import lightning as L
import torch
from torch import nn
import lightspeed

torch.manual_seed(0)
trained = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
__import__("os").makedirs("checkpoints")
torch.save({"state_dict": trained.state_dict(), "epoch": 1, "global_step": 4}, "checkpoints/last.ckpt")
fresh_model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
""",
        """
assert all(torch.equal(a, b) for a, b in zip(fresh_model.state_dict().values(), trained.state_dict().values()))
""",
    ),
    "gather_by_hand": (
        """
import lightning as L
import torch
import lightspeed

logits, y = torch.randn(6, 10), torch.randint(0, 10, (6,))
token_ids, pad_id = torch.ones(6, 5, dtype=torch.long), 0
list_of_strings = ["a", "b"]
""",
        """
assert torch.equal(preds, logits.argmax(-1)) and torch.equal(ragged, token_ids) and names == list_of_strings
""",
    ),
    "exact_metrics": (
        """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
import lightspeed

torch.manual_seed(0)
model = nn.Linear(8, 10)
val_loader = DataLoader(TensorDataset(torch.randn(30, 8), torch.randint(0, 10, (30,))), batch_size=4)
""",
        """
x, y = val_loader.dataset.tensors
expected = MulticlassAccuracy(10)(model(x).argmax(-1), y)
assert torch.isclose(values["acc"], expected), (values, expected)
""",
    ),
    "plain_loop": (
        """
import torch
import torch.distributed as dist
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
import lightspeed

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
num_classes, model = 10, nn.Linear(8, 10)
val_set = TensorDataset(torch.randn(30, 8), torch.randint(0, 10, (30,)))
""",
        """
x, y = val_set.tensors
assert torch.isclose(acc.compute(), torchmetrics.classification.MulticlassAccuracy(num_classes)(model(x).argmax(-1), y))
dist.destroy_process_group()
""",
    ),
    "hf_module": (
        "import lightning as L\nimport lightspeed\nfrom transformers import AutoModelForCausalLM\n",
        "assert FineTune().configure_model is not None\n",
    ),
    "lora_module": (
        "import lightning as L\nimport torch\nimport lightspeed\nfrom transformers import AutoModelForCausalLM\n",
        "assert trainer.strategy.exclude_frozen_parameters == 'auto'\n",
    ),
    "load_pretrained": (
        """
import torch
from torch import nn
from safetensors.torch import save_file
import lightspeed


class MyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)


weights = {name: torch.full_like(tensor, 0.5) for name, tensor in MyNet().state_dict().items()}
__import__("os").makedirs("weights")
save_file(weights, "weights/model.safetensors")
""",
        """
module = type("Module", (), {})()
configure_model(module)
assert all(torch.equal(t, weights[n]) for n, t in module.net.state_dict().items())
""",
    ),
    "generation": (
        """
import types
import torch
from transformers import GPT2Config, GPT2LMHeadModel
import lightspeed

torch.manual_seed(0)
config = GPT2Config(vocab_size=32, n_positions=80, n_embd=16, n_layer=1, n_head=2, eos_token_id=None)
self = types.SimpleNamespace(model=GPT2LMHeadModel(config).eval())
ids = torch.randint(0, 32, (2, 4))
""",
        "assert out.shape == (2, 4 + 64), out.shape\n",
    ),
    "fabric_checkpoint": (
        """
import lightning as L
import torch
import lightspeed

fabric = L.Fabric(accelerator="cpu", devices=1)
model, optimizer = fabric.setup(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
""",
        """
assert lightspeed.fabric.last_checkpoint(fabric, "ckpts").name == "epoch-0.ckpt"
""",
    ),
    "buckets": (
        """
import torch
from torch.utils.data import DataLoader

pad_id = 0
dataset = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in (3, 100, 200)]


def hf_collator(samples):
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.stack([torch.nn.functional.pad(s["input_ids"], (0, width - len(s["input_ids"]))) for s in samples])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


batch = hf_collator(dataset[:2])
""",
        """
assert next(iter(loader))["input_ids"].shape == (3, 256)
assert batch["input_ids"].shape == (2, 128)
""",
    ),
    "recompilation_alarm": (  # torch_xla's compile counters stood in for (the XLA suite runs the real ones)
        """
from unittest import mock
import torch
import lightspeed

loader = [{"ids": torch.ones(2, 8)}, {"ids": torch.ones(2, 8)}, {"ids": torch.ones(2, 16)}]
compiles = iter([(1, 1), (2, 2), (2, 3), (3, 4), (3, 4)])
patches = [
    mock.patch("lightspeed.core.xla.recompilation._torch_xla_needed"),
    mock.patch("lightspeed.core.xla.recompilation.xla_compile_and_execute_counts", lambda: next(compiles)),
]
for patch in patches:
    patch.start()
""",
        "for patch in patches:\n    patch.stop()\n",
    ),
    "lightspeed": ("import lightspeed\n", ""),
    "notebook": (
        """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning as L
from lightspeed.callbacks import ZeroExport


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


generator = torch.Generator().manual_seed(0)
x = torch.randn(16, 4, generator=generator)
train_loader = val_loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
__import__("os").environ["PL_TRAINER_MAX_EPOCHS"] = "1"  # Trainer's default for the max_epochs the block leaves out
""",
        "assert __import__('pathlib').Path('export/model.safetensors').exists() or not trainer.is_global_zero\n",
    ),
    "resume": (
        _TINY_CLASSIFIER
        + "import lightspeed\nfrom lightning.pytorch.callbacks import ModelCheckpoint\n"
        + "__import__('os').environ['PL_TRAINER_MAX_EPOCHS'] = '1'  # for the max_epochs the block leaves out\n",
        "assert trainer.current_epoch == 1\n",
    ),
    "hf_fabric": (
        """
import os
import lightning as L
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
import lightspeed

if "LOCAL_RANK" not in os.environ:  # the launching process writes the small "pretrained" model, before the launch
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)).save_pretrained(
        "checkpoints/my-lm"
    )
""",
        """
ids = torch.randint(0, 32, (2, 8))
loss = model(input_ids=ids.to(fabric.device), labels=ids.to(fabric.device)).loss
fabric.backward(loss)
optimizer.step()
""",
    ),
    "long_context": (
        _TINY_LLAMA
        + """from lightspeed.strategies import ZeroStrategy

train_loader = DataLoader(rows, batch_size=2)
""",
        "assert trainer.global_step == 2 and trainer.strategy.world_size == 2\n",
    ),
    "long_context_metrics": (
        _TINY_LLAMA
        + """from lightspeed.strategies import ZeroStrategy


class LongContext(L.LightningModule):
    def configure_model(self):
        if getattr(self, "model", None) is None:
            self.model = AutoModelForCausalLM.from_pretrained("checkpoints/tiny-llama", attn_implementation="sdpa")


val_loader = DataLoader(rows[:3], batch_size=2)
""",
        "assert 0 <= float(metrics.results['validate']['val/token_acc']) <= 1\n",
    ),
    "long_context_fabric": (
        _TINY_LLAMA + "dataset = rows\n",
        "assert loss.isfinite() and batch['input_ids'].shape == (2, 20)\n",
    ),
    "several_models_fabric": (
        """
import lightning as L
import torch
from torch import nn
import lightspeed

torch.manual_seed(0)
generator, discriminator = nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
teacher = nn.Linear(2, 2).requires_grad_(False)
opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3)
noise, real, step = torch.randn(4, 2), torch.randn(4, 2), 1
""",
        "assert __import__('pathlib').Path('ckpt').is_dir()\n",
    ),
    "ray": (
        "import lightspeed\n" + _TINY_CLASSIFIER,
        """
import pathlib
assert result.error is None and [p.name for p in pathlib.Path("exported").iterdir()] == ["model.safetensors"]
""",
    ),
    "ray_fabric": (
        _FABRIC_LOOP,
        """
import json, pathlib
assert result.error is None
assert json.loads((pathlib.Path(result.checkpoint.path) / "state.ckpt" / "lightspeed_complete.json").read_text())[
    "world_size"
] == 2
""",
    ),
    "ds_config": (
        "import json\nimport lightspeed\n"
        'json.dump({"zero_optimization": {"overlap_comm": False}}, open("ds_config.json", "w"))\n',
        "assert strategy.config['zero_optimization']['overlap_comm'] is False\n",
    ),
    "activation_checkpointing": (
        "import lightning as L\nimport torch\nimport lightspeed\nfrom lightspeed.strategies import ZeroStrategy\n\n"
        "class Block(torch.nn.Module):\n    pass\n",
        "assert isinstance(fabric.strategy, lightspeed.fabric.ZeroFabricStrategy)\n",
    ),
}


class Block:
    """One fenced block: where it is, its text and the ``doc-test`` comment before it."""

    def __init__(self, path: Path, line: int, text: str, directive: str) -> None:
        self.path, self.line, self.text, self.directive = path, line, text, directive

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"

    @property
    def options(self) -> dict[str, str]:
        words = self.directive.split()
        return dict(word.split("=", 1) if "=" in word else (word, "") for word in words if not self.skip_reason)

    @property
    def skip_reason(self) -> str | None:
        return self.directive.removeprefix("skip").strip(" ,:") if self.directive.startswith("skip") else None


def python_blocks() -> list[Block]:
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        language, start, body = None, 0, []
        for number, line in enumerate(lines, 1):
            fence = _FENCE.match(line)
            if fence and language is None:
                language, start, body = fence.group(1), number, []
            elif line.startswith("```") and language is not None:
                if language == "python":
                    before = lines[start - 2] if start >= 2 else ""
                    directive = _DIRECTIVE.match(before)
                    found.append(Block(path, start, "\n".join(body), directive.group(1) if directive else ""))
                language = None
            elif language is not None:
                body.append(line)
    return found


BLOCKS = [b for b in python_blocks() if b.id != "README.md:" + str(python_blocks()[0].line)]  # the quick start


def _source(block: Block) -> str:
    prelude, check = PRELUDES.get(block.options.get("prelude", ""), ("", ""))
    return "\n".join([textwrap.dedent(prelude), block.text, textwrap.dedent(check)])


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_every_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.skip_reason is not None:
        assert block.skip_reason, f"{block.id}: a skipped block says why"
        pytest.skip(f"{block.id}: {block.skip_reason}")
    prelude = block.options.get("prelude")
    assert prelude is None or prelude in PRELUDES, f"{block.id}: no prelude {prelude!r} in PRELUDES"
    source = _source(block)
    if "script" in block.options:
        script = tmp_path / "block.py"
        script.write_text(source)
        run_python(script, cwd=tmp_path, timeout=300)
        return
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    exec(compile(source, f"<{block.id}>", "exec"), namespace)


def test_every_skipped_block_says_why_on_the_page() -> None:
    """The reason of a skip is visible to readers too: the page says it within the paragraph before the block."""
    for block in python_blocks():
        if block.skip_reason is None:
            continue
        lines = block.path.read_text().splitlines()[: block.line - 2]
        paragraph = " ".join(lines[-6:]).lower()
        key = block.skip_reason.split(";")[0].lower()
        assert key in paragraph, f"{block.id}: the page does not say {key!r} before the block"
