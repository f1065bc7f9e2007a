"""Parameters no rank used in an optimizer step are left as one plain process leaves them.

In one process a parameter without a gradient (a layer skipped in a step, a head the step did not choose, an expert
no token reached) is skipped by the optimizer: AdamW neither decays it nor moves its moments, and the parameter's own
step count, which Adam's bias correction reads, does not advance. Under ZeRO each rank's optimizer steps flat
partitions holding pieces of many parameters, with one step count each, and every parameter in them has a gradient
(a zero one where unused, see :mod:`~lightspeed.core.zero.stale_gradients`): momentum, weight decay and Adam's moments
would move it.

:class:`UnusedParameters` (``unused_parameters="skip"``, the default) makes every step what one process does:

* a gradient hook on every trained parameter notes which ones received a gradient in the accumulation window; before
  the step the ranks agree on the union (one all-reduce of one byte per parameter);
* around the inner optimizer's step on a flat partition, the slices of the parameters no rank used (weights, and every
  optimizer state of the partition's shape) are kept and put back afterwards;
* under Adam (torch's Adam and AdamW, DeepSpeed's CPU and fused Adam) a parameter skipped in earlier steps has its own,
  smaller step count: its slice is stepped again from the kept values with that count, by torch's own Adam function.

How many steps each parameter was skipped is saved in the engine's checkpoints (its client state) and loaded back.
Optimizers whose update reads no step count (SGD without dampening, RMSprop, Adagrad without learning-rate decay,
Adadelta, DeepSpeed's CPU Adagrad) need only the first two. With any other optimizer the first step that leaves a
parameter unused raises on every rank, before anything is stepped. ``unused_parameters="zero_gradient"`` installs
none of this: a zero-gradient step, ZeRO's own behaviour.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.adam import adam

from lightspeed.core.common.distributed import global_rank
from lightspeed.core.common.logs import logger
from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.leaf_modules import moe_blocks

__all__ = ["MODES", "SKIPPED_STEPS_KEY", "UnusedParameters", "check_unused_parameters_mode", "leave_unused_parameters"]

MODES = ("skip", "zero_gradient")
#: the engine client-state key of the skipped-step counts (parameter name -> steps it was skipped)
SKIPPED_STEPS_KEY = "lightspeed_skipped_steps"
_NAMED = 5  # unused parameters named in an error


def check_unused_parameters_mode(mode: object, owner: str) -> str:
    """``mode`` if it is one of :data:`MODES`; otherwise a ``ValueError`` naming ``owner``'s argument."""
    if mode not in MODES:
        raise ValueError(
            f"{owner}(unused_parameters={mode!r}) is not an option: 'skip' (default) leaves the parameters no rank "
            "used in a step, and their optimizer state, as one process leaves them; 'zero_gradient' gives them a "
            "step on a zero gradient (ZeRO's own behaviour)."
        )
    return str(mode)


def leave_unused_parameters(engine: Any, optimizer: Any, module: torch.nn.Module, mode: str) -> None:
    """Install :class:`UnusedParameters` on ``optimizer`` (the ZeRO optimizer of ``engine``, which trains ``module``):
    every gradient reduced on every rank (:meth:`UnusedParameters.reduce_every_gradient`); under ``mode="skip"`` the
    unused parameters left alone, also across the engine's checkpoints. Nothing for an optimizer that is not ZeRO's."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    stage3 = isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)
    if not (stage3 or isinstance(optimizer, DeepSpeedZeroOptimizer)) or (stage3 and mode != "skip"):
        return  # not ZeRO's; or ZeRO-3, whose reduction needs nothing, under "zero_gradient"
    tracker = UnusedParameters(optimizer, module, skip=mode == "skip")
    tracker.reduce_every_gradient(engine)
    if mode == "skip":
        tracker.attach_to_checkpoints(engine)


@dataclass(frozen=True)
class _Fragment:
    """The piece of one parameter in a flat partition of this rank."""

    index: int  # the parameter's position in the ZeRO optimizer's order
    start: int
    numel: int


@dataclass
class _Kept:
    """A fragment's values before the inner step: weights, optimizer states by key, and (to step again) gradient."""

    fragment: _Fragment
    weights: torch.Tensor
    states: dict[str, torch.Tensor] = field(default_factory=dict)
    gradient: torch.Tensor | None = None


class UnusedParameters:
    """Leaves the parameters no rank used in a step as one process does (see the module docstring).

    Args:
        optimizer: DeepSpeed's ZeRO optimizer (stage 1, 2 or 3), already built.
        module: the model it trains, for the parameters' names.
        skip: leave the unused parameters alone (False: only note which parameters each rank used, for
            :meth:`reduce_every_gradient`).
    """

    def __init__(self, optimizer: Any, module: torch.nn.Module, skip: bool = True) -> None:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        self._optimizer = optimizer
        self._module = module
        self._stage3 = isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)
        groups = optimizer.fp16_groups if self._stage3 else optimizer.bit16_groups
        self._params: list[torch.nn.Parameter] = [param for group in groups for param in group]
        names = {id(param): name for name, param in module.named_parameters()}
        self.names = [names.get(id(param), f"parameter {index}") for index, param in enumerate(self._params)]
        #: steps each parameter (by name) was skipped since training began; saved with checkpoints
        self.skipped: dict[str, int] = {}
        self._used = bytearray(len(self._params))  # in the window
        self._used_in_backward = bytearray(len(self._params))  # since the last reduction (ZeRO-2 reduces each one)
        self._unused: frozenset[int] = frozenset()
        self._window_counts: torch.Tensor | None = None  # ranks using each parameter, counted by ZeRO-1's reduction
        self._fragments: dict[int, list[_Fragment]] = {}  # by flat partition (its group's index)
        for index, param in enumerate(self._params):
            previous = getattr(param, "_lightspeed_use_hook", None)
            if previous is not None:
                previous.remove()  # an earlier engine's tracker of the same parameter
            param._lightspeed_use_hook = param.register_hook(self._note_use(index))  # type: ignore[attr-defined]
        self._skip = skip
        if skip:
            self._wrap_step()
            for inner in (optimizer.optimizer, getattr(optimizer, "backup_optimizer", None)):
                if inner is not None:
                    self._wrap_inner_step(inner)

    # ------------------------------------------------------------------------------------------- which are unused
    def _note_use(self, index: int) -> Callable[[torch.Tensor], None]:
        used, used_in_backward = self._used, self._used_in_backward

        def note(_: torch.Tensor) -> None:
            used[index] = used_in_backward[index] = 1

        return note

    def _ranks_using(self, used: bytearray) -> torch.Tensor:
        """Per parameter, how many ranks of the optimizer's data-parallel group used it (a collective)."""
        counts = torch.tensor(list(used), dtype=torch.int32)
        if _distributed():
            from deepspeed.accelerator import get_accelerator

            counts = counts.to(get_accelerator().current_device_name())
            torch.distributed.all_reduce(counts, group=self._optimizer.dp_process_group)
        return counts.cpu()

    def _agree_unused(self) -> frozenset[int]:
        """The parameters no rank of the optimizer's data-parallel group used since the last step (a collective,
        unless ZeRO-1's reduction counted them already in this window)."""
        counts, self._window_counts = self._window_counts, None
        if counts is None:
            counts = self._ranks_using(self._used)
        return frozenset(int(i) for i in (counts == 0).nonzero().flatten().tolist())

    def reduce_every_gradient(self, engine: Any) -> None:
        """ZeRO-1/2 sum each parameter's gradient over the ranks that have one, matched by position: a parameter some
        ranks used and others did not (ranks routing to different experts, skipping different layers) shifts what is
        added to what, silently. ZeRO-1 reduces at the window's end, parameter by parameter in a fixed order: a zero
        gradient for every parameter some rank used and this one did not makes every rank reduce the same list (one
        no rank used is left out on every rank). ZeRO-2 (and ZeRO-1 with ``overlap_comm``, ``contiguous_gradients``
        or a gradient accumulation dtype of its own) reduce in the order gradients arrive, during the backward: after
        each backward the ranks compare which parameters they used, and a difference is an error on every rank before
        anything is stepped."""
        optimizer, skip = self._optimizer, self._skip
        if self._stage3:
            return
        if not optimizer._grad_acc_hooks:
            reduce = optimizer.reduce_gradients

            def reduce_gradients(*args: Any, **kwargs: Any) -> Any:
                self._window_counts = counts = self._ranks_using(self._used)
                if not skip:  # no step reads (and resets) the window's uses
                    self._used[:] = bytes(len(self._used))
                for index in (counts > 0).nonzero().flatten().tolist():  # no rank reduces what none used
                    param = self._params[index]
                    if optimizer.get_gradient_for_reduction(param) is None:
                        param.grad = torch.zeros_like(param)
                return reduce(*args, **kwargs)

            optimizer.reduce_gradients = reduce_gradients
            return
        blocks = moe_blocks(self._module)
        if blocks and global_rank() == 0:
            logger.warning(
                f"lightspeed: {', '.join(blocks)}: mixture-of-experts blocks under ZeRO-"
                f"{optimizer.partition_gradients + 1}, which reduces gradients in the order they arrive: a backward in "
                "which the ranks' tokens reach different experts will be an error. ZeRO-1 without optimizer offload "
                "and ZeRO-3 train such blocks exactly."
            )
        allreduce = engine.allreduce_gradients

        def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
            self._check_same_use()
            return allreduce(*args, **kwargs)

        engine.allreduce_gradients = allreduce_gradients

    def _check_same_use(self) -> None:
        counts = self._ranks_using(self._used_in_backward)
        self._used_in_backward[:] = bytes(len(self._used_in_backward))
        world = torch.distributed.get_world_size(self._optimizer.dp_process_group) if _distributed() else 1
        partly = [self.names[i] for i in ((counts > 0) & (counts < world)).nonzero().flatten().tolist()]
        if partly:
            shown = _named(partly)
            raise DeepSpeedConfigError(
                f"Some ranks used {shown} in this backward and others did not (ranks whose tokens reach different "
                f"experts, or that skip different layers). This ZeRO-{self._optimizer.partition_gradients + 1} run "
                "reduces gradients in the order they arrive during the backward, so these sums would be wrong. Use "
                "ZeRO-1 without optimizer offload (lightspeed reduces every parameter at the window's end in a fixed "
                "order, with a zero gradient where a rank has none) or ZeRO-3 (mixture-of-experts blocks are marked "
                "as leaf modules)."
            )

    def _wrap_step(self) -> None:
        optimizer = self._optimizer
        step = optimizer.step

        def step_leaving_unused_parameters(*args: Any, **kwargs: Any) -> Any:
            self._unused = self._agree_unused()
            try:
                if self._unused:
                    self._check_supported()
                result = step(*args, **kwargs)
                if not getattr(optimizer, "overflow", False):
                    for index in self._unused:
                        name = self.names[index]
                        self.skipped[name] = self.skipped.get(name, 0) + 1
                return result
            finally:
                self._unused = frozenset()
                self._used[:] = bytes(len(self._used))

        optimizer.step = step_leaving_unused_parameters

    def _check_supported(self) -> None:
        """Every rank knows the same unused parameters and optimizer: all raise, or none."""
        inner = self._optimizer.optimizer
        for group in inner.param_groups:
            if _rule(inner, group) is None:
                names = sorted(self.names[index] for index in self._unused)
                shown = _named(names)
                raise DeepSpeedConfigError(
                    f"No rank used {shown} in this step (a layer skipped, a head not chosen, an expert no token "
                    f"reached). One process leaves such parameters and their optimizer state as they are; under ZeRO "
                    f"lightspeed does the same for SGD (without dampening), RMSprop, Adagrad (without lr_decay), "
                    f"Adadelta, Adam and AdamW, but not for {type(inner).__name__}"
                    f"{_unsupported_reason(inner, group)}. Use one of those optimizers, or pass "
                    "unused_parameters='zero_gradient' to the ZeRO strategy to give unused parameters a step on a "
                    "zero gradient (not what one process does)."
                )

    # -------------------------------------------------------------------------------------- around the inner step
    def _wrap_inner_step(self, inner: torch.optim.Optimizer) -> None:
        step = inner.step

        def step_leaving_unused_parameters(*args: Any, **kwargs: Any) -> Any:
            if not self._unused and not self.skipped:
                return step(*args, **kwargs)
            with torch.no_grad():
                kept = {id(flat): self._keep(inner, group, flat) for group, flat in _stepped(inner)}
            result = step(*args, **kwargs)
            with torch.no_grad():
                for group in inner.param_groups:
                    for flat in group["params"]:
                        for entry in kept.get(id(flat), []):
                            self._put_back(inner, group, flat, entry)
            return result

        inner.step = step_leaving_unused_parameters  # type: ignore[method-assign]

    def _keep(self, inner: torch.optim.Optimizer, group: dict[str, Any], flat: torch.Tensor) -> list[_Kept]:
        """The fragments of ``flat`` (of ``group``) to put back after the step: those unused now, and under Adam
        those used now but skipped before (stepped again with their own step count)."""
        kept = []
        state = inner.state.get(flat, {})
        again = _rule(inner, group) == "adam"
        for fragment in self._fragments_of(flat):
            unused = fragment.index in self._unused
            if not unused and not (again and self.skipped.get(self.names[fragment.index])):
                continue
            entry = _Kept(fragment, _slice(flat, fragment).clone())
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == flat.shape:
                    entry.states[key] = _slice(value, fragment).clone()
            if not unused:
                assert flat.grad is not None
                entry.gradient = _slice(flat.grad, fragment).clone()
            kept.append(entry)
        return kept

    def _put_back(self, inner: torch.optim.Optimizer, group: dict[str, Any], flat: torch.Tensor, entry: _Kept) -> None:
        state = inner.state[flat]
        _slice(flat, entry.fragment).copy_(entry.weights)
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == flat.shape:
                before = entry.states.get(key)
                if before is None:  # created by this (first) step: as if it had been created as zeros
                    _slice(value, entry.fragment).zero_()
                else:
                    _slice(value, entry.fragment).copy_(before)
        if entry.gradient is not None:  # kept to be stepped again (Adam)
            skipped = self.skipped[self.names[entry.fragment.index]]
            _step_adam_again(inner, group, flat, entry, _step_count(inner, group, flat) - skipped)

    def _fragments_of(self, flat: torch.Tensor) -> list[_Fragment]:
        optimizer = self._optimizer
        flats = optimizer.fp32_partitioned_groups_flat if self._stage3 else optimizer.single_partition_of_fp32_groups
        for group_index, candidate in enumerate(flats):
            if candidate is flat:
                if group_index not in self._fragments:
                    self._fragments[group_index] = self._find_fragments(group_index)
                return self._fragments[group_index]
        return []

    def _find_fragments(self, group_index: int) -> list[_Fragment]:
        index_of = {id(param): index for index, param in enumerate(self._params)}
        optimizer = self._optimizer
        if self._stage3:
            fragments = []
            for param in optimizer.fp16_groups[group_index]:
                _, start, numel = optimizer.grad_position[optimizer.get_param_id(param)]
                fragments.append(_Fragment(index_of[id(param)], start, numel))
            return fragments
        addresses = [
            (param, param._hp_mapping.hp_fragment_address)
            for param in optimizer.bit16_groups[group_index]
            if getattr(param, "_hp_mapping", None) is not None
        ]
        return [_Fragment(index_of[id(param)], address.start, address.numel) for param, address in addresses]

    # ----------------------------------------------------------------------------------------------- checkpoints
    def attach_to_checkpoints(self, engine: Any) -> None:
        """Save :attr:`skipped` in ``engine``'s checkpoints' client state, and load it back with the optimizer
        states (a checkpoint without it, or a load without optimizer states, starts every count at zero)."""
        save, load = engine.save_checkpoint, engine.load_checkpoint
        load_arguments = inspect.signature(load)

        def save_checkpoint(save_dir: Any, tag: Any = None, client_state: Any = None, *args: Any, **kwargs: Any) -> Any:
            state = {**(client_state or {}), SKIPPED_STEPS_KEY: dict(self.skipped)}
            return save(save_dir, tag, state, *args, **kwargs)

        def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
            loaded = load(*args, **kwargs)
            client_state = loaded[1] if isinstance(loaded, tuple) else None
            counts = client_state.pop(SKIPPED_STEPS_KEY, None) if isinstance(client_state, dict) else None
            bound = load_arguments.bind(*args, **kwargs)
            bound.apply_defaults()
            optimizer_loaded = bound.arguments["load_optimizer_states"] and not bound.arguments["load_module_only"]
            if client_state is not None:
                self.skipped = {str(k): int(v) for k, v in (counts or {}).items()} if optimizer_loaded else {}
            return loaded

        engine.save_checkpoint = save_checkpoint
        engine.load_checkpoint = load_checkpoint


def _named(names: list[str]) -> str:
    """The first few of ``names`` for a message, and how many more there are."""
    return ", ".join(names[:_NAMED]) + (f" and {len(names) - _NAMED} more" if len(names) > _NAMED else "")


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _stepped(inner: torch.optim.Optimizer) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """The flat partitions the inner optimizer's next step updates, with their groups (DeepSpeed sets the groups'
    params to them)."""
    return [(group, flat) for group in inner.param_groups for flat in group["params"] if flat.grad is not None]


def _slice(flat: torch.Tensor, fragment: _Fragment) -> torch.Tensor:
    return flat.view(-1).narrow(0, fragment.start, fragment.numel)


def _rule(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> str | None:
    """``"adam"`` (restored, and stepped again with a parameter's own step count), ``"restore"`` (the update reads
    no step count) or None (not known to be exact)."""
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.Adam) or name in ("DeepSpeedCPUAdam", "FusedAdam"):
        return "adam" if group.get("bias_correction", True) else "restore"
    if isinstance(optimizer, torch.optim.SGD):
        return "restore" if not group.get("momentum") or not group.get("dampening") else None
    if isinstance(optimizer, torch.optim.Adagrad):
        return "restore" if not group.get("lr_decay") else None
    if isinstance(optimizer, (torch.optim.RMSprop, torch.optim.Adadelta)) or name == "DeepSpeedCPUAdagrad":
        return "restore"
    return None


def _unsupported_reason(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> str:
    if isinstance(optimizer, torch.optim.SGD):
        return f" with momentum and dampening={group['dampening']}"
    if isinstance(optimizer, torch.optim.Adagrad):
        return f" with lr_decay={group['lr_decay']}"
    return ", whose update depends on a step count that ZeRO keeps for a whole flat partition"


def _step_count(inner: torch.optim.Optimizer, group: dict[str, Any], flat: torch.Tensor) -> int:
    """The step count of ``flat`` after this step (torch and DeepSpeed keep it per flat partition)."""
    value = inner.state[flat].get("step", group.get("step"))
    return int(value.item() if torch.is_tensor(value) else value)


def _step_adam_again(
    inner: torch.optim.Optimizer, group: dict[str, Any], flat: torch.Tensor, entry: _Kept, own_steps: int
) -> None:
    """Step the fragment of ``entry`` (put back to its values before the step) with Adam as one process does: its
    own step count ``own_steps`` (this step included), the group's hyperparameters."""
    if isinstance(inner, torch.optim.Adam):
        decoupled = bool(group.get("decoupled_weight_decay", isinstance(inner, torch.optim.AdamW)))
        amsgrad, maximize = bool(group["amsgrad"]), bool(group["maximize"])
    else:  # DeepSpeed's CPU and fused Adam
        decoupled, amsgrad, maximize = bool(inner.adam_w_mode), False, False  # type: ignore[attr-defined]
    state = inner.state[flat]
    beta1, beta2 = group["betas"]
    assert entry.gradient is not None
    adam(
        [_slice(flat, entry.fragment)],
        [entry.gradient],
        [_slice(state["exp_avg"], entry.fragment)],
        [_slice(state["exp_avg_sq"], entry.fragment)],
        [_slice(state["max_exp_avg_sq"], entry.fragment)] if amsgrad else [],
        [torch.tensor(float(own_steps - 1))],  # the function counts this step
        foreach=False,
        fused=False,
        decoupled_weight_decay=decoupled,
        amsgrad=amsgrad,
        beta1=float(beta1),
        beta2=float(beta2),
        lr=float(group["lr"]),
        weight_decay=float(group["weight_decay"]),
        eps=float(group["eps"]),
        maximize=maximize,
    )
