"""``lightspeed tune``: measure which ZeRO option trains a job fastest on this machine and cache the decision, so that
``ZeroAutoStrategy(tune=True)`` in the real run skips the trials."""

from __future__ import annotations

import argparse
from typing import Any

from lightspeed.cli.usage import (
    DEVICE_MEMORY_HELP,
    EXIT_OK,
    HOST_MEMORY_HELP,
    PRECISIONS_TEXT,
    Command,
    UsageError,
    add_accelerator_argument,
)

_EPILOG = """\
examples:
  lightspeed tune my_pkg.train:job --devices 2 --accelerator cpu
  lightspeed tune my_pkg.train:job --devices 8 --precision bf16-mixed --options zero2,zero3 --buckets --retune
  lightspeed tune my_pkg.train:job --devices 8 --accumulate 4 --micro-batches 4,16

The factory is called with no arguments in every process and returns (LightningModule, data): data is a training
DataLoader or a LightningDataModule. The trials run a few steps of each option that fits on copies of the model; the
decision goes into the cache that ZeroAutoStrategy(tune=True) reads (same model shapes, world size, precision,
micro-batch size, accumulation, hardware and options; with --micro-batches pass the run's tune_micro_batches too).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``lightspeed tune``."""
    parser.add_argument("factory", help="package.module:function returning (LightningModule, DataLoader/DataModule)")
    parser.add_argument("--devices", type=int, default=1, help="processes per node (default 1)")
    add_accelerator_argument(parser, "auto (default): the GPUs when there are any, else the CPU")
    parser.add_argument(
        "--precision",
        default="32-true",
        help=f"Lightning precision: {PRECISIONS_TEXT} (default 32-true, as the Trainer's)",
    )
    parser.add_argument("--steps", type=int, default=3, help="measured steps per option (default 3)")
    parser.add_argument("--options", help="comma-separated option names to try (default: every option that fits)")
    parser.add_argument("--buckets", action="store_true", help="also try DeepSpeed's own bucket sizes")
    parser.add_argument("--cache", help="the decisions file (default ~/.cache/lightspeed/zero_tune.json)")
    parser.add_argument("--retune", action="store_true", help="measure even when the cache holds a decision")
    parser.add_argument(
        "--micro-batches",
        help="comma-separated micro-batch sizes to try as well, each keeping batch_size x --accumulate per step",
    )
    parser.add_argument(
        "--accumulate", type=int, default=1, help="the run's accumulate_grad_batches (default 1; the cache keys on it)"
    )
    parser.add_argument("--device-memory", metavar="SIZE", help=DEVICE_MEMORY_HELP)
    parser.add_argument("--host-memory", metavar="SIZE", help=HOST_MEMORY_HELP)


def _job(path: str) -> tuple[Any, Any]:
    import lightning.pytorch as pl

    from lightspeed.core.zero.planner.measure import resolve_factory

    built = resolve_factory(path)()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], pl.LightningModule)):
        raise UsageError(
            f"{path} returned {type(built).__name__}; it must return (LightningModule, DataLoader or DataModule)."
        )
    return built[0], built[1]


def run(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl

    from lightspeed.core.zero.tuner import DEFAULT_CACHE_PATH
    from lightspeed.strategies.zero_auto import ZeroAutoStrategy

    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}.")
    if args.accumulate < 1:
        raise UsageError(f"--accumulate must be at least 1, got {args.accumulate}.")
    try:
        micro_batches = [int(size) for size in args.micro_batches.split(",")] if args.micro_batches else None
    except ValueError:
        raise UsageError(f"--micro-batches takes sizes such as 2,4,8; got {args.micro_batches!r}.") from None
    module, data = _job(args.factory)
    strategy = ZeroAutoStrategy(
        tune=True,
        tune_steps=args.steps,
        tune_options=[name.strip() for name in args.options.split(",")] if args.options else None,
        tune_buckets=args.buckets,
        tune_cache=args.cache,
        retune=args.retune,
        tune_micro_batches=micro_batches,
        host_memory=args.host_memory,
        device_memory=args.device_memory,
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        accumulate_grad_batches=args.accumulate,
        max_steps=0,  # the trials run while the strategy is set up; nothing trains afterwards
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if isinstance(data, pl.LightningDataModule):
        trainer.fit(module, datamodule=data)
    else:
        trainer.fit(module, train_dataloaders=data)
    if trainer.is_global_zero and strategy.chosen_option is not None:
        cache = strategy.tune_request.cache_path or DEFAULT_CACHE_PATH
        micro = f" with micro-batches of {strategy.tuned_micro_batch}" if strategy.tuned_micro_batch else ""
        accumulate = f" and accumulate_grad_batches={trainer.accumulate_grad_batches}" if micro else ""
        print(f"lightspeed tune: {strategy.chosen_option.name}{micro}{accumulate} (decision in {cache})")
    return EXIT_OK


COMMAND = Command(
    name="tune",
    help="measure the ZeRO options that fit and cache the fastest for ZeroAutoStrategy(tune=True)",
    description="Run a few real training steps of every ZeRO option the memory planner says fits, in the processes "
    "of one launch, print samples/s and peak memory of each, and cache the fastest.",
    epilog=_EPILOG,
    preformatted=True,
    add_arguments=add_arguments,
    run=run,
)
