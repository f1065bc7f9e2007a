"""The notebook's zero3_offload fit run as a script (Lightning re-runs this file per rank): executes the cell
tagged "setup" of examples/notebook.ipynb, so model, data and Trainer settings are the notebook's own.

usage: notebook_reference.py OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat

NOTEBOOK = Path(__file__).resolve().parents[3] / "examples" / "notebook.ipynb"

if __name__ == "__main__":
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)
    setup = next(c for c in nbformat.read(NOTEBOOK, as_version=4).cells if "setup" in c.metadata.get("tags", []))
    namespace: dict = {"__name__": "__main__"}
    exec(compile(setup.source, f"{NOTEBOOK}:setup", "exec"), namespace)  # noqa: S102 - the notebook's own code
    trainer = namespace["make_trainer"](
        "zero3_offload",
        callbacks=[namespace["GatherForMetrics"]({"mse": namespace["mse"]}), namespace["ZeroExport"]("export_script")],
    )
    trainer.fit(namespace["Regression"](), namespace["train_loader"], namespace["val_loader"])
