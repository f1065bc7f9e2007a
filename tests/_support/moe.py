"""A tiny top-2 mixture-of-experts network whose ranks call different experts at every step, its data split by rank
and step, and the plain single-process training it must equal under ZeRO.

The routing is fixed by the data (hash routing): at step ``s`` rank ``r``'s tokens go to experts ``2r + s`` and
``2r + s + 1`` (mod 4), so the two ranks call disjoint pairs of experts, except at step ``SHARED_STEP``, where both
call experts 1 and 2 and no token reaches experts 0 and 3: one process's AdamW leaves those two alone in that step
(no decay, no moment update, their step count one behind afterwards). The router still weighs the two chosen
experts, so it trains too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

IN_FEATURES, DIM, OUT_FEATURES, EXPERTS, TOP_K = 5, 6, 3, 4, 2
WORLD, STEPS, BATCH = 2, 4, 4
LR, WEIGHT_DECAY = 1e-2, 0.01
SHARED_STEP = 1  # the step at which every rank routes to experts 1 and 2 (none to 0 and 3)


class SparseMoeBlock(nn.Module):
    """Router and ``experts`` (an ``nn.ModuleList``), called only for the experts some token of the batch picked, as
    HuggingFace's ``*SparseMoeBlock`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM)) for _ in range(EXPERTS)
        )

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.gate(x), dim=-1).gather(1, route)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows, slot = (route == index).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue  # no token of this batch picked this expert
            out = out.index_add(0, rows, weights[rows, slot, None] * expert(x[rows]))
        return x + out


class MoeNet(nn.Module):
    """Input projection, one MoE block, output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_FEATURES, DIM)
        self.moe = SparseMoeBlock()
        self.head = nn.Linear(DIM, OUT_FEATURES)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(torch.tanh(self.embed(x)), route))


def make_moe_net(seed: int = 0) -> MoeNet:
    """The network with deterministic initial weights (the global random state left as it was)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    net = MoeNet()
    torch.random.set_rng_state(state)
    return net


def experts_of(step: int, rank: int) -> list[int]:
    """The two experts rank ``rank``'s tokens go to at ``step``."""
    if step == SHARED_STEP:
        return [1, 2]
    first = 2 * rank + step
    return [first % EXPERTS, (first + 1) % EXPERTS]


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch at ``step``: inputs, routes (``BATCH x TOP_K`` expert indices), targets."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, IN_FEATURES, generator=gen)
    y = torch.randn(BATCH, OUT_FEATURES, generator=gen)
    pair = torch.tensor(experts_of(step, rank))
    route = torch.stack([pair if i % 2 == 0 else pair.flip(0) for i in range(BATCH)])
    return x, route, y


def rank_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every micro-batch rank ``rank`` trains on, in step order."""
    return [batch(step, rank) for step in range(STEPS)]


def loss(net: nn.Module, micro_batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, route, y = micro_batch
    return nn.functional.mse_loss(net(x, route), y)


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def reference() -> dict[str, torch.Tensor]:
    """One plain process: AdamW on each step's global batch (both ranks' micro-batches, equal sizes, so its mean loss
    is the mean of the ranks' losses that data-parallel averaging optimises)."""
    net = make_moe_net()
    opt = optimizer(net)
    for step in range(STEPS):
        parts = [batch(step, rank) for rank in range(WORLD)]
        global_batch = tuple(torch.cat([part[i] for part in parts]) for i in range(3))
        opt.zero_grad()
        loss(net, global_batch).backward()  # type: ignore[arg-type]
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def close(got: dict[str, torch.Tensor], tolerance: float = 1e-5) -> None:
    """``got`` (the network's weights) within ``tolerance`` of :func:`reference`, after training moved them."""
    want = reference()
    assert got.keys() == want.keys(), f"{sorted(got)} != {sorted(want)}"
    for key in want:
        diff = (got[key] - want[key]).abs().max().item()
        assert diff <= tolerance, f"{key}: {diff:.3e} off the single-process run"
    start = make_moe_net().state_dict()
    for index in range(EXPERTS):  # every expert trained
        key = f"moe.experts.{index}.0.weight"
        assert (want[key] - start[key]).abs().max() > 1e-3, key


def check_run(proc: Any, out: Path) -> None:
    """A run of a MoE worker script (``OUT/result.pt`` written, its output in ``proc``): the block was marked as a
    leaf module, logged once (rank 0), and the weights equal one process."""
    result = torch.load(out / "result.pt")
    assert result["leaf"]
    close(result["weights"])
    output = proc.stdout + proc.stderr
    assert output.count("ZeRO-3 leaf modules (mixture-of-experts blocks found") == 1  # rank 0 only
    assert "): SparseMoeBlock" in output
