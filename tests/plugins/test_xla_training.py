"""Training on PJRT's CPU device with ``accelerator="xla"`` in every precision mode (one fit per mode, shared).

Needs torch_xla: runs in the XLA environment (``scripts/setup_xla.sh``, then
``.venv-xla/bin/python -m pytest -m xla tests/plugins tests/strategies/test_xla*.py``); skipped elsewhere.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
pytest.importorskip(
    "torch_xla",
    reason="needs torch_xla; run scripts/setup_xla.sh and test in .venv-xla "
    "(pytest -m xla tests/plugins tests/strategies)",
)

import lightning as L  # noqa: E402
import torch  # noqa: E402

import lightspeed  # noqa: E402,F401  (registers accelerator="xla")
from lightspeed.plugins import XLAPrecision  # noqa: E402
from lightspeed.plugins.precision.xla import DEPRECATED_XLA_ENV_VARS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies" / "scripts"))
import xla_model  # noqa: E402

pytestmark = pytest.mark.xla

MODES = ("32-true", "bf16-true", "bf16-downcast", "bf16-mixed")
EPOCHS = 2
# stated tolerance for bf16-mixed against fp32: every micro-batch loss within 2% (relative) + 2e-3 (absolute)
MIXED_RTOL, MIXED_ATOL = 2e-2, 2e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Fit once per mode on XLA:CPU; save a checkpoint after each; record what the tests compare."""
    root = tmp_path_factory.mktemp("xla_runs")
    env_before = {k: os.environ.get(k) for k in DEPRECATED_XLA_ENV_VARS}
    results = {}
    for mode in MODES:
        model = xla_model.XLATestModule()
        trainer = L.Trainer(
            plugins=[XLAPrecision(mode)], **xla_model.trainer_kwargs(str(root / mode), max_epochs=EPOCHS)
        )
        trainer.fit(model, xla_model.make_loader())
        ckpt = root / f"{mode}.ckpt"
        trainer.save_checkpoint(ckpt)
        results[mode] = {
            "model": model,
            "trainer": trainer,
            "ckpt": ckpt,
            "env_after": {k: os.environ.get(k) for k in DEPRECATED_XLA_ENV_VARS},
        }
    results["env_before"] = env_before
    return results


@pytest.mark.parametrize("mode", MODES)
def test_parameter_dtypes_after_fit_follow_the_mode(runs: dict, mode: str) -> None:
    net = runs[mode]["model"].net
    layers, param64, buffer64 = xla_model.EXPECTED_DTYPES[mode]
    assert {p.dtype for p in (*net.hidden.parameters(), *net.out.parameters())} == {layers}
    assert net.gain64.dtype == param64
    assert net.shift64.dtype == buffer64
    assert net.calls.dtype == torch.long  # integer buffers are never cast
    assert runs[mode]["trainer"].strategy.precision_plugin.precision == mode


def test_fp32_on_xla_matches_plain_pytorch_exact_accumulation(runs: dict) -> None:
    """32-true on XLA:CPU with accumulate_grad_batches=3 over 10 batches (windows 3, 3, 3, 1) equals a plain PyTorch
    loop stepping on each window's big-batch mean loss: the short last window is weighted by its real size."""
    ref_state, ref_losses = xla_model.reference_exact_training(EPOCHS)
    model = runs["32-true"]["model"]
    assert model.step_losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for name, value in model.net.state_dict().items():
        torch.testing.assert_close(value.cpu(), ref_state[name], rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_mixed_loss_curve_stays_within_tolerance_of_fp32(runs: dict) -> None:
    fp32 = torch.tensor(runs["32-true"]["model"].step_losses)
    mixed = torch.tensor(runs["bf16-mixed"]["model"].step_losses)
    assert len(mixed) == len(fp32) == EPOCHS * 10
    torch.testing.assert_close(mixed, fp32, rtol=MIXED_RTOL, atol=MIXED_ATOL)
    assert not torch.equal(mixed, fp32), "bf16-mixed must really compute in bfloat16"
    # the loss really went down in both
    assert mixed[-3:].mean() < mixed[:3].mean()


def test_bf16_mixed_autocasts_but_keeps_float32_master_weights(runs: dict) -> None:
    model = runs["bf16-mixed"]["model"]
    assert set(model.loss_dtypes) == {torch.float32}  # mse_loss runs in float32 under autocast
    assert set(model.probe.seen_dtypes) == {torch.float32}  # metrics see float32 (linear outputs were bfloat16)


@pytest.mark.parametrize(
    ("mode", "metric_input"),
    [
        ("bf16-true", torch.bfloat16),
        ("bf16-downcast", torch.float32),
        ("bf16-mixed", torch.float32),
        ("32-true", torch.float32),
    ],
)
def test_metrics_and_logged_values_are_float32_in_downcast_and_mixed(
    runs: dict, mode: str, metric_input: torch.dtype
) -> None:
    run = runs[mode]
    model = run["model"]
    assert set(model.probe.seen_dtypes) == {metric_input}
    assert model.mse.sum_squared_error.dtype == torch.float32  # metric states are never cast down
    assert run["trainer"].callback_metrics["loss"].dtype == torch.float32


def test_deprecated_xla_environment_variables_are_never_set(runs: dict) -> None:
    for mode in MODES:
        assert runs[mode]["env_after"] == runs["env_before"], mode
    assert all(os.environ.get(k) is None for k in DEPRECATED_XLA_ENV_VARS)


def _tensors(obj: object):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


@pytest.mark.parametrize("mode", ["32-true", "bf16-downcast"])
def test_checkpoint_saved_from_xla_holds_cpu_tensors_and_loads_into_a_cpu_model(runs: dict, mode: str) -> None:
    checkpoint = torch.load(runs[mode]["ckpt"], map_location=None, weights_only=False)
    tensors = list(_tensors(checkpoint))
    assert tensors and {t.device.type for t in tensors} == {"cpu"}
    assert checkpoint["optimizer_states"][0]["state"], "optimizer momentum buffers are saved too"

    trained = runs[mode]["model"]
    fresh = xla_model.XLATestModule(seed=1)
    fresh.net.load_state_dict(
        {k[len("net.") :]: v for k, v in checkpoint["state_dict"].items() if k.startswith("net.")}
    )
    for name, value in trained.net.state_dict().items():
        assert torch.equal(fresh.net.state_dict()[name].to(value.dtype), value.cpu()), name
    x = xla_model.make_dataset().tensors[0][:4]
    layers_dtype = xla_model.EXPECTED_DTYPES[mode][0]
    trained_cpu = xla_model.Net()  # a CPU copy: `Module.to` would change the shared trained model in place
    trained_cpu.load_state_dict({k: v.cpu() for k, v in trained.net.state_dict().items()})
    torch.testing.assert_close(
        fresh.net.to(layers_dtype)(x.to(layers_dtype)), trained_cpu.to(layers_dtype)(x.to(layers_dtype))
    )


def test_export_reads_a_checkpoint_trained_on_xla(runs: dict, tmp_path: Path) -> None:
    from lightspeed.export import export_checkpoint, load_exported

    export_checkpoint(runs["bf16-downcast"]["ckpt"], tmp_path / "export", dtype="fp32")
    fresh = xla_model.XLATestModule(seed=1)
    load_exported(fresh, tmp_path / "export")
    trained = runs["bf16-downcast"]["model"]
    for name, value in trained.net.state_dict().items():
        exported = fresh.net.state_dict()[name]
        assert torch.equal(exported, value.cpu().to(exported.dtype)), name
