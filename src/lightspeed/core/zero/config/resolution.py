"""Turning a DeepSpeed config with "auto" values into the exact config DeepSpeed receives.

Every "auto" is filled from the Trainer settings and the model (:class:`TrainingFacts`), and every explicit value
that contradicts them is reported, all in one error, because a DeepSpeed config that disagrees with the Trainer
trains a different run than the one the user asked for (another batch size, accumulation, clipping or precision).
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from typing import Any

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config import activation
from lightspeed.core.zero.config.choices import AUTO
from lightspeed.core.zero.config.facts import BF16_PRECISIONS, FP16_PRECISIONS, TrainingFacts, front_end_in_prose
from lightspeed.core.zero.config.known_keys import deepspeed_attr
from lightspeed.core.zero.config.validation import validate_keys

_MISSING = object()

#: how the note on bucket sizes left to DeepSpeed's defaults (no hidden size known) begins
UNKNOWN_HIDDEN_SIZE_NOTE = "The model's hidden size is unknown, so DeepSpeed's defaults are used for "

# zero_optimization keys derived from the hidden size h, under both the JSON name and the pydantic field name
# (DeepSpeed's model accepts either).
_REDUCE_BUCKET = ("reduce_bucket_size",)
_PREFETCH_BUCKET = ("stage3_prefetch_bucket_size", "prefetch_bucket_size")
_PERSISTENCE_THRESHOLD = ("stage3_param_persistence_threshold", "param_persistence_threshold")
_ALLGATHER_BUCKET = ("allgather_bucket_size",)

_OPTIMIZER_EXAMPLES = {"lr": "0.001", "betas": "[0.9, 0.999]", "eps": "1e-08", "weight_decay": "0.01"}
_SCHEDULER_LR_KEYS = ("warmup_max_lr", "cycle_max_lr")
_SCHEDULER_TOTAL_STEPS_KEYS = ("total_num_steps",)


def _derived_sizes(hidden: int | None) -> tuple[tuple[tuple[str, ...], int | None], ...]:
    """The ``zero_optimization`` sizes ``"auto"`` stands for with the model's hidden size (None: unknown)."""
    h = hidden
    return (
        (_REDUCE_BUCKET, None if h is None else h * h),
        (_PREFETCH_BUCKET, None if h is None else int(0.9 * h * h)),
        (_PERSISTENCE_THRESHOLD, None if h is None else 10 * h),
        (_ALLGATHER_BUCKET, None),  # DeepSpeed's default is better than anything derived from h
    )


def sizes_waiting_for_the_model(config: dict[str, Any]) -> list[str]:
    """The ``zero_optimization`` keys of ``config`` (not yet resolved) that are ``"auto"`` and derived from the
    model's hidden size: what :func:`resolve_config` leaves to DeepSpeed's defaults while the model is not built."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return []
    return [
        name
        for names, _ in _derived_sizes(1)
        for name in names
        if name not in _ALLGATHER_BUCKET and zero.get(name) == AUTO
    ]


def fill_sizes_from_the_model(config: dict[str, Any], keys: list[str], hidden: int) -> list[str]:
    """Set ``keys`` (from :func:`sizes_waiting_for_the_model`) in ``config``'s ``zero_optimization`` from the hidden
    size, where they are still absent (DeepSpeed's defaults); returns the keys set."""
    zero = config["zero_optimization"]
    filled = []
    for names, value in _derived_sizes(hidden):
        for name in names:
            if name in keys and name not in zero and value is not None:
                zero[name] = value
                filled.append(name)
    return filled


def _show(value: Any) -> str:
    """A config value as it appears in JSON (true, "auto", 8)."""
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Resolver:
    def __init__(self, config: dict, facts: TrainingFacts) -> None:
        self.config = config
        self.facts = facts
        self.mismatches: list[str] = []
        self.unresolved: list[str] = []
        self.notes: list[str] = []
        self.reported: set[str] = set()  # dotted keys already in self.unresolved

    def _run_length_hint(self) -> str:
        """How the user tells the front end the length of the run."""
        if self.facts.front_end == "Trainer":
            return "set Trainer(max_steps=...) or a finite max_epochs"
        return f"{self.facts.front_end} does not know the length of the run"

    def _unresolved(self, dotted: str, line: str) -> None:
        self.reported.add(dotted)
        self.unresolved.append(line)

    # -- batch size, accumulation, clipping -------------------------------------------------------------------
    def batch(self) -> None:
        cfg, facts = self.config, self.facts
        acc, world = facts.accumulate_grad_batches, facts.world_size

        gas = cfg.get("gradient_accumulation_steps", AUTO)  # absent: same as "auto", it must match the Trainer
        if gas == AUTO:
            cfg["gradient_accumulation_steps"] = acc
        elif gas != acc:
            self.mismatches.append(
                f"gradient_accumulation_steps={_show(gas)} in the DeepSpeed config, but "
                f"{facts.argument('accumulate_grad_batches', acc)}"
            )

        tbs = cfg.get("train_batch_size", _MISSING)
        micro = cfg.get("train_micro_batch_size_per_gpu", AUTO)
        if micro == AUTO:
            if facts.micro_batch_size is not None:
                micro = facts.micro_batch_size
            elif _is_count(tbs) and tbs > 0 and tbs % (acc * world) == 0:
                micro = tbs // (acc * world)
                self.notes.append(
                    f"The train dataloader's batch size is unknown; train_micro_batch_size_per_gpu={micro} was "
                    f"derived from train_batch_size={tbs} / (accumulate_grad_batches={acc} x {world} devices)."
                )
            else:
                micro = 1
                self.notes.append(
                    'The train dataloader\'s batch size is unknown, so train_micro_batch_size_per_gpu="auto" '
                    "was set to 1. Write the real per-device batch size into the DeepSpeed config if it differs."
                )
            cfg["train_micro_batch_size_per_gpu"] = micro
        elif facts.micro_batch_size is not None and micro != facts.micro_batch_size:
            self.mismatches.append(
                f"train_micro_batch_size_per_gpu={_show(micro)} in the DeepSpeed config, but the train "
                f"dataloader's batch size is {facts.micro_batch_size}"
            )

        per_device = facts.micro_batch_size if facts.micro_batch_size is not None else micro
        if _is_count(per_device):
            expected = per_device * acc * world
            if tbs == AUTO:
                cfg["train_batch_size"] = expected
            elif tbs is not _MISSING and tbs != expected:
                self.mismatches.append(
                    f"train_batch_size={_show(tbs)} in the DeepSpeed config, but the batch size per device "
                    f"{per_device} x {facts.argument('accumulate_grad_batches', acc)} x {world} devices = {expected}"
                )
        elif tbs == AUTO:
            self._unresolved(
                "train_batch_size",
                'train_batch_size is "auto", but train_micro_batch_size_per_gpu is not a number. Write '
                "train_micro_batch_size_per_gpu as a number, e.g. 8.",
            )

    def clipping(self) -> None:
        cfg, clip_val = self.config, self.facts.gradient_clip_val or 0.0
        requested = bool(clip_val)
        value = cfg.get("gradient_clipping", _MISSING)
        if value == AUTO or (value is _MISSING and requested):
            cfg["gradient_clipping"] = float(clip_val) if requested else 0.0
        elif value is not _MISSING and requested:
            same = (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isclose(float(value), float(clip_val), rel_tol=1e-9, abs_tol=0.0)
            )
            if not same:
                self.mismatches.append(
                    f"gradient_clipping={_show(value)} in the DeepSpeed config, but "
                    f"{self.facts.argument('gradient_clip_val', clip_val)}"
                )

    # -- precision -------------------------------------------------------------------------------------------
    def precision(self) -> None:
        cfg, precision = self.config, self.facts.precision
        bf16_key = "bf16" if "bf16" in cfg or "bfloat16" not in cfg else "bfloat16"
        explicit: dict[str, bool] = {}  # only what the user wrote; filled values follow the precision anyway
        for key, wanted in (("fp16", precision in FP16_PRECISIONS), (bf16_key, precision in BF16_PRECISIONS)):
            section = cfg.get(key)
            if section is None:
                if wanted:
                    cfg[key] = {"enabled": True}
                continue
            if not isinstance(section, dict):
                continue  # validate_keys has already rejected it
            value = section.get("enabled", AUTO)  # absent: same as "auto", it must match the Trainer
            if value == AUTO:
                section["enabled"] = wanted
            else:
                explicit[key] = bool(value)
                if bool(value) != wanted:
                    self.mismatches.append(
                        f"{key}.enabled={_show(value)} in the DeepSpeed config, but "
                        + self.facts.argument("precision", f'"{precision}"')
                    )
        low_memory = [
            key
            for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states")
            if isinstance(cfg.get(bf16_key), dict) and cfg[bf16_key].get(key) is True
        ]
        if low_memory and precision not in BF16_PRECISIONS:
            self.mismatches.append(
                f"{' and '.join(low_memory)} keep training state in bf16, but "
                + self.facts.argument("precision", f'"{precision}"')
                + ' (they need precision="bf16-mixed" or "bf16-true")'
            )
        if explicit.get("fp16") and explicit.get(bf16_key):
            self.mismatches.append(
                f"fp16.enabled and {bf16_key}.enabled are both true in the DeepSpeed config, but DeepSpeed can use "
                "only one of them; "
                + self.facts.argument("precision", f'"{precision}"')
                + " asks for "
                + ("fp16" if precision in FP16_PRECISIONS else "bf16" if precision in BF16_PRECISIONS else "neither")
            )

    # -- ZeRO bucket sizes -----------------------------------------------------------------------------------
    def zero(self) -> None:
        zero = self.config.get("zero_optimization")
        if not isinstance(zero, dict):
            return
        dropped = []
        for names, value in _derived_sizes(self.facts.hidden_size):
            for name in names:
                if zero.get(name) != AUTO:
                    continue
                if value is None:
                    del zero[name]
                    if name not in _ALLGATHER_BUCKET:
                        dropped.append(f"zero_optimization.{name}")
                else:
                    zero[name] = value
        if dropped:
            self.notes.append(
                UNKNOWN_HIDDEN_SIZE_NOTE
                + ", ".join(dropped)
                + ". Write numbers into the DeepSpeed config to tune them."
            )

    # -- optimizer and scheduler -----------------------------------------------------------------------------
    def optimizer(self) -> None:
        section = self.config.get("optimizer")
        if not isinstance(section, dict):
            return
        opt = self.facts.optimizer
        if section.get("type") == AUTO:
            if opt is None:
                self._unresolved(
                    "optimizer.type",
                    'optimizer.type is "auto", but the LightningModule\'s optimizer is unknown. Write the optimizer '
                    'name instead, e.g. "type": "AdamW".',
                )
            else:
                section["type"] = opt.type_name
        params = section.get("params")
        if not isinstance(params, dict):
            return
        for name, example in _OPTIMIZER_EXAMPLES.items():
            if params.get(name) != AUTO:
                continue
            value = None if opt is None else getattr(opt, name)
            if value is None:
                why = (
                    "the LightningModule's optimizer is unknown"
                    if opt is None
                    else f"the LightningModule's optimizer ({opt.type_name}) has no {name}"
                )
                self._unresolved(
                    f"optimizer.params.{name}",
                    f'optimizer.params.{name} is "auto", but {why}. Write the number instead, e.g. '
                    f'"{name}": {example}.',
                )
            else:
                params[name] = list(value) if isinstance(value, tuple) else value

    def scheduler(self) -> None:
        section = self.config.get("scheduler")
        if not isinstance(section, dict) or not isinstance(section.get("params"), dict):
            return
        params = section["params"]
        opt = self.facts.optimizer
        lr = opt.lr if opt is not None else _config_lr(self.config)
        for name in _SCHEDULER_LR_KEYS:
            if params.get(name) != AUTO:
                continue
            if lr is None:
                self._unresolved(
                    f"scheduler.params.{name}",
                    f'scheduler.params.{name} is "auto", but the LightningModule\'s optimizer (and so its learning '
                    f'rate) is unknown. Write the peak learning rate instead, e.g. "{name}": 0.001.',
                )
            else:
                params[name] = lr
        for name in _SCHEDULER_TOTAL_STEPS_KEYS:
            if params.get(name) != AUTO:
                continue
            if self.facts.total_steps is None:
                self._unresolved(
                    f"scheduler.params.{name}",
                    f'scheduler.params.{name} is "auto", but the number of optimizer steps of the run is unknown '
                    f"({self._run_length_hint()}). Or write the number instead, e.g. "
                    f'"{name}": 10000.',
                )
            else:
                params[name] = self.facts.total_steps

    # -- activation checkpointing ----------------------------------------------------------------------------
    def activation_checkpointing(self) -> None:
        section = self.config.get(activation.SECTION)
        if isinstance(section, dict):
            offloaded = activation.parameters_offloaded(self.config)
            self.notes += activation.resolve_section(section, offloaded, self.facts.device_kind)

    # -- anything left -------------------------------------------------------------------------------------
    def leftovers(self) -> None:
        """Report every "auto" still left where DeepSpeed would choke on it or silently use its default."""
        cfg = self.config
        scopes: list[tuple[str, Any]] = [("", cfg)]
        for name in ("zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "scheduler", activation.SECTION):
            if isinstance(cfg.get(name), dict):
                scopes.append((name + ".", cfg[name]))
        for name in ("optimizer", "scheduler"):
            if isinstance(cfg.get(name), dict) and isinstance(cfg[name].get("params"), dict):
                scopes.append((name + ".params.", cfg[name]["params"]))
        for prefix, section in scopes:
            for key, value in section.items():
                if value != AUTO:
                    continue
                dotted = prefix + key
                if dotted in self.reported:
                    continue
                source = front_end_in_prose(self.facts.front_end)
                self._unresolved(
                    dotted,
                    f'{dotted} is "auto", but lightspeed cannot derive it from {source} or the model. '
                    f"Write the value instead{_default_hint(prefix, key)}, or remove the key.",
                )


def _config_lr(config: dict) -> float | None:
    """The learning rate the config's own optimizer section gives (the optimizer when there is no client one)."""
    section = config.get("optimizer")
    params = section.get("params") if isinstance(section, dict) else None
    value = params.get("lr") if isinstance(params, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _default_hint(prefix: str, key: str) -> str:
    """ ", DeepSpeed's default is X" for keys of DeepSpeed's pydantic sections, else ""."""
    models = {
        "zero_optimization.": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
        "fp16.": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
        "bf16.": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
        "bfloat16.": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    }
    if prefix not in models:
        return ""
    model = deepspeed_attr(*models[prefix])
    if model is None:
        return ""
    for name, info in model.model_fields.items():
        if key in (name, info.alias) and info.default is not None and not callable(info.default):
            default = info.default
            if hasattr(default, "value"):  # enum members
                default = default.value
            return f" (DeepSpeed's default is {_show(default)})"
    return ""


def resolve_config_with_notes(config: dict, facts: TrainingFacts) -> tuple[dict, list[str]]:
    """Like :func:`resolve_config`, but returns the informational notes (defaults chosen for unknown facts)
    instead of emitting them as warnings, so a caller can log them once (e.g. on rank 0 only)."""
    validate_keys(config, facts.front_end)
    resolver = _Resolver(copy.deepcopy(config), facts)
    resolver.batch()
    resolver.clipping()
    resolver.precision()
    resolver.zero()
    resolver.optimizer()
    resolver.scheduler()
    resolver.activation_checkpointing()
    resolver.leftovers()
    problems = resolver.mismatches + resolver.unresolved
    if problems:
        lines = "\n".join(f"  - {line}" for line in problems)
        count = f"{len(problems)} problem" + ("s" if len(problems) > 1 else "")
        message = f"The DeepSpeed config does not fit this run ({count}):\n{lines}"
        if resolver.mismatches:
            message += (
                '\nMake each pair agree: change the value in the DeepSpeed config (or set it to "auto" so it '
                f"follows {front_end_in_prose(facts.front_end)}), or change the {facts.front_end} argument."
            )
        raise DeepSpeedConfigError(message)
    return resolver.config, resolver.notes


def resolve_config(config: dict, facts: TrainingFacts) -> dict:
    """A new config with every "auto" filled from ``facts``; the input is not modified.

    Keys that must agree with the Trainer (accumulation, micro batch size, clipping when the Trainer clips,
    fp16/bf16 when the precision needs them) are filled in when absent too. Explicit values that contradict the
    facts, and "auto" values that cannot be derived, are all reported in one :class:`DeepSpeedConfigError`.
    Choices made for unknown facts (micro batch size 1, DeepSpeed's default bucket sizes) are emitted as
    ``UserWarning``.
    """
    resolved, notes = resolve_config_with_notes(config, facts)
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=2)
    return resolved
