"""``lightspeed export CKPT OUT``: turn a DeepSpeed ZeRO checkpoint or a single-file Lightning checkpoint into
consolidated safetensors.

Exit codes (mapped by ``lightspeed.cli.main``): 0 written, 2 user error (bad checkpoint, output directory in the
way, bad option) with one message on stderr and the output directory untouched, 130 interrupted (also untouched).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from lightspeed.cli.usage import EXIT_OK, Command, add_deprecated_alias, options_from

if TYPE_CHECKING:
    from lightspeed.core.checkpoint.options import ExportOptions
    from lightspeed.core.checkpoint.safetensors_writer import Progress

__all__ = ["COMMAND", "DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = """\
Export a DeepSpeed ZeRO checkpoint (stages 0-3, CPU or NVMe offload, any world size) to safetensors in the
Hugging Face layout: model.safetensors, or model-0000k-of-0000N.safetensors shards plus
model.safetensors.index.json. Tensors are assembled one at a time from the rank files, so memory stays around
one tensor. A single-file Lightning checkpoint (trainer.save_checkpoint without DeepSpeed: single device, DDP,
XLA) is exported from its state_dict the same way; its optimizer states are never loaded. Keys are the
LightningModule's state_dict() names; tied weights are written once and restored by
lightspeed.export.load_exported. The output appears only when complete.

A node-local checkpoint (ZeroStrategy(node_local_storage=True): each node kept its own ranks' files) is exported
from every node's directory of one save, e.g. `lightspeed export node0/last.ckpt node1/last.ckpt OUT`; a node's
directory or files missing is an error (exit 2) naming the node and its ranks.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``lightspeed export``."""
    parser.add_argument(
        "checkpoint",
        nargs="+",
        help="ZeRO checkpoint directory (e.g. checkpoints/last.ckpt), one of its tag "
        "folders, or a single-file Lightning checkpoint; for a node-local checkpoint every node's directory "
        "(node0/last.ckpt node1/last.ckpt ...)",
    )
    parser.add_argument("output", help="output directory (must be missing or empty unless --overwrite)")
    parser.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="dtype of floating tensors (default: fp32; integer buffers keep theirs)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest shard, e.g. 2GB, 500MB, 1GiB, or 'none' for one file (default: 5GB)",
    )
    parser.add_argument(
        "--tag", default=None, help="tag of a ZeRO checkpoint directory to export (default: the one named in 'latest')"
    )
    parser.add_argument(
        "--exclude-frozen-parameters",
        action="store_true",
        help="leave out parameters with requires_grad=False, as the strategies' exclude_frozen_parameters does for "
        "checkpoints (ZeRO stages 1-3 only: single-file checkpoints do not record it)",
    )
    add_deprecated_alias(parser, "--exclude-frozen", "--exclude-frozen-parameters")
    parser.add_argument(
        "--strip-prefix",
        default=None,
        metavar="PREFIX",
        help="export only keys under PREFIX, without it (e.g. 'model.' for a wrapped HF model)",
    )
    parser.add_argument(
        "--hf-config",
        default=None,
        metavar="PATH",
        help="a Hugging Face config.json, or the directory holding it (its generation_config.json too), copied "
        "beside the weights so that from_pretrained(OUT) loads the export",
    )
    parser.add_argument(
        "--peft",
        choices=["adapter", "full"],
        default="adapter",
        help="a checkpoint of a PEFT model: its adapter in PEFT's layout (adapter_model.safetensors + "
        "adapter_config.json, default) or the whole state_dict (full)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")


def _options(args: argparse.Namespace) -> ExportOptions:
    """The export options the command line asked for (validated: a bad shard size raises ExportError)."""
    from lightspeed.core.checkpoint.options import ExportOptions

    max_shard_size = None if str(args.max_shard_size).lower() == "none" else args.max_shard_size
    return options_from(ExportOptions, args, max_shard_size=max_shard_size)


def _progress_bar(enabled: bool) -> tuple[Progress | None, Any]:
    if not enabled:
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=0, unit="B", unit_scale=True, desc="exporting", file=sys.stderr, leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    return update, bar


def run(args: argparse.Namespace) -> int:
    """Run the export; returns the exit code."""
    from lightspeed.core.checkpoint.exporter import export_checkpoint_path

    # CheckpointError / ExportError / Ctrl-C reach lightspeed.cli.main, which prints one line and exits 2 / 130
    options = _options(args)
    progress, bar = _progress_bar(not args.quiet and sys.stderr.isatty())
    try:
        checkpoint = args.checkpoint[0] if len(args.checkpoint) == 1 else args.checkpoint
        result = export_checkpoint_path(checkpoint, args.output, options, progress)
    finally:
        if bar is not None:
            bar.close()
    if not args.quiet:  # the result line also when piped or logged (only the progress bar needs a terminal)
        print(
            f"wrote {result.num_tensors} tensors ({result.total_bytes / 1e6:.1f} MB) in {len(result.files)} file(s) "
            f"to {result.output_dir}"
        )
    return EXIT_OK


COMMAND = Command(
    name="export",
    help="export a ZeRO or single-file Lightning checkpoint to consolidated safetensors",
    description=DESCRIPTION,
    preformatted=True,
    add_arguments=add_arguments,
    run=run,
)
