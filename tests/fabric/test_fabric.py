"""lightspeed under Lightning Fabric, in real 2- and 3-rank CPU runs (gloo): every ZeRO stage with and without
offload equals a single-process loop, exact accumulation (the toy ends at w = 2.04; a short last window weighs
2/2), num_items weighting, clipping, crash-safe save/load with exact resume and export, gather_for_metrics on
3 ranks, and the bad-input errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

import lightspeed
from _support.launch import REPO_ROOT, child_env, run_torchrun
from _support.models import make_net, make_regression_data, reference_training
from lightspeed.core.errors import DeepSpeedConfigError, IncompleteCheckpointError
from lightspeed.core.reliability import staging as atomic_dir
from lightspeed.core.zero.config import ZERO_PRESETS
from lightspeed.core.zero.tuner.decision import TUNE_MARGIN
from lightspeed.export import export_checkpoint

SCRIPTS = REPO_ROOT / "tests" / "fabric" / "scripts"
sys.path.insert(0, str(SCRIPTS))
import fabric_cases  # noqa: E402  (the worker's data and models, so the references use the same ones)

TRAIN_NAMES = [
    "zero1",
    "zero1_offload",
    "zero2",
    "zero2_offload",
    "zero3",
    "zero3_offload_optimizer",
    "zero3_offload",
    "zero_auto",
]
ACCUM_NAMES = ["ddp_exact", "zero1", "zero2", "zero3"]
RESUME_NAMES = ["zero2", "zero3_offload"]
FULL_NAMES = ["zero1", "zero2", "zero3", "zero3_offload"]
CONFIG_OPTIMIZER_NAMES = ["zero1", "zero2", "zero3"]
WORLD = 2


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fabric_cases")
    specs = (
        [f"train:{n}" for n in TRAIN_NAMES]
        + [f"accum:{n}" for n in ACCUM_NAMES]
        + [f"resume:{n}" for n in RESUME_NAMES]
        + [f"full:{n}" for n in FULL_NAMES]
        + [f"config_opt:{n}" for n in CONFIG_OPTIMIZER_NAMES]
        + [f"torch_sched:{n}" for n in CONFIG_OPTIMIZER_NAMES]
        + ["tune:zero_auto"]
        + ["errors:zero2", "errors:zero3"]
    )
    run_torchrun(SCRIPTS / "fabric_cases.py", WORLD, [out, ",".join(specs)], timeout=600)
    return out


def _meta(out: Path, label: str) -> dict:
    meta = json.loads((out / f"{label}.json").read_text())
    assert "crash" not in meta, meta.get("crash")
    return meta


# --------------------------------------------------------------------------------------------- registration
def test_every_strategy_name_is_registered_with_fabric(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    monkeypatch.setenv("LIGHTSPEED_NVME_PATH", str(tmp_path))  # zero3_nvme needs a swap directory

    for name, preset in ZERO_PRESETS.items():
        strategy = STRATEGY_REGISTRY.get(name)
        assert type(strategy) is lightspeed.fabric.ZeroFabricStrategy
        assert strategy.stage == preset.stage
        assert strategy.offloads_optimizer == (preset.offload_optimizer != "none")
    assert type(STRATEGY_REGISTRY.get("zero_auto")) is lightspeed.fabric.ZeroAutoFabricStrategy
    assert type(STRATEGY_REGISTRY.get("ddp_exact")) is lightspeed.fabric.DDPExactFabricStrategy


# --------------------------------------------------------------------------------------------- equivalence
@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return {k.removeprefix("net."): v for k, v in reference_training(steps=4, world_size=WORLD, batch=4).items()}


@pytest.mark.parametrize("name", TRAIN_NAMES)
def test_zero_loop_matches_single_process(cases: Path, reference: dict[str, torch.Tensor], name: str) -> None:
    meta = _meta(cases, f"train_{name}")
    weights = torch.load(cases / f"train_{name}.pt")
    assert meta["world_size"] == WORLD
    # zero_auto: what it chose from this machine's memory
    preset = meta["chosen"] if name == "zero_auto" else vars(ZERO_PRESETS[name])
    assert meta["stage"] == preset["stage"]
    assert sorted(weights) == sorted(reference)
    for key, expected in reference.items():
        diff = (weights[key] - expected).abs().max().item()
        assert diff <= 1e-5, f"{name}: {key} differs from the single-process loop by {diff:.3e}"
    initial = make_net().state_dict()
    assert (weights["0.weight"] - initial["0.weight"]).abs().max() > 1e-3  # it trained
    offloaded = preset["offload_optimizer"] != "none"
    assert meta["optimizer"] == ("DeepSpeedCPUAdam" if offloaded else "AdamW")  # CPU optimizer conversion
    assert meta["sharded_init"] == name.startswith("zero3")  # fabric.init_module() partitioned the model


# --------------------------------------------------------------------------------------------- accumulation
def _rank_micro_batches(n: int, batch: int) -> list[list[list[int]]]:
    """Per rank, the index lists of its micro-batches, as Fabric's DistributedSampler (no shuffling) gives them."""
    out = []
    for rank in range(WORLD):
        indices = list(DistributedSampler(range(n), num_replicas=WORLD, rank=rank, shuffle=False))
        out.append([indices[i : i + batch] for i in range(0, len(indices), batch)])
    return out


def _windowed_reference(
    data: TensorDataset,
    model: nn.Linear,
    lr: float,
    mode: str,
    steps: int = 4,
    short_weight: str = "real",
    norms: list[float] | None = None,
    grads: list[dict[str, torch.Tensor]] | None = None,
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """One epoch of plain single-process SGD, one step per window on every sample the window saw on all ranks
    (``norms`` collects the total gradient norm of each step before clipping, ``grads`` each step's gradient).

    ``short_weight="per_window"`` is the inexact rule (each micro-batch weighs 1/steps, so a short window counts
    ``len/steps``), used to show that the test tells the two apart."""
    micro = _rank_micro_batches(len(data), batch=2)
    per_rank = len(micro[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    sizes = []
    for start in range(0, per_rank, steps):
        window = [i for rank in micro for mb in rank[start : start + steps] for i in mb]
        sizes.append(min(steps, per_rank - start))
        x, y = data.tensors[0][window], data.tensors[1][window]
        optimizer.zero_grad()
        error = (model(x) - y).pow(2).squeeze(1)
        if mode == "items":
            loss = (error * data.tensors[2][window]).sum() / data.tensors[2][window].sum()
        else:
            loss = error.mean()
        if short_weight == "per_window":
            loss = loss * sizes[-1] / steps
        loss.backward()
        if grads is not None:
            grads.append({k: p.grad.detach().flatten().clone() for k, p in model.named_parameters()})
        if mode == "clip":
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), fabric_cases.CLIP)
            if norms is not None:
                norms.append(float(total))
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, sizes


def _assert_weights(got: dict[str, list[float]], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        diff = (torch.tensor(got[key]) - value.flatten()).abs().max().item()
        assert diff <= 1e-6, f"{what}: {key} differs from the single-process reference by {diff:.3e}"


@pytest.mark.parametrize("name", ACCUM_NAMES)
def test_accumulation_toy_ends_at_2_04(cases: Path, name: str) -> None:
    toy = _meta(cases, f"accum_{name}")["toy"]
    expected, sizes = _windowed_reference(
        fabric_cases.toy_data(), fabric_cases.linear(1, True), fabric_cases.TOY_LR, "mean"
    )
    _assert_weights(toy["weights"], expected, f"{name} toy")
    assert toy["weights"]["weight"][0] == pytest.approx(2.04, abs=1e-5)
    assert toy["steps"] == 1 and toy["window_sizes"] == sizes == [2]  # 2 micro-batches per rank: one short window


@pytest.mark.parametrize("name", ACCUM_NAMES)
@pytest.mark.parametrize("mode", ["mean", "items", "clip"])
def test_accumulation_short_last_window_items_and_clipping(cases: Path, name: str, mode: str) -> None:
    run = _meta(cases, f"accum_{name}")[mode]
    data = fabric_cases.accum_data()
    norms: list[float] = []
    grads: list[dict[str, torch.Tensor]] = []
    expected, sizes = _windowed_reference(
        data, fabric_cases.linear(3, False), fabric_cases.ACCUM_LR, mode, norms=norms, grads=grads
    )
    assert sizes == [4, 4, 2]  # a 10-batch epoch with accumulation 4
    # read between the window's last backward and the step, the gradients are the window's big-batch gradient
    assert len(run["grads"]) == len(grads)
    for step, (seen, want) in enumerate(zip(run["grads"], grads, strict=True)):
        assert sorted(seen) == sorted(want)
        for key, value in want.items():
            torch.testing.assert_close(torch.tensor(seen[key]), value, rtol=1e-6, atol=1e-6, msg=f"step {step} {key}")
    assert run["steps"] == 3 and run["window_sizes"] == sizes
    # gradients are reduced only on each window's last micro-batch (DDP no_sync / the engine's boundary)
    assert run["syncs"] == [False, False, False, True] * 2 + [False, True]
    _assert_weights(run["weights"], expected, f"{name} {mode}")
    # fabric.clip_gradients returns the total norm before clipping, as Lightning's strategies do
    assert run["norms"] == pytest.approx(norms, rel=1e-5) and len(norms) == (3 if mode == "clip" else 0)
    if mode == "mean":
        assert run["factors"] == [WORLD / 16, WORLD / 16, WORLD / 8]  # W / T: the last window weighs 2/2
        inexact, _ = _windowed_reference(
            data, fabric_cases.linear(3, False), fabric_cases.ACCUM_LR, mode, short_weight="per_window"
        )
        gap = max((torch.tensor(run["weights"][k]) - v.flatten()).abs().max().item() for k, v in inexact.items())
        assert gap > 1e-3  # weighting the short window 2/4 would give visibly other weights


@pytest.mark.parametrize("name", ACCUM_NAMES)
def test_fabrics_no_backward_sync_idiom_is_the_plain_accumulation_it_writes(cases: Path, name: str) -> None:
    """``with fabric.no_backward_sync(model, enabled=not boundary)`` and the loss divided by the window length: under
    ZeRO-1/2 Lightning ignores the call and lands ~1e-2 off; lightspeed makes every stage equal what the loop
    writes (each micro-batch weighs 1/4, so the short last window counts 2/4, as with plain DDP)."""
    run = _meta(cases, f"accum_{name}")["no_backward_sync"]
    data = fabric_cases.accum_data()
    expected, _ = _windowed_reference(
        data, fabric_cases.linear(3, False), fabric_cases.ACCUM_LR, "mean", short_weight="per_window"
    )
    _assert_weights(run["weights"], expected, f"{name} no_backward_sync")


@pytest.mark.parametrize("name", CONFIG_OPTIMIZER_NAMES)
def test_the_config_optimizer_and_scheduler_train_like_torch_by_hand(cases: Path, name: str) -> None:
    """``fabric.setup(model, lightspeed.fabric.config_optimizer())``: DeepSpeed's SGD and WarmupDecayLR from the
    config, the scheduler stepped with every ``optimizer.step()``, equal plain torch SGD with the same scheduler."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    meta, weights = _meta(cases, f"config_opt_{name}"), torch.load(cases / f"config_opt_{name}.pt")
    data = make_regression_data()
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), **fabric_cases.CONFIG_OPTIMIZER["params"])
    scheduler = WarmupDecayLR(optimizer, total_num_steps=6, warmup_min_lr=0.0, warmup_max_lr=0.05, warmup_num_steps=2)
    per_rank = _rank_micro_batches(64, batch=4)
    for step in range(6):
        index = [i for rank in per_rank for i in rank[step]]
        optimizer.zero_grad()
        nn.functional.mse_loss(net(data.tensors[0][index]), data.tensors[1][index]).backward()
        optimizer.step()
        scheduler.step()
    assert meta["warmup_max_lr"] == 0.05 and meta["global_steps"] == 6
    assert meta["lr"] == [pytest.approx(optimizer.param_groups[0]["lr"])]
    for key, value in net.state_dict().items():
        diff = (weights[key] - value).abs().max().item()
        assert diff <= 1e-5, f"{name} {key}: differs from the single-process reference by {diff:.3e}"


@pytest.mark.parametrize("name", CONFIG_OPTIMIZER_NAMES)
def test_a_torch_scheduler_built_on_the_returned_optimizer_trains_like_torch_by_hand(cases: Path, name: str) -> None:
    """``StepLR(optimizer)`` on what ``fabric.setup`` returned (torch refused DeepSpeed's ZeRO optimizer: "... is not
    an Optimizer") sets the learning rate the ZeRO step uses: equal to torch SGD + StepLR by hand; its state goes into
    the checkpoint and comes back."""
    meta, weights = _meta(cases, f"torch_sched_{name}"), torch.load(cases / f"torch_sched_{name}.pt")
    data = make_regression_data()
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), **fabric_cases.TORCH_SCHEDULER_SGD)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, **fabric_cases.TORCH_SCHEDULER_STEPLR)
    per_rank = _rank_micro_batches(64, batch=4)
    lrs = []
    for step in range(6):
        index = [i for rank in per_rank for i in rank[step]]
        optimizer.zero_grad()
        nn.functional.mse_loss(net(data.tensors[0][index]), data.tensors[1][index]).backward()
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert meta["is_torch_optimizer"] and "DeepSpeedZeroOptimizer" in meta["repr"]
    assert meta["lrs"] == pytest.approx(lrs) and lrs[-1] < lrs[0]
    assert meta["restored_epoch"] == 3 and meta["restored_lr"] == [pytest.approx(lrs[2])]
    for key, value in net.state_dict().items():
        diff = (weights[key] - value).abs().max().item()
        assert diff <= 1e-5, f"{name} {key}: differs from the single-process reference by {diff:.3e}"


def test_zero_auto_tuning_measures_picks_the_fastest_and_trains_like_the_untuned_choice(cases: Path) -> None:
    """``ZeroAutoFabricStrategy(tune=True, tune_batches=..., tune_loss=..., tune_micro_batches=[1, 2])``: zero1 and
    zero2 at micro-batches of 4 (the loader's), 1 and 2 measured at ``fabric.setup``; the winner's option trains, bit
    for bit as the same option without tuning, and a winning micro-batch size is reported for the loop to use."""
    meta, weights = _meta(cases, "tune_zero_auto"), torch.load(cases / "tune_zero_auto.pt")
    (table,) = meta["logs"]
    rows = table.splitlines()[2:]
    speeds = {row.split()[0]: float(row.split()[1]) for row in rows}
    assert list(speeds) == [
        "zero1",
        "zero1+micro_batch_1",
        "zero1+micro_batch_2",
        "zero2",
        "zero2+micro_batch_1",
        "zero2+micro_batch_2",
    ]
    fastest = max(speeds, key=lambda n: speeds[n])
    winner = fastest if speeds[fastest] >= TUNE_MARGIN * speeds["zero1"] else "zero1"  # the planner's choice kept
    option, _, micro = winner.partition("+micro_batch_")
    assert meta["chosen"] == option
    if micro:
        assert meta["tuned_micro_batch"] == [int(micro), 4 // int(micro)]
        assert meta["micro_batch_report"] == [
            f"lightspeed zero_auto: micro-batches of {micro} with {4 // int(micro)} per optimizer step trained fastest "
            "(the same samples per step as 4 x 1). Fabric's loop owns its DataLoader: build it with "
            f"batch_size={micro} and accumulate {4 // int(micro)} micro-batches per step to use it "
            "(strategy.tuned_micro_batch, strategy.tuned_accumulation); this run keeps its own batches."
        ]
    else:
        assert meta["tuned_micro_batch"] == [None, None] and meta["micro_batch_report"] == []
    tuned = {k.removeprefix("tuned."): v for k, v in weights.items() if k.startswith("tuned.")}
    fixed = {k.removeprefix("fixed."): v for k, v in weights.items() if k.startswith("fixed.")}
    assert tuned.keys() == fixed.keys() and all(torch.equal(tuned[k], fixed[k]) for k in tuned)
    assert (tuned["0.weight"] - make_net().state_dict()["0.weight"]).abs().max() > 1e-3


def test_zero_auto_tuning_under_fabric_needs_the_batches_and_the_loss() -> None:
    with pytest.raises(TypeError) as caught:
        lightspeed.fabric.ZeroAutoFabricStrategy(tune=True)
    assert str(caught.value) == (
        "ZeroAutoFabricStrategy(tune=True) measures training steps, but Fabric's strategy does not see the loop: pass "
        "tune_batches= (this rank's training DataLoader) and tune_loss= (a function (model, batch) -> loss, as the "
        "loop computes it)."
    )


# --------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name", FULL_NAMES)
def test_load_full_weights_fills_the_sharded_model_and_its_master_copies(cases: Path, name: str) -> None:
    meta, weights = _meta(cases, f"full_{name}"), torch.load(cases / f"full_{name}.pt")
    source = make_net(seed=9)
    reference = make_net(seed=9)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    x, y = make_regression_data(8).tensors
    nn.functional.mse_loss(reference(x), y).backward()
    optimizer.step()
    for label in ("fabric", "plain", "export"):
        for key, value in source.state_dict().items():
            assert torch.equal(weights[f"{label}.loaded.{key}"], value), f"{name} {label}: {key} not loaded"
        for key, value in reference.state_dict().items():
            diff = (weights[f"{label}.stepped.{key}"] - value).abs().max().item()
            assert diff <= 1e-6, f"{name} {label}: {key} after one step differs by {diff:.3e}"  # masters refreshed
    assert meta["fabric"]["step"] == 5  # the rest of the state comes back too
    partial = str(cases / f"full_{name}" / "partial.ckpt")
    assert meta["partial_warnings"] == [
        f"lightspeed: `fabric.load(..., strict=False)` loaded {partial!r} into the model without 1 tensor(s) the file "
        "lacks (2.bias) and skipped 1 the model lacks (extra.weight)."
    ]
    assert meta["partial_strict"] == {
        "type": "CheckpointError",
        "message": f"Checkpoint {partial!r} does not fit the model; 2 tensor(s):\n  2.bias: missing from checkpoint "
        f"{partial!r}\n  extra.weight: not in the model\nLoad the weights of this model, or pass strict=False to load "
        "the matching tensors only.",
    }
    # a requested entry the weights file lacks: Fabric's own error under strict loading, none with strict=False
    assert meta["missing_key_strict"]["type"] == "KeyError"
    assert "The requested state contains a key 'step' that does not exist" in meta["missing_key_strict"]["message"]
    assert meta["missing_key_lenient"] == {"type": None, "message": None}


@pytest.mark.parametrize("name", RESUME_NAMES)
def test_save_load_resumes_exactly_and_exports(cases: Path, tmp_path: Path, name: str) -> None:
    meta = _meta(cases, f"resume_{name}")
    weights = torch.load(cases / f"resume_{name}.pt")
    assert meta["second"]["loaded_step"] == 2
    straight = {k.removeprefix("straight."): v for k, v in weights.items() if k.startswith("straight.")}
    resumed = {k.removeprefix("resumed."): v for k, v in weights.items() if k.startswith("resumed.")}
    saved = {k.removeprefix("saved."): v for k, v in weights.items() if k.startswith("saved.")}
    assert sorted(straight) == sorted(resumed) == sorted(saved) == sorted(make_net().state_dict())
    for key in straight:
        diff = (straight[key] - resumed[key]).abs().max().item()
        assert torch.equal(straight[key], resumed[key]), (
            f"{name}: resumed {key} differs from the uninterrupted run by {diff:.3e}"
        )
        assert not torch.equal(saved[key], straight[key])  # the steps after the save changed the weights

    ckpt = Path(meta["ckpt"])
    assert atomic_dir.is_complete(ckpt)  # committed through staging, with lightspeed's marker
    # Fabric's optimizer.step() bypasses engine.step(); the engine's step counter still counts every step, is saved
    # and restored: 2 steps before the save (the marker says so), 4 at the end of both runs
    assert json.loads((ckpt / atomic_dir.COMPLETE_MARKER).read_text())["global_step"] == 2
    assert meta["first"]["engine_steps"] == meta["second"]["engine_steps"] == 4
    assert json.loads((ckpt / "ds_config.json").read_text())["zero_optimization"]["stage"] == ZERO_PRESETS[name].stage
    assert not atomic_dir.staging_path(ckpt).exists()

    export_checkpoint(ckpt, tmp_path / "export", max_shard_size=None)
    exported = {}
    for file in sorted((tmp_path / "export").glob("*.safetensors")):
        exported.update(load_file(file))
    assert sorted(exported) == sorted(saved)
    for key, value in saved.items():
        assert (exported[key] - value).abs().max().item() <= 1e-6


def test_cli_export_reads_what_fabric_save_wrote(cases: Path, tmp_path: Path) -> None:
    ckpt = Path(_meta(cases, "resume_zero2")["ckpt"])
    out = tmp_path / "cli_export"
    proc = subprocess.run(
        [sys.executable, "-m", "lightspeed.cli.main", "export", str(ckpt), str(out)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = {k.removeprefix("saved."): v for k, v in torch.load(cases / "resume_zero2.pt").items() if "saved." in k}
    exported = {}
    for file in out.glob("*.safetensors"):
        exported.update(load_file(file))
    assert sorted(exported) == sorted(saved)


def test_load_refuses_an_interrupted_save(tmp_path: Path) -> None:
    strategy = lightspeed.fabric.ZeroFabricStrategy(stage=2)
    target = tmp_path / "ckpt"
    atomic_dir.prepare_staging(target)  # a save that never committed
    with pytest.raises(IncompleteCheckpointError, match="not a directory"):
        strategy.load_checkpoint(target, state={"model": nn.Linear(1, 1)})


# --------------------------------------------------------------------------------------------- metrics
def test_gather_for_metrics_and_exact_metrics_drop_exactly_the_padding_on_3_ranks(tmp_path: Path) -> None:
    out = tmp_path / "metrics.json"
    run_torchrun(SCRIPTS / "fabric_metrics.py", 3, [out, "ddp_exact,zero3"], timeout=600)
    results = json.loads(out.read_text())
    data = make_regression_data(7)
    with torch.no_grad():
        expected_pred = make_net()(data.tensors[0])
    expected_mse = nn.functional.mse_loss(expected_pred, data.tensors[1]).item()
    for name, result in results.items():
        assert result["rows_per_rank"] == [3, 3, 3], name  # 9 rows evaluated: the sampler padded 2 duplicates
        assert result["ids"] == list(range(7)), name  # exactly the 7 real samples, once each
        assert torch.allclose(torch.tensor(result["pred"]), expected_pred, atol=1e-6), name
        assert result["mse"] == pytest.approx(expected_mse, abs=1e-6), name
        assert sorted(result["exact"]) == ["2", "auto", "batch", "epoch"], name
        for every, values in result["exact"].items():  # every gather window: the single-process value
            assert values["rows"] == 7, (name, every)
            assert values["mse"] == pytest.approx(expected_mse, abs=1e-6), (name, every)
        assert result["metric_untouched"] == 0, name  # exact_metrics updates copies, never the metric passed in


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_two_optimizers_and_clip_by_value_are_refused(cases: Path, name: str) -> None:
    errors = _meta(cases, f"errors_{name}")
    assert errors["two_optimizers"] == {
        "type": "DeepSpeedConfigError",
        "message": "ZeRO strategies train one optimizer per model, but `fabric.setup` got 2 optimizers. For one "
        "model, use one optimizer with several param groups (each group can have its own lr and weight_decay). For "
        "several models each with its own optimizer (a GAN's generator and discriminator), set each up with its own "
        "optimizer: `fabric.setup(generator, opt_g)`, `fabric.setup(discriminator, opt_d)`.",
    }
    assert errors["clip_by_value"] == {
        "type": "DeepSpeedConfigError",
        "message": "`fabric.clip_gradients(clip_val=1.0)` clips each gradient element by value, which DeepSpeed's "
        "ZeRO optimizers cannot do (they only clip the norm of the partitioned gradients). Use "
        "`fabric.clip_gradients(model, optimizer, max_norm=1.0)`.",
    }
    mismatch = errors["precision_mismatch"]
    assert mismatch["type"] == "DeepSpeedConfigError"
    assert 'bf16.enabled=true in the DeepSpeed config, but Fabric(precision="32-true")' in mismatch["message"]
    assert "Trainer" not in mismatch["message"]
    assert errors["float64_parameters"]["type"] == "DeepSpeedConfigError"
    assert errors["float64_parameters"]["message"].startswith(
        "The model has parameters ZeRO cannot train as one process does: '0.weight', '0.bias', '2.weight', '2.bias' "
        "are float64, but ZeRO trains float32 parameters"
    )


def test_keyword_the_fabric_strategy_does_not_take() -> None:
    with pytest.raises(TypeError) as info:
        lightspeed.fabric.ZeroFabricStrategy(stage=3, sync_with_dataloader=False, offload_params_device="nvme")
    message = str(info.value)
    assert message.startswith("ZeroFabricStrategy does not take `offload_params_device`, `sync_with_dataloader`.")
    assert "`offload_params_device`: use `offload_parameters='cpu'` or `offload_parameters='nvme'`" in message
    assert "`sync_with_dataloader`: it is how the Trainer's loop ends an epoch; in a Fabric loop use " in message
    with pytest.raises(TypeError, match="`stag`: not a keyword of ZeroFabricStrategy"):
        lightspeed.fabric.ZeroFabricStrategy(stag=3)
    with pytest.raises(TypeError, match=r"`models`: set each model up with its own `fabric.setup\(model, optimizer\)`"):
        lightspeed.fabric.ZeroFabricStrategy(models=["generator", "discriminator"])
    with pytest.raises(DeepSpeedConfigError, match="zero_auto chooses `stage` itself"):
        lightspeed.fabric.ZeroAutoFabricStrategy(stage=2)


def test_config_typo_and_cpu_fp16_fail_before_launch() -> None:
    with pytest.raises(DeepSpeedConfigError, match="stag"):
        lightspeed.fabric.ZeroFabricStrategy(config={"zero_optimization": {"stag": 2}})
    with pytest.raises(DeepSpeedConfigError, match="needs a CUDA GPU"):
        L.Fabric(strategy="zero2", accelerator="cpu", devices=2, precision="16-mixed")


def test_accumulate_argument_errors() -> None:
    fabric = L.Fabric(strategy="ddp_exact", accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match=r"accumulate\(steps=...\) is the number of micro-batches"):
        lightspeed.fabric.accumulate(fabric, nn.Linear(1, 1), [], steps=0)
    with pytest.raises(TypeError, match="needs the model returned by fabric.setup"):
        lightspeed.fabric.accumulate(fabric, nn.Linear(1, 1), [], steps=2)
    lightning_deepspeed = L.Fabric(strategy="deepspeed_stage_2", accelerator="cpu", devices=2)
    with pytest.raises(TypeError, match="needs lightspeed's ZeRO strategies for DeepSpeed"):
        lightspeed.fabric.accumulate(lightning_deepspeed, nn.Linear(1, 1), [], steps=2)
