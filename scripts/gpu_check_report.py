"""Writes ``OUT_DIR/results.json`` for ``scripts/gpu_check.sh``: the device, each phase's exit status and seconds,
every gpu test's outcome (failures with their message), and the throughput figures with their ratios.

usage: gpu_check_report.py OUT_DIR [PHASE=STATUS:SECONDS ...]
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

#: (variant, baseline): the ratios of samples/s the benchmark's targets are about
RATIOS = (("trainer", "engine"), ("trainer", "lightning"), ("fabric", "engine"))


def device() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()}
    if torch.cuda.is_available():
        info["name"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return info


def tests(junit: Path) -> dict:
    """Counts and, per test, its outcome (``passed``, ``failed``, ``error``, ``skipped``) and seconds; failures keep
    the first lines of their message."""
    if not junit.is_file():
        return {"missing": str(junit)}
    cases, counts = {}, {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag
                message = ((child.get("message") or "") + "\n" + (child.text or ""))[:1500]
        counts[outcome] += 1
        cases[name] = {"outcome": outcome, "seconds": round(float(case.get("time", 0)), 1)}
        if outcome in ("failed", "error"):
            cases[name]["message"] = message
    return {"counts": counts, "cases": cases}


def throughput(path: Path) -> dict:
    """Per preset: the median samples/s of each variant over the repeats and the median per-repeat ratios."""
    if not path.is_file():
        return {"missing": str(path)}
    record = json.loads(path.read_text())
    rows = {}
    for row in record["rows"]:
        rates = row["samples_per_s"]
        cells = {variant: round(statistics.median(values), 1) for variant, values in rates.items()}
        for numerator, denominator in RATIOS:
            if numerator in rates and denominator in rates:
                paired = [a / b for a, b in zip(rates[numerator], rates[denominator], strict=True)]
                cells[f"{numerator}/{denominator}"] = round(statistics.median(paired), 3)
        rows[row["name"]] = cells
    return {"args": record["args"], "samples_per_s": rows}


def main() -> None:
    out = Path(sys.argv[1])
    phases = {}
    for item in sys.argv[2:]:
        name, _, value = item.partition("=")
        status, _, seconds = value.partition(":")
        phases[name] = {"exit": int(status or -1), "seconds": int(seconds or 0)}
    result = {
        "device": device(),
        "phases": phases,
        "tests": tests(out / "junit.xml"),
        "throughput": throughput(out / "throughput.json"),
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    counts = result["tests"].get("counts")
    print(f"[gpu_check] {result['device']}; phases {phases}; tests {counts}")
    for name, case in result["tests"].get("cases", {}).items():
        if case["outcome"] in ("failed", "error"):
            print(f"[gpu_check] {case['outcome'].upper()} {name}: {case['message'][:300]}")
    print(f"[gpu_check] throughput {json.dumps(result['throughput'].get('samples_per_s'))}")


if __name__ == "__main__":
    main()
