"""A ZeroSession driven by a plain PyTorch loop, without Lightning (what any front end does, a Ray Train worker
included): one process over gloo, 4 steps of ZeRO stage STAGE, a checkpoint saved through the session, exported and
loaded into a fresh model. Writes OUT/result.json: the largest difference to the same steps with torch's AdamW, the
engine's step count, whether the checkpoint was committed, and what the session logged.

usage: session_alone.py OUT STAGE
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightspeed.core.zero.config import TrainingFacts
from lightspeed.core.zero.config.model_recipe import ModelRecipe
from lightspeed.core.zero.config.zero_recipe import ZeroTuning
from lightspeed.core.zero.session import ZeroSession
from lightspeed.export import export_checkpoint, load_exported


class OneProcess:
    """The one process of this job, as the session asks a front end's strategy for it."""

    world_size, node_rank, local_rank = 1, 0, 0  # read as the strategies' read-only properties
    num_nodes, num_processes, cluster_environment = 1, 1, None
    root_device = torch.device("cpu")

    def broadcast(self, obj: object, src: int = 0) -> object:
        return obj


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def main(out: Path, stage: int) -> None:
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model)
    logged: list[str] = []
    recipe = ModelRecipe(
        stage, "none", "none", nvme_path=None, user_config=None, tuning=ZeroTuning(), front_end="Fabric"
    )
    session = ZeroSession(
        recipe.config(),
        compile=None,
        activation_checkpointing_policy=None,
        node_local_storage=False,
        exclude_frozen_parameters=False,
        front_end="Fabric",
        info=logged.append,
    )
    session.check_before_launch("cpu", "32-true", OneProcess())
    session.start_process("cpu", OneProcess())
    dist.init_process_group("gloo", rank=0, world_size=1)
    facts = TrainingFacts(
        world_size=1,
        micro_batch_size=4,
        accumulate_grad_batches=1,
        gradient_clip_val=None,
        precision="32-true",
        hidden_size=16,
        front_end="Fabric",
    )
    session.log_config(session.resolve(session.config, facts))
    optimizer = session.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), None)
    engine, _, _ = session.build_engine(model, optimizer, None)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    inputs, targets = torch.randn(16, 8), torch.randn(16, 1)
    for step in range(4):
        x, y = inputs[4 * step : 4 * step + 4], targets[4 * step : 4 * step + 4]
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        reference_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
    session.save(
        engine,
        str(out / "ckpt"),
        {"note": "client state"},
        process=OneProcess(),
        progress={"global_step": int(engine.global_steps)},
    )
    export_checkpoint(out / "ckpt", out / "export")
    loaded = make_model()
    load_exported(loaded, out / "export")
    difference = max(
        (a - b).abs().max().item()
        for a, b in zip(loaded.state_dict().values(), reference.state_dict().values(), strict=True)
    )
    result = {
        "difference": difference,
        "global_steps": int(engine.global_steps),
        "committed": sorted(p.name for p in (out / "ckpt").iterdir()),
        "logged": logged,
    }
    (out / "result.json").write_text(json.dumps(result))
    session.end_process()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
