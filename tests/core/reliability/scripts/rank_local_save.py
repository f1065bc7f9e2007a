"""Worker (torchrun, 3 ranks, gloo): :class:`StagedCheckpointSaver` with ``rank_local=True`` and
:func:`each_rank_its_own_path`. Every rank writes OUT/facts_rank<R>.json:

* ``own``: each rank saves OUT/rank<R>/ckpt (its file ``shard_<R>.bin`` of R+1 bytes; rank 0 also ``config.txt``);
  the files each directory holds afterwards;
* ``clash``: every rank writes ``same.bin`` into its own path; the error;
* ``shared`` / ``mixed``: :func:`each_rank_its_own_path` for one path on every rank, and for ranks 0 and 1 sharing
  one while rank 2 has its own; the result or the error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from _support.outcomes import error_text
from lightspeed.core.reliability.staged_saver import StagedCheckpointSaver, each_rank_its_own_path


def files_under(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    saver = StagedCheckpointSaver()
    target = out / f"rank{rank}" / "ckpt"
    saver.save(
        target,
        lambda staging: (staging / f"shard_{rank}.bin").write_bytes(b"x" * (rank + 1)),
        manifest={"writer": "test"},
        extra_files={"config.txt": "cfg"},
        rank_local=True,
    )
    facts = {"own": files_under(target)}
    clash = out / f"rank{rank}" / "clash"
    facts["clash"] = error_text(
        lambda: saver.save(clash, lambda staging: (staging / "same.bin").write_text("x"), manifest={}, rank_local=True)
    )
    facts["shared"] = each_rank_its_own_path(out / "one")
    facts["mixed"] = error_text(lambda: each_rank_its_own_path(out / ("ab" if rank < 2 else "c")))
    (out / f"facts_rank{rank}.json").write_text(json.dumps(facts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
