"""``lightspeed estimate``: model-state memory of every ZeRO option, which fit this machine, and the pick."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from lightspeed.cli.usage import (
    DEVICE_MEMORY_HELP,
    EXIT_OK,
    EXIT_USER_ERROR,
    HOST_MEMORY_HELP,
    PRECISIONS_TEXT,
    Command,
    UsageError,
    add_deprecated_alias,
    options_from,
)

_EPILOG = """\
examples:
  lightspeed estimate my_pkg.models:build_model --devices 8 --nodes 2 --precision bf16-mixed
  lightspeed estimate --params 7e9 --largest-layer 1.3e8 --devices 1 --device-memory 80GB --host-memory 256GB

The factory is called with no arguments inside `with torch.device("meta")`, so even a 70B model costs no memory.
Sizes need a unit: 80GB (10^9 bytes), 80GiB or 80G (2^30 bytes). Exit code 2 when no option fits.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``lightspeed estimate``."""
    parser.add_argument("factory", nargs="?", help="package.module:function (or :Class) that returns the nn.Module")
    parser.add_argument("--params", help="total parameter count instead of a factory, e.g. 7e9")
    parser.add_argument("--largest-layer", help="parameters of the largest single module (with --params), e.g. 1.3e8")
    parser.add_argument("--devices", type=int, help="devices (processes) per node; default: GPUs here, else 1")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument(
        "--precision",
        default="32-true",
        help=f"Lightning precision: {PRECISIONS_TEXT} (default 32-true, as the Trainer's)",
    )
    parser.add_argument(
        "--optimizer-state-bytes",
        type=int,
        default=8,
        help="optimizer state per parameter: 8 for Adam/AdamW (default), 4 SGD+momentum, 0 SGD",
    )
    parser.add_argument(
        "--bf16-master-weights-and-grads",
        action="store_true",
        help="bf16 master weights and gradients instead of fp32 (the strategies' argument; bf16 precisions only)",
    )
    parser.add_argument(
        "--bf16-optimizer-states",
        action="store_true",
        help="bf16 optimizer moments too (needs --bf16-master-weights-and-grads)",
    )
    parser.add_argument(
        "--accumulate-grad-batches",
        type=int,
        default=1,
        help="micro-batches per optimizer step, as the Trainer's argument (default 1)",
    )
    parser.add_argument("--device-memory", metavar="SIZE", help=DEVICE_MEMORY_HELP)
    parser.add_argument("--host-memory", metavar="SIZE", help=HOST_MEMORY_HELP)
    add_deprecated_alias(parser, "--gpu-memory", "--device-memory")
    add_deprecated_alias(parser, "--cpu-memory", "--host-memory")
    parser.add_argument("--nvme-path", help="directory on the NVMe drive; its free space is the NVMe budget")
    parser.add_argument(
        "--zero-init",
        action="store_true",
        help="the model is built partitioned (LightningModule.configure_model / deepspeed.zero.Init)",
    )
    parser.add_argument(
        "--safety-margin",
        type=float,
        default=None,
        help="fraction of every budget kept free for activations and buffers (default 0.2)",
    )
    parser.add_argument("--buffer-factor", type=float, default=1.5, help="DeepSpeed's host buffer factor (1.5)")
    parser.add_argument("--json", action="store_true", help="print JSON (all sizes in bytes) instead of a table")


def _counts(args: argparse.Namespace):
    from lightspeed.core.zero.planner import ModelCounts, counts_from_factory, parse_count

    if args.factory and (args.params or args.largest_layer):
        raise UsageError("give either a model factory or --params/--largest-layer, not both.")
    if args.factory:
        return counts_from_factory(args.factory)
    if not args.params:
        raise UsageError(
            "say what to estimate: a model factory (my_pkg.models:build_model) or --params N --largest-layer M."
        )
    if not args.largest_layer:
        raise UsageError(
            "--params needs --largest-layer: the parameter count of the biggest single module "
            "(often the token embedding, vocab_size x hidden_size); ZeRO-3 gathers it in full."
        )
    return ModelCounts(parse_count(args.params, "--params"), parse_count(args.largest_layer, "--largest-layer"))


def _budgets(args: argparse.Namespace):
    from lightspeed.core.common.sizes import parse_size
    from lightspeed.core.errors import MemoryPlanError
    from lightspeed.core.zero.planner import measure_budgets

    return measure_budgets(
        device_memory=parse_size(args.device_memory, "--device-memory", MemoryPlanError)
        if args.device_memory
        else None,
        host_memory=parse_size(args.host_memory, "--host-memory", MemoryPlanError) if args.host_memory else None,
        nvme_path=args.nvme_path,
    )


def _devices(args: argparse.Namespace) -> int:
    if args.devices is not None:
        return args.devices
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def run(args: argparse.Namespace) -> int:
    from lightspeed.core.zero.planner import (
        DEFAULT_SAFETY_MARGIN,
        Accounting,
        Cluster,
        explain_no_fit,
        format_table,
        plan,
        plan_to_dict,
    )

    counts = _counts(args)
    cluster = Cluster(_devices(args), args.nodes)
    accounting = options_from(Accounting, args)
    margin = DEFAULT_SAFETY_MARGIN if args.safety_margin is None else args.safety_margin
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import; stdout is for the result
        budgets = _budgets(args)
    result = plan(counts, cluster, budgets, accounting, margin)
    if args.json:
        print(json.dumps(plan_to_dict(result), indent=2))
    else:
        print(format_table(result))
    if result.choice is None:
        print(f"lightspeed estimate: error: {explain_no_fit(result)}", file=sys.stderr)
        return EXIT_USER_ERROR
    return EXIT_OK


COMMAND = Command(
    name="estimate",
    help="estimate ZeRO memory per device and per host, and pick the fastest option that fits",
    description="Estimate the memory of parameters, gradients and optimizer states per device and per host for every "
    "ZeRO option (DeepSpeed's accounting, extended to ZeRO-1, NVMe and several nodes), mark which fit, and pick the "
    "fastest that does.",
    epilog=_EPILOG,
    preformatted=True,
    add_arguments=add_arguments,
    run=run,
)
