"""``lightspeed config NAME``: the DeepSpeed JSON behind a registered ZeRO strategy, "auto" values resolved from
the flags given and left as "auto" otherwise (the strategy fills those from the Trainer at setup)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import json
import sys
import warnings
from typing import Any

from lightspeed.cli.usage import EXIT_OK, PRECISIONS_TEXT, Command, UsageError, require_nvme_path
from lightspeed.core.zero.config import (
    NVME_PATH_ENV,
    ZERO_PRESETS,
    TrainingFacts,
    ZeroPreset,
    build_zero_config,
    resolve_config,
)

# dotted config key -> the flag whose value resolves it; "auto" keys not listed are always left as "auto"
_SOURCES = {
    "train_micro_batch_size_per_gpu": ("micro_batch_size",),
    "gradient_accumulation_steps": ("accumulate",),
    "train_batch_size": ("micro_batch_size", "accumulate"),
    "gradient_clipping": ("gradient_clip",),
    "fp16.enabled": ("precision",),
    "bf16.enabled": ("precision",),
    "zero_optimization.reduce_bucket_size": ("hidden_size",),
    "zero_optimization.stage3_prefetch_bucket_size": ("hidden_size",),
    "zero_optimization.prefetch_bucket_size": ("hidden_size",),
    "zero_optimization.stage3_param_persistence_threshold": ("hidden_size",),
    "zero_optimization.param_persistence_threshold": ("hidden_size",),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``lightspeed config``."""
    parser.add_argument(
        "name",
        help=f"strategy name: {', '.join(ZERO_PRESETS)}",
    )
    parser.add_argument("--micro-batch-size", type=int, help="per-device batch size of the train dataloader")
    parser.add_argument("--accumulate", type=int, help="Trainer(accumulate_grad_batches=...)")
    parser.add_argument("--devices", type=int, default=1, help="devices per node (for train_batch_size; default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (for train_batch_size; default 1)")
    parser.add_argument(
        "--precision",
        help=f'Lightning precision: {PRECISIONS_TEXT} (default: none, so fp16/bf16 stay "auto", which the strategy '
        "resolves from the Trainer's precision)",
    )
    parser.add_argument("--gradient-clip", type=float, help="Trainer(gradient_clip_val=...)")
    parser.add_argument("--hidden-size", type=int, help="model hidden size (sets ZeRO bucket sizes)")
    parser.add_argument(
        "--nvme-path",
        help=f"directory on the NVMe drive (for NVMe strategies; default ${NVME_PATH_ENV}, as for the strategy)",
    )
    parser.add_argument("--config", dest="user_config", help="a DeepSpeed JSON merged over the preset (its values win)")


def _preset(name: str, nvme_path: str | None) -> ZeroPreset:
    if name == "zero_auto":
        raise UsageError(
            "zero_auto chooses its DeepSpeed config at setup from the model and the machine. Run "
            "`lightspeed estimate ...` to see what it would pick, then `lightspeed config <that name>`."
        )
    if name not in ZERO_PRESETS:
        close = difflib.get_close_matches(name, ZERO_PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"Unknown ZeRO strategy {name!r}.{hint} Choose one of: {', '.join(ZERO_PRESETS)}.")
    preset = ZERO_PRESETS[name]
    if preset.uses_nvme:
        require_nvme_path(name, nvme_path)
    if nvme_path and not preset.uses_nvme:
        raise UsageError(f"--nvme-path is only used by NVMe strategies, and {name} does not offload to NVMe.")
    return preset


def _leaves(config: dict, prefix: str = ""):
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, dotted + ".")
        else:
            yield dotted, value


def _get(config: dict, dotted: str, missing: Any) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return missing
        node = node[part]
    return node


def _set(config: dict, dotted: str, value: Any, missing: Any) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node[part]
    if value is missing:
        del node[last]
    else:
        node[last] = value


def build_config(args: argparse.Namespace) -> dict[str, Any]:
    """The preset of ``args.name`` (merged with ``--config``), with "auto" resolved where a flag gives the value."""
    for flag in ("micro_batch_size", "accumulate", "devices", "nodes", "hidden_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got {value}.")
    preset = _preset(args.name, args.nvme_path)
    # the same recipe as the strategy: the NVMe directory made absolute, created and checked writable
    config = build_zero_config(
        preset.stage,
        preset.offload_optimizer,
        preset.offload_parameters,
        nvme_path=args.nvme_path or None,
        user_config=args.user_config,
    )
    given = {
        "micro_batch_size": args.micro_batch_size is not None,
        "accumulate": args.accumulate is not None,
        "gradient_clip": args.gradient_clip is not None,
        "precision": args.precision is not None,
        "hidden_size": args.hidden_size is not None,
    }
    facts = TrainingFacts(
        world_size=args.devices * args.nodes,
        micro_batch_size=args.micro_batch_size,
        accumulate_grad_batches=args.accumulate or 1,
        gradient_clip_val=args.gradient_clip,
        precision=args.precision or "32-true",
        hidden_size=args.hidden_size,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # notes about defaults for missing facts: those keys stay "auto" below
        resolved = resolve_config(config, facts)
    missing = object()
    out = copy.deepcopy(config)
    for dotted, value in _leaves(config):
        if value != "auto":
            continue
        sources = _SOURCES.get(dotted)
        if sources and all(given[source] for source in sources):
            _set(out, dotted, _get(resolved, dotted, missing), missing)
    return out


def run(args: argparse.Namespace) -> int:
    # DeepSpeed logs to stdout when it is first imported; keep stdout for the JSON (`> ds_config.json`)
    with contextlib.redirect_stdout(sys.stderr):
        config = build_config(args)
    print(json.dumps(config, indent=2))
    return EXIT_OK


COMMAND = Command(
    name="config",
    help="print the DeepSpeed JSON of a ZeRO strategy name",
    description="Print the DeepSpeed config of a registered lightspeed ZeRO strategy (e.g. zero3_offload). Values the "
    'Trainer decides are "auto"; the flags below resolve them the way the strategy does at setup.',
    epilog="example: lightspeed config zero3_offload --micro-batch-size 4 --accumulate 8 --precision bf16-mixed "
    "> ds_config.json",
    add_arguments=add_arguments,
    run=run,
)
