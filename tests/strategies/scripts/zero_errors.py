"""Worker: provoke the setup-time errors of ZeroStrategy in one process and record each message (type: text).

usage: zero_errors.py OUT [TINY_DIR]   (TINY_DIR: a directory on a filesystem too small for NVMe offload)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import lightspeed  # noqa: F401
from _support.models import RegressionModule, make_regression_data
from _support.trainers import quiet_trainer
from lightspeed.strategies import ZeroStrategy


def attempt(strategy, module, **trainer_kwargs) -> str:
    trainer = quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=1,
        enable_model_summary=True,
        **trainer_kwargs,
    )
    try:
        trainer.fit(module, DataLoader(make_regression_data(), batch_size=4))
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return "no error"


class SparseAdamModule(RegressionModule):
    def configure_optimizers(self):
        return torch.optim.SparseAdam(self.parameters(), lr=1e-3)


class Float64Module(RegressionModule):
    """A parameter kept in float64 on purpose (refused at setup, before any forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].bias = torch.nn.Parameter(self.net[0].bias.detach().double())


class ScalarParameterModule(RegressionModule):
    """A 0-dimensional parameter (as CLIP's logit_scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.net(x) * self.logit_scale


class NanoGPTSplitModule(RegressionModule):
    """nanoGPT's weight-decay split by `p.dim()`, on a model built in configure_model (ZeRO-3 partitions there)."""

    def __init__(self) -> None:
        super().__init__()
        del self.net

    def configure_model(self) -> None:
        self.net = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-3)


def main() -> None:
    out = Path(sys.argv[1])
    results = {
        "two_optimizers": attempt("zero2", RegressionModule(optimizer="two")),
        "sgd_offload": attempt("zero2_offload", RegressionModule(optimizer="sgd")),
        "sparse_adam_offload": attempt("zero2_offload", SparseAdamModule()),
        "float64_parameter": attempt("zero2", Float64Module()),
        "scalar_parameter": attempt("zero3", ScalarParameterModule()),
        "shape_split_under_zero3": attempt("zero3", NanoGPTSplitModule()),
        "mismatch": attempt(
            ZeroStrategy(stage=2, config={"gradient_accumulation_steps": 8, "gradient_clipping": 0.5}),
            RegressionModule(),
            accumulate_grad_batches=4,
            gradient_clip_val=1.0,
        ),
    }
    if len(sys.argv) > 2:  # a directory on a filesystem far too small for the model's NVMe offload
        results["nvme_too_small"] = attempt(
            ZeroStrategy(stage=3, offload_optimizer="nvme", offload_parameters="nvme", nvme_path=sys.argv[2]),
            RegressionModule(),
        )
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
