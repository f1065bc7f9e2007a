"""Notebook launch: examples/notebook.ipynb executed in a real Jupyter kernel (nbclient + ipykernel), compared with
the same fit run as a script; the CUDA-initialised refusal before any process starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from _support.launch import REPO_ROOT, run_python

NOTEBOOK = REPO_ROOT / "examples" / "notebook.ipynb"
REFERENCE = REPO_ROOT / "tests" / "strategies" / "scripts" / "notebook_reference.py"


def _kernel_spec(root: Path) -> str:
    """A kernel spec for this interpreter (the venv's python), found through JUPYTER_PATH."""
    spec = root / "kernels" / "lightspeed-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT / "src")}
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "lightspeed", "language": "python", "env": env})
    )
    return "lightspeed-test"


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    import nbformat  # installed with the test extra (nbclient, ipykernel): a missing one fails, not skips
    from nbclient import NotebookClient

    root = tmp_path_factory.mktemp("notebook")
    work = root / "work"
    work.mkdir()
    mp = pytest.MonkeyPatch()
    mp.setenv("JUPYTER_PATH", str(root))
    try:
        nb = nbformat.read(NOTEBOOK, as_version=4)
        client = NotebookClient(
            nb, kernel_name=_kernel_spec(root), timeout=600, resources={"metadata": {"path": str(work)}}
        )
        client.execute()
    finally:
        mp.undo()
    printed = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stdout":
                printed += [json.loads(line) for line in output["text"].splitlines() if line.startswith("{")]
    run_python(REFERENCE, [root / "script"])
    return root, printed


def _printed(executed: tuple[Path, list[dict]], key: str) -> dict:
    return next(entry for entry in executed[1] if key in entry)


def test_every_lightspeed_strategy_forks_in_a_jupyter_kernel(executed: tuple[Path, list[dict]]) -> None:
    facts = _printed(executed, "launchers")
    assert facts["interactive"] is True
    assert {"zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_nvme", "zero_auto", "ddp_exact"} <= set(
        facts["launchers"]
    )
    assert set(facts["launchers"].values()) == {"LightspeedForkLauncher"}


def test_notebook_model_holds_the_weights_of_the_same_run_as_a_script(executed: tuple[Path, list[dict]]) -> None:
    root, _ = executed
    from lightspeed.export import load_exported

    notebook = torch.load(root / "work" / "notebook_zero3.pt")
    script = {k: torch.empty_like(v) for k, v in notebook.items()}
    module = torch.nn.Module()
    module.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    load_exported(module, root / "script" / "export_script")
    script = module.state_dict()
    for key, value in notebook.items():
        diff = (value - script[key]).abs().max().item()
        assert diff <= 1e-6, f"{key}: the notebook's model differs from the script run by {diff:.3e}"
    assert _printed(executed, "fit_metrics")["weights_changed_by"] > 1e-3
    exported = (root / "work" / "export_notebook" / "model.safetensors").read_bytes()
    assert exported == (root / "script" / "export_script" / "model.safetensors").read_bytes()


def test_callback_metrics_next_cell_validate_and_export(executed: tuple[Path, list[dict]]) -> None:
    metrics = _printed(executed, "fit_metrics")["fit_metrics"]
    assert {"train_loss", "val_loss", "val/mse"} <= set(metrics)
    after = _printed(executed, "validate")
    assert after["export_vs_model"] == 0.0
    # 20 validation samples over 2 ranks: GatherForMetrics drops the sampler's duplicates, so val/mse is the
    # single-process value on the notebook's trained model
    assert after["validate"]["val/mse"] == pytest.approx(after["local_val_loss"], abs=1e-6)
    ddp = _printed(executed, "ddp_metrics")["ddp_metrics"]
    assert {"train_loss", "val_loss", "val/mse"} <= set(ddp)
    ddp_weights = torch.load(executed[0] / "work" / "notebook_ddp_exact.pt")
    zero_weights = torch.load(executed[0] / "work" / "notebook_zero3.pt")
    assert (ddp_weights["net.0.weight"] - zero_weights["net.0.weight"]).abs().max() > 0  # its own training happened


def test_cuda_initialised_before_a_fork_launch_is_refused_before_any_process_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No GPU here: CUDA's "initialised" state is simulated; a real CUDA context cannot be created on this machine.
    import lightning as L
    import torch.multiprocessing as mp

    import lightspeed  # noqa: F401
    from _support.models import RegressionModule
    from lightspeed.core.errors import CudaInitializedError
    from lightspeed.strategies.zero import ZeroStrategy

    started = []
    monkeypatch.setattr(mp, "start_processes", lambda *a, **k: started.append(a))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=2, start_method="fork"), accelerator="cpu", devices=2, logger=False)
    with pytest.raises(CudaInitializedError) as caught:
        trainer.fit(RegressionModule())
    assert str(caught.value).startswith(
        "CUDA was initialised in this process before `trainer.fit`/`validate` (for example by `model.cuda()`"
    )
    assert "Restart the kernel and do not touch CUDA before calling the Trainer" in str(caught.value)
    assert started == []
