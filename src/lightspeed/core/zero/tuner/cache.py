"""The tuner's decisions, kept in a small JSON file so that the next run of the same job skips the trials.

A decision is keyed by everything that changes which candidate is fastest: the model's parameter shapes and dtypes,
the number of processes, the precision, the hardware (device name and count, CPU cores, host memory) and the
candidates that were allowed. Any other key is never reused: a cache written for another model or world size is
ignored, and the caller says so once.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightspeed.core.reliability.staging import save_file_atomically

__all__ = ["DEFAULT_CACHE_PATH", "CachedDecision", "TuningKey", "TuningCache"]

#: where decisions are kept unless ``tune_cache=`` says otherwise
DEFAULT_CACHE_PATH = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightspeed" / "zero_tune.json"
_VERSION = 1


def _hardware(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {"device_type": device.type, "cpu_count": os.cpu_count()}
    if device.type == "cuda" and torch.cuda.is_available():
        facts["device_name"] = torch.cuda.get_device_name(device)
        facts["device_memory"] = torch.cuda.get_device_properties(device).total_memory
    try:
        facts["host_memory"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return facts


@dataclass(frozen=True)
class TuningKey:
    """What a decision depends on; ``digest`` is the cache key, ``summary`` a readable description of it."""

    digest: str
    summary: dict[str, Any]

    @classmethod
    def of(
        cls,
        module: torch.nn.Module,
        *,
        world_size: int,
        precision: str,
        device: torch.device,
        candidates: Sequence[str],
        micro_batch: int | None,
        accumulation: int = 1,
    ) -> TuningKey:
        shapes = [
            (name, list(getattr(p, "ds_shape", p.shape)), str(p.dtype), bool(p.requires_grad))
            for name, p in module.named_parameters()
        ]
        model = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
        parameters = sum(int(torch.Size(shape).numel()) for _, shape, _, _ in shapes)
        summary = {
            "model": model,
            "parameters": parameters,
            "world_size": world_size,
            "precision": precision,
            "micro_batch": micro_batch,
            "accumulation": accumulation,
            "hardware": _hardware(device),
            "candidates": list(candidates),
        }
        return cls(hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:24], summary)


@dataclass(frozen=True)
class CachedDecision:
    """A decision read back: the chosen candidate's name and the measured samples/s of every candidate."""

    chosen: str
    samples_per_second: dict[str, float | None]


class TuningCache:
    """The JSON file of decisions at ``path`` (created on the first store)."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else DEFAULT_CACHE_PATH

    def _entries(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != _VERSION or not isinstance(data.get("entries"), dict):
            return {}
        return data["entries"]

    def lookup(self, key: TuningKey) -> tuple[CachedDecision | None, int]:
        """The decision stored under ``key`` (None if there is none) and how many decisions for other keys the file
        holds."""
        entries = self._entries()
        entry = entries.get(key.digest)
        others = len(entries) - (1 if entry is not None else 0)
        if not isinstance(entry, dict) or entry.get("key") != key.summary:
            return None, others
        return CachedDecision(str(entry["chosen"]), dict(entry.get("samples_per_second", {}))), others

    def store(
        self, key: TuningKey, chosen: str, samples_per_second: dict[str, float | None], *, writer: bool = True
    ) -> None:
        """Add (or replace) the decision for ``key``; the ``writer`` rank replaces the file atomically (a collective
        when several processes run: every rank calls it)."""
        entries = self._entries() if writer else {}
        entries[key.digest] = {"key": key.summary, "chosen": chosen, "samples_per_second": samples_per_second}
        payload = json.dumps({"version": _VERSION, "entries": entries}, indent=1, sort_keys=True)

        def write(target: Path) -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(payload)

        save_file_atomically(self.path, write, writer=writer)
