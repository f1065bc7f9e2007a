"""Worker: in a process that sees no GPU, export a ZeRO checkpoint (trained on a GPU) offline and load that export
into a fresh module, as a user without a GPU would.

usage: CUDA_VISIBLE_DEVICES= export_on_cpu.py CHECKPOINT EXPORT_DIR DTYPE OUT_FILE
OUT_FILE (torch.save): the fresh module's state dict, load_exported's (missing, unexpected) and whether CUDA was seen.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from zero_export_fit import LitLM  # noqa: E402

from lightspeed.export import export_checkpoint, load_exported  # noqa: E402


def main() -> None:
    checkpoint, export_dir, dtype, out = sys.argv[1:5]
    export_checkpoint(checkpoint, export_dir, dtype=dtype)
    fresh = LitLM("tiny")
    outcome = load_exported(fresh, export_dir)
    torch.save({"state": fresh.state_dict(), "load": outcome, "cuda_available": torch.cuda.is_available()}, Path(out))


if __name__ == "__main__":
    main()
