"""The tuner's decision: from the cache when it holds one for exactly this run, else measured and stored.

Every rank reaches the same decision: rank 0 reads the cache and tells the others, the trials agree on their
timings and failures, and the fastest measured candidate wins, unless it beats the planner's choice (the first
candidate) by less than 10 %: a few steps measure the machine's load as much as the option, so the planner keeps its
choice without clear evidence.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightspeed.core.common.distributed import global_rank, is_distributed
from lightspeed.core.common.process import ProcessPlace
from lightspeed.core.errors import DeepSpeedConfigError, MemoryPlanError
from lightspeed.core.zero.auto_arguments import split_zero_auto_arguments
from lightspeed.core.zero.auto_choice import ZeroAutoRequest
from lightspeed.core.zero.config import AUTO
from lightspeed.core.zero.config.arguments import ZeroRunKeywords, zero_arguments
from lightspeed.core.zero.config.keywords import refuse_unknown_keywords
from lightspeed.core.zero.planner import ZERO_OPTIONS, Plan
from lightspeed.core.zero.tuner.cache import CachedDecision, TuningCache, TuningKey
from lightspeed.core.zero.tuner.trials import (
    BUCKET_VARIANTS,
    Candidate,
    Trial,
    TrialSetup,
    deepspeed_engine_builder,
    format_trials,
    run_trials,
)

__all__ = ["TrialParts", "TuneRequest", "TuneResult", "candidates_from_plan", "micro_batch_choices", "tune"]


@dataclass(frozen=True)
class TuneResult:
    """The chosen candidate, the trials that chose it (empty when the cache did), and whether the cache did."""

    chosen: Candidate
    trials: list[Trial]
    from_cache: bool


def micro_batch_choices(allowed: Sequence[int], micro_batch: int | None, accumulation: int) -> list[tuple[int, int]]:
    """``(micro-batch, accumulation)`` pairs, besides the run's own size, that keep the run's samples per optimizer
    step on each rank (``micro_batch x accumulation``): each ``allowed`` size once, in order; raises a
    ``ValueError`` naming the sizes that do when an allowed size does not divide it, or the run's micro-batch is
    unknown."""
    if micro_batch is None:
        raise ValueError(
            "tune_micro_batches needs the run's micro-batch size, but the training DataLoader has no batch_size (a "
            "custom batch sampler, or an iterable that batches itself). Give the DataLoader a batch_size, or leave "
            "tune_micro_batches unset."
        )
    per_step = micro_batch * accumulation
    wrong = [size for size in allowed if per_step % size]
    if wrong:
        fitting = [size for size in range(1, per_step + 1) if per_step % size == 0]
        raise ValueError(
            f"tune_micro_batches={list(allowed)} holds {', '.join(map(str, wrong))}, which do not divide the "
            f"{per_step} samples each rank trains per optimizer step (micro-batch {micro_batch} x accumulation "
            f"{accumulation}); the tuner keeps that batch, so it can only try sizes that divide it: "
            f"{', '.join(map(str, fitting))}."
        )
    return [(size, per_step // size) for size in dict.fromkeys(allowed) if size != micro_batch]


def candidates_from_plan(
    plan: Plan,
    allowed: Sequence[str] | None = None,
    buckets: bool = False,
    batchings: Sequence[tuple[int, int]] | None = None,
) -> list[Candidate]:
    """The options the plan says fit (restricted to the ``allowed`` names), fastest estimate first, each with
    lightspeed's bucket sizes and, with ``buckets``, also DeepSpeed's, each at the run's own micro-batch size and at
    every ``(micro-batch, accumulation)`` of ``batchings`` (:func:`micro_batch_choices`); raises
    :class:`MemoryPlanError` when an allowed name is unknown or none of them fits. The first candidate is the
    planner's choice as the run would train it."""
    if allowed is not None:
        check_option_names(allowed, [verdict.estimate.option.name for verdict in plan.verdicts])
    fitting = [
        verdict.estimate.option
        for verdict in plan.verdicts
        if verdict.fits and (allowed is None or verdict.estimate.option.name in allowed)
    ]
    if not fitting:
        raise MemoryPlanError(
            f"None of the options tune_options allows ({', '.join(allowed or [])}) fits this machine; the memory plan "
            "above says which do. Allow one of them, or leave tune_options unset."
        )
    variants = list(BUCKET_VARIANTS) if buckets else ["auto"]
    sizes: list[tuple[int | None, int | None]] = [(None, None), *(batchings or [])]  # None: the run's own
    return [
        Candidate(option, variant, size, accumulation)
        for option in fitting
        for size, accumulation in sizes
        for variant in variants
    ]


#: how much faster (measured) another candidate must be to replace the planner's choice (the first candidate): a few
#: steps on a busy machine measure the load as much as the option, so a smaller gap is no evidence
TUNE_MARGIN = 1.10


def pick_fastest(trials: Sequence[Trial]) -> Trial:
    """The fastest measured trial, unless it beats the planner's choice (the first candidate, when it trained) by less
    than :data:`TUNE_MARGIN`: then the planner's choice."""
    measured = [trial for trial in trials if trial.samples_per_second is not None]
    best = max(measured, key=lambda trial: trial.samples_per_second or 0.0)  # max keeps the first of equals
    planned = trials[0]
    planned_speed = planned.samples_per_second
    if planned_speed is not None and (best.samples_per_second or 0.0) < TUNE_MARGIN * planned_speed:
        return planned
    return best


def _agreed_cached(cache: TuningCache, key: TuningKey) -> tuple[CachedDecision | None, int]:
    found: list[object] = [cache.lookup(key) if global_rank() == 0 else None]
    if is_distributed():
        torch.distributed.broadcast_object_list(found, src=0)
    decision: CachedDecision | None
    others: int
    decision, others = found[0]  # type: ignore[misc]
    return decision, others


def tune(
    candidates: Sequence[Candidate],
    setup: TrialSetup,
    key: TuningKey,
    cache: TuningCache,
    *,
    retune: bool = False,
    steps: int = 3,
    warmup: int = 1,
    info: Callable[[str], None],
) -> TuneResult:
    """The fastest of ``candidates``: the cached decision for ``key`` unless ``retune``, else measured (a collective:
    every rank calls it), logged as a table through ``info`` and stored."""
    by_name = {candidate.name: candidate for candidate in candidates}
    if not retune:
        cached, others = _agreed_cached(cache, key)
        if cached is not None and cached.chosen in by_name:
            info(
                f"lightspeed zero_auto: {cached.chosen} from the tuning cache {str(cache.path)!r} (measured before for "
                "this model, world size, precision and hardware); retune=True (`lightspeed tune --retune`) "
                "measures again."
            )
            return TuneResult(by_name[cached.chosen], [], True)
        if others:
            info(
                f"lightspeed zero_auto: the tuning cache {str(cache.path)!r} holds {others} decision(s) for other "
                "models, world sizes, precisions or hardware and none for this run; they are not reused. Measuring."
            )
    trials = run_trials(candidates, setup, steps=steps, warmup=warmup)
    measured = [trial for trial in trials if trial.samples_per_second is not None]
    if not measured:
        failures = "\n  ".join(f"{trial.candidate.name}: {trial.error}" for trial in trials)
        raise MemoryPlanError(f"zero_auto could not train any candidate it tried:\n  {failures}")
    best = pick_fastest(trials)
    measured_steps = f"{steps} step{'s' if steps != 1 else ''}"
    info(f"lightspeed zero_auto: measured {measured_steps} of each candidate\n{format_trials(trials, best.candidate)}")
    cache.store(
        key,
        best.candidate.name,
        {trial.candidate.name: trial.samples_per_second for trial in trials},
        writer=global_rank() == 0,
    )
    return TuneResult(best.candidate, trials, False)


#: the DeepSpeed config keys a micro-batch candidate sets
_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def check_option_names(allowed: Sequence[str], known: Sequence[str] | None = None) -> None:
    """Refuse ``tune_options`` names that are not among zero_auto's options (``known``: those of the plan; default:
    every option the planner knows), before anything is measured."""
    known = list(known) if known is not None else [option.name for option in ZERO_OPTIONS]
    unknown = sorted(set(allowed) - set(known))
    if unknown:
        raise MemoryPlanError(
            f"tune_options names {', '.join(unknown)}, which zero_auto does not know; choose from {', '.join(known)}."
        )


@dataclass(frozen=True)
class TuneRequest:
    """``zero_auto``'s tuning arguments, checked once: the same for the Trainer's and Fabric's strategy."""

    tune: bool = False
    steps: int = 3
    options: tuple[str, ...] | None = None
    buckets: bool = False
    cache_path: str | None = None
    retune: bool = False
    micro_batches: tuple[int, ...] | None = None

    @classmethod
    def checked(
        cls,
        tune: bool,
        steps: int,
        options: Sequence[str] | None,
        buckets: bool,
        cache: str | os.PathLike[str] | None,
        retune: bool,
        micro_batches: Sequence[int] | None = None,
    ) -> TuneRequest:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"tune_steps is the number of measured steps per candidate, at least 1; got {steps!r}.")
        if isinstance(options, str):
            raise TypeError(f"tune_options is a list of option names, e.g. [{options!r}]; got the string {options!r}.")
        if options is not None:
            check_option_names(options)
        if micro_batches is not None and (
            isinstance(micro_batches, (str, int))
            or not micro_batches
            or any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in micro_batches)
        ):
            raise ValueError(
                "tune_micro_batches is a list of the micro-batch sizes the tuner may try, positive integers such as "
                f"[2, 4, 8]; got {micro_batches!r}."
            )
        if micro_batches is not None and not tune:
            raise ValueError("tune_micro_batches is what tune=True may try; set tune=True as well, or leave it unset.")
        return cls(
            bool(tune),
            steps,
            tuple(options) if options is not None else None,
            bool(buckets),
            str(cache) if cache is not None else None,
            bool(retune),
            tuple(micro_batches) if micro_batches is not None else None,
        )

    def check_config(self, user_config: dict[str, Any]) -> None:
        """With ``tune_micro_batches``, the DeepSpeed config must leave the batch sizes to the tuner."""
        if self.micro_batches is None:
            return
        fixed = {key: user_config[key] for key in _BATCH_KEYS if user_config.get(key, AUTO) != AUTO}
        if fixed:
            shown = ", ".join(f"{key}={value!r}" for key, value in fixed.items())
            raise ValueError(
                f"tune_micro_batches lets the tuner choose the micro-batch size and accumulation, but the DeepSpeed "
                f'config fixes {shown}; set them to "auto" (or remove them), or leave tune_micro_batches unset.'
            )

    def run(
        self, candidates: Sequence[Candidate], setup: TrialSetup, key: TuningKey, *, info: Callable[[str], None]
    ) -> TuneResult:
        """:func:`tune` with these arguments."""
        cache = TuningCache(self.cache_path)
        return tune(candidates, setup, key, cache, retune=self.retune, steps=self.steps, info=info)

    def choose(
        self,
        plan: Plan,
        zero_auto: ZeroAutoRequest,
        module: torch.nn.Module,
        trial: TrialParts,
        *,
        info: Callable[[str], None],
    ) -> Candidate:
        """The fastest candidate ``plan`` allows for ``module`` under zero_auto's ``zero_auto`` request, cached or
        measured with the front end's ``trial`` parts (a collective)."""
        batchings = (
            micro_batch_choices(self.micro_batches, trial.micro_batch, trial.accumulation)
            if self.micro_batches is not None
            else None
        )
        candidates = candidates_from_plan(plan, self.options, self.buckets, batchings)
        setup = TrialSetup(
            copy_model=trial.copy_model,
            config_for=lambda candidate: candidate.with_batching(
                trial.resolve(candidate.config(zero_auto)), trial.world_size
            ),
            build_engine=deepspeed_engine_builder(trial.device.index, trial.local_rank),
            loss=trial.loss,
            take_batches=trial.take_batches,
            device=trial.device,
            accumulation=trial.accumulation,
        )
        key = TuningKey.of(
            module,
            world_size=trial.world_size,
            precision=trial.precision,
            device=trial.device,
            candidates=[candidate.name for candidate in candidates],
            micro_batch=trial.micro_batch,
            accumulation=trial.accumulation,
        )
        return self.run(candidates, setup, key, info=info).chosen


@dataclass(frozen=True)
class TrialParts:
    """What a front end provides for :meth:`TuneRequest.choose`: a copy of the model and optimizer, the resolution of
    ``"auto"`` values, one micro-batch's loss, the run's first batches (of a given micro-batch size, see
    :class:`TrialSetup`), the run's micro-batch size and accumulation, and where the run trains."""

    copy_model: Callable[[], tuple[torch.nn.Module, Any]]
    resolve: Callable[[dict[str, Any]], dict[str, Any]]
    loss: Callable[[torch.nn.Module, Any, int], torch.Tensor]
    take_batches: Callable[[int, int | None], list[Any]]
    micro_batch: int | None
    process: ProcessPlace
    precision: str
    accumulation: int = 1

    @property
    def device(self) -> torch.device:
        return self.process.root_device

    @property
    def local_rank(self) -> int:
        return self.process.local_rank

    @property
    def world_size(self) -> int:
        return self.process.world_size


def zero_auto_requests(given: Mapping[str, Any], front_end: str) -> tuple[ZeroAutoRequest, TuneRequest]:
    """``zero_auto``'s planner and tuner requests from the keyword arguments a front end was ``given``
    (:class:`~lightspeed.core.zero.auto_arguments.ZeroAutoKeywords` and the ZeRO strategy's, whose tuning knobs the
    planner takes too), checked the same for every front end."""
    arguments, rest = split_zero_auto_arguments(given)
    tune_request = TuneRequest.checked(
        arguments["tune"],
        arguments["tune_steps"],
        arguments["tune_options"],
        arguments["tune_buckets"],
        arguments["tune_cache"],
        arguments["retune"],
        arguments["tune_micro_batches"],
    )
    request = ZeroAutoRequest.from_arguments(
        safety_margin=arguments["safety_margin"],
        device_memory=arguments["device_memory"],
        host_memory=arguments["host_memory"],
        nvme_path=arguments["nvme_path"],
        optimizer_state_bytes=arguments["optimizer_state_bytes"],
        config=arguments["config"],
        kwargs=rest,
        front_end=front_end,
    )
    tune_request.check_config(request.user_config)
    if tune_request.tune and rest.get("sequence_parallel_size", 1) != 1:
        raise DeepSpeedConfigError(
            "zero_auto's tune=True measures training steps on whole batches, which sequence_parallel_size > 1 "
            "splits: leave tune off (the planner still chooses the ZeRO option), or tune without sequence parallelism."
        )
    return request, tune_request


def zero_auto_arguments(
    given: Mapping[str, Any], strategy: type, owner: str, front_end: str, front_end_defaults: Mapping[str, Any]
) -> tuple[ZeroAutoRequest, TuneRequest, dict[str, Any]]:
    """What a ``zero_auto`` front end's ``__init__`` builds from the keyword arguments it was ``given``: the planner's
    and the tuner's requests, and every ZeRO argument by name but those ``zero_auto`` chooses (defaults filled in, the
    activation-checkpointing policy parsed). A keyword ``strategy`` does not take is a ``TypeError`` naming
    ``owner``."""
    request, tune_request = zero_auto_requests(given, front_end)
    refuse_unknown_keywords(owner, given, strategy, front_end)
    arguments = zero_arguments(given, ZeroRunKeywords, front_end_defaults)
    return request, tune_request, {**arguments, "activation_checkpointing_policy": request.tuning.policy}
