"""Model shapes users build every day, with the data and the single-process reference that the Trainer's and Fabric's
ZeRO runs of them are compared with: an ``nn.TransformerEncoder`` (it deep-copies its layer while it is built), an
MLP that its parent initialises again after building it (nanoGPT's ``self.apply(self._init_weights)``), a layer
some steps skip (no rank uses it in some windows or micro-batches), trained with AdamW and weight decay."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from _support.models import rank_batches

WIDTH, TOKENS, SAMPLES, BATCH, STEPS, LR = 8, 4, 32, 4, 4, 0.1


class EncoderRegressor(nn.Module):
    """Two encoder layers cloned from one by ``nn.TransformerEncoder``, mean-pooled, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(31)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


class ReinitializedMLP(nn.Module):
    """Layers initialised again by their parent once built, as nanoGPT and many hand-written models do: through
    ``self.apply``, a shape-reading ``torch.nn.init`` function, an in-place ``fill_``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(33)
        self.net = nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 5))
        self.apply(self._init_weights)
        nn.init.orthogonal_(self.net[0].weight)
        nn.init.kaiming_uniform_(self.net[2].weight, a=1.0)
        with torch.no_grad():
            self.net[2].bias.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            nn.init.zeros_(module.bias)


def assert_initialized_as_one_process(weights: dict[str, torch.Tensor], what: str) -> None:
    """``weights`` (gathered right after the build) equal ``ReinitializedMLP`` built in one plain process."""
    want = ReinitializedMLP().state_dict()
    assert sorted(weights) == sorted(want), what
    for key, expected in want.items():
        assert torch.equal(weights[key], expected), f"{what}: {key} was not initialised as in one process"


def encoder_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(32)
    return TensorDataset(
        torch.randn(SAMPLES, TOKENS, WIDTH, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
    )


def encoder_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD, not Adam: attention's key bias has a zero gradient up to rounding (softmax ignores a shift shared by all
    keys), which Adam would normalise into full-size steps that differ with the summation order."""
    return torch.optim.SGD(model.parameters(), lr=LR)


def encoder_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def encoder_steps() -> list[list[list[int]]]:
    """Per step, each of 2 ranks' sample indices, as the shuffled distributed sampler deals them in epoch 0."""
    return rank_batches(SAMPLES, 2, BATCH, epoch=0)[:STEPS]


def encoder_reference() -> dict[str, torch.Tensor]:
    """The encoder after ``STEPS`` steps in one plain process, each on both ranks' batches at once."""
    model = EncoderRegressor()
    optimizer = encoder_optimizer(model)
    x, y = encoder_data().tensors
    for ranks in encoder_steps():
        index = torch.tensor([i for rank in ranks for i in rank])
        optimizer.zero_grad()
        encoder_loss(model, x[index], y[index]).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_close(
    weights: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, initial: nn.Module, moved: str
) -> None:
    """Every tensor of ``want`` within 1e-5 of ``weights`` (same keys), and training moved ``moved`` away from its
    value in ``initial`` (the model as built, before training)."""
    assert sorted(weights) == sorted(want), what
    for key, expected in want.items():
        diff = (weights[key] - expected).abs().max().item()
        assert diff <= 1e-5, f"{what}: {key} differs from one process by {diff:.3e}"
    assert (want[moved] - initial.state_dict()[moved]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------- a layer some steps skip
#: per accumulation window, per micro-batch: whether the forward runs the skippable layer (on every rank alike)
USES_SKIPPABLE = [[True, True], [False, True], [False, False], [True, False]]
SKIP_BATCH, SKIP_LR, SKIP_WEIGHT_DECAY = 2, 0.05, 0.1
SKIP_STRATEGIES = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
#: the windows a run saves before it is resumed: the layer was skipped in the last one, used in the next
SAVED_WINDOWS = 3
#: a width whose gradient partitions DeepSpeed swaps to NVMe (over 1 MiB a rank), and an AdamW eps large enough at it
#: that reduction-order noise stays below 1e-5 in the weights
WIDE, WIDE_EPS = 1024, 0.1


class SometimesSkipped(nn.Module):
    """A layer the forward runs only when told: one process gives it no gradient, and AdamW leaves it (weights,
    moments, step count) alone."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        torch.manual_seed(34)
        self.inner, self.skippable, self.head = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, use_skippable: bool) -> torch.Tensor:
        hidden = torch.tanh(self.inner(x))
        if use_skippable:
            hidden = torch.tanh(self.skippable(hidden))
        return self.head(hidden)


def skip_data(width: int = WIDTH) -> TensorDataset:
    """2 ranks x 4 windows x 2 micro-batches x ``SKIP_BATCH`` samples."""
    generator = torch.Generator().manual_seed(35)
    n = 2 * len(USES_SKIPPABLE) * 2 * SKIP_BATCH
    return TensorDataset(torch.randn(n, width, generator=generator), torch.randn(n, 1, generator=generator))


def uses_skippable(batch_idx: int) -> bool:
    """Whether the micro-batch ``batch_idx`` of an epoch (windows of 2) runs the skippable layer."""
    return USES_SKIPPABLE[batch_idx // 2][batch_idx % 2]


def skip_optimizer(
    parameters: Iterable[nn.Parameter], optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, eps: float = 1e-8
) -> torch.optim.Optimizer:
    """AdamW with weight decay: one process neither decays a parameter without a gradient nor advances its step count
    (``eps``: large enough for a wide layer that reduction-order noise cannot flip a near-zero update). SGD: with
    momentum and weight decay, which a parameter without a gradient keeps out of too. Another class: with its defaults
    (to see what lightspeed says of it)."""
    if optimizer is torch.optim.AdamW:
        return torch.optim.AdamW(parameters, lr=SKIP_LR, weight_decay=SKIP_WEIGHT_DECAY, eps=eps)
    if optimizer is torch.optim.SGD:
        return torch.optim.SGD(parameters, lr=SKIP_LR, momentum=0.9, weight_decay=SKIP_WEIGHT_DECAY)
    return optimizer(parameters, lr=SKIP_LR)


def skip_reference(
    zero_gradient: bool = False,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    width: int = WIDTH,
    eps: float = 1e-8,
) -> dict[str, torch.Tensor]:
    """One plain process (AdamW, or ``optimizer_class`` as :func:`skip_optimizer` makes it), one step per window on
    both ranks' micro-batches (as the distributed sampler of a training dataloader deals them in epoch 0), each
    micro-batch's forward running the skippable layer or not; the window's loss is the mean over its samples.
    ``zero_gradient``: a parameter without a gradient gets a zero one before each step (what
    ``unused_parameters="zero_gradient"`` does). ``width``, ``eps``: the model's width and AdamW's ``eps``."""
    model = SometimesSkipped(width)
    optimizer = skip_optimizer(model.parameters(), optimizer_class, eps)
    x, y = skip_data(width).tensors
    micro_batches = rank_batches(len(x), 2, SKIP_BATCH, epoch=0)
    for window, uses in enumerate(USES_SKIPPABLE):
        optimizer.zero_grad(set_to_none=True)
        losses = []
        for micro, use in enumerate(uses):
            for rank_indices in micro_batches[window * 2 + micro]:
                index = torch.tensor(rank_indices)
                losses.append(nn.functional.mse_loss(model(x[index], use), y[index]))
        torch.stack(losses).mean().backward()
        for parameter in model.parameters():
            if zero_gradient and parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
