"""Bad input gets one clear error naming the file, tag or key, and the output directory is left untouched.

Broken checkpoints are made from the real ones generated for the export tests (copy, then delete / truncate / mix
files), so every error comes from reading what DeepSpeed actually writes.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from checkpoint_fixture import checkpoint_of, zero_checkpoints  # noqa: E402
from checkpoint_models import TinyLM  # noqa: E402

from lightspeed.errors import CheckpointError, ExportError  # noqa: E402
from lightspeed.export import export_checkpoint, load_exported  # noqa: E402


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return zero_checkpoints(tmp_path_factory)


def copy_of(root: Path, config: str, tmp_path: Path) -> tuple[Path, str]:
    ckpt, tag, _ = checkpoint_of(root, config)
    target = tmp_path / "ckpt"
    shutil.copytree(ckpt, target, ignore=shutil.ignore_patterns("reference.pt", "info.json"))
    return target, tag


def assert_untouched(out: Path, before: list[str] | None) -> None:
    if before is None:
        assert not out.exists()
    else:
        assert sorted(p.name for p in out.iterdir()) == before
    leftovers = [p.name for p in out.parent.iterdir() if ".lightspeed-" in p.name]
    assert leftovers == []


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty is not a DeepSpeed checkpoint: it has neither a 'latest' file"):
        export_checkpoint(tmp_path / "empty", tmp_path / "out")
    single = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, single)
    with pytest.raises(
        CheckpointError, match=r"model.ckpt: the checkpoint's 'state_dict' holds no entries; there is nothing to export"
    ):
        export_checkpoint(single, tmp_path / "out")
    with pytest.raises(CheckpointError, match=r"nowhere: no such checkpoint"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "out")
    assert_untouched(tmp_path / "out", None)


def test_a_folder_holding_a_checkpoint_names_it(root, tmp_path):
    """A Ray Train checkpoint keeps the strategy's checkpoint in a folder of its own (``checkpoint.ckpt``)."""
    ckpt, _ = copy_of(root, "s2_cpu_fp32", tmp_path)
    ray_checkpoint = tmp_path / "checkpoint_000001"
    ray_checkpoint.mkdir()
    ckpt.rename(ray_checkpoint / "checkpoint.ckpt")
    with pytest.raises(CheckpointError) as error:
        export_checkpoint(ray_checkpoint, tmp_path / "out")
    assert str(error.value) == (
        f"{ray_checkpoint} is not a DeepSpeed checkpoint: it has neither a 'latest' file nor a tag directory holding "
        "'*_model_states.pt' files; it holds the checkpoint(s) 'checkpoint.ckpt' (a Ray Train checkpoint keeps the "
        f"strategy's checkpoint in such a folder): pass '{ray_checkpoint / 'checkpoint.ckpt'}'"
    )
    assert_untouched(tmp_path / "out", None)


def test_missing_rank_file(root, tmp_path):
    ckpt, tag = copy_of(root, "s2_cpu_fp32", tmp_path)
    (ckpt / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"is missing the optimizer file of rank\(s\) \[1\] "
        r"\(zero_pp_rank_1_mp_rank_00_optim_states.pt\)",
    ):
        export_checkpoint(ckpt, tmp_path / "out")
    assert_untouched(tmp_path / "out", None)


def test_missing_stage3_model_states(root, tmp_path):
    ckpt, tag = copy_of(root, "s3_cpu_fp32", tmp_path)
    (ckpt / tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"missing the model states of rank\(s\) \[1\] "
        r"\(zero_pp_rank_1_mp_rank_00_model_states.pt\)",
    ):
        export_checkpoint(ckpt, tmp_path / "out")


def test_files_from_different_saves(root, tmp_path):
    ckpt, _ = copy_of(root, "mix_s2_none_fp32", tmp_path)
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(ckpt / "step3" / name, ckpt / "step2" / name)
    with pytest.raises(
        CheckpointError,
        match=rf"step2/{name} is at optimizer step \[3.0\], .* at step \[2.0\]: "
        r"files from different saves are mixed",
    ):
        export_checkpoint(ckpt, tmp_path / "out", tag="step2")


def test_files_from_different_runs(root, tmp_path):
    ckpt, tag = copy_of(root, "s3_cpu_fp32", tmp_path)
    other, other_tag, _ = checkpoint_of(root, "s3_nvme_fp32_big")
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(other / other_tag / name, ckpt / tag / name)
    with pytest.raises(
        CheckpointError,
        match=rf"{name} has \d+ sub-groups, the model states \d+: files from "
        r"different runs are mixed",
    ):
        export_checkpoint(ckpt, tmp_path / "out")


def test_extra_rank_from_a_bigger_run(root, tmp_path):
    ckpt, tag = copy_of(root, "s2_cpu_fp32", tmp_path)
    shutil.copy(
        ckpt / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ckpt / tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt",
    )
    with pytest.raises(
        CheckpointError,
        match=r"zero_pp_rank_2_mp_rank_00_optim_states.pt belongs to a run with more "
        r"ranks: the other files .* were saved by 2 ranks",
    ):
        export_checkpoint(ckpt, tmp_path / "out")


def test_truncated_rank_file(root, tmp_path):
    ckpt, tag = copy_of(root, "s3_cpu_fp32", tmp_path)
    victim = ckpt / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(
        CheckpointError,
        match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt is truncated or not a "
        r"torch.save file",
    ):
        export_checkpoint(ckpt, tmp_path / "out")
    assert_untouched(tmp_path / "out", None)


def test_truncated_or_missing_nvme_swap_file(root, tmp_path):
    ckpt, tag = copy_of(root, "s3_nvme_fp32_big", tmp_path)
    swaps = sorted((ckpt / tag / "offloaded_tensors" / "rank01").glob("[0-9]*_[0-9]*.tensor.swp"))
    assert len(swaps) == 1
    data = swaps[0].read_bytes()
    swaps[0].write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match=rf"{swaps[0].name} is truncated: it has \d+ bytes, the sub-group needs"):
        export_checkpoint(ckpt, tmp_path / "out")
    shutil.rmtree(ckpt / tag / "offloaded_tensors")
    with pytest.raises(
        CheckpointError,
        match=r"NVMe optimizer offload, but .*offloaded_tensors/rank00 with "
        r"DeepSpeed's swap files is missing",
    ):
        export_checkpoint(ckpt, tmp_path / "out")


def test_unknown_tag_and_stale_latest(root, tmp_path):
    ckpt, tag = copy_of(root, "mix_s2_none_fp32", tmp_path)
    with pytest.raises(CheckpointError, match=r"unknown tag 'global_step9' in .*ckpt; available tags: step2, step3"):
        export_checkpoint(ckpt, tmp_path / "out", tag="global_step9")
    (ckpt / "latest").write_text("global_step9")
    with pytest.raises(
        CheckpointError,
        match=r"latest names the tag 'global_step9', but .* holds no "
        r"'\*_model_states.pt' file; available tags: step2, step3",
    ):
        export_checkpoint(ckpt, tmp_path / "out")


def test_output_directory_in_the_way(root, tmp_path):
    ckpt, _, _ = checkpoint_of(root, "s2_none_fp32")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match=r"output directory .*out exists and is not empty; pass overwrite=True"):
        export_checkpoint(ckpt, out)
    assert_untouched(out, ["notes.txt"])
    export_checkpoint(ckpt, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match=r"output path .*file exists and is not a directory"):
        export_checkpoint(ckpt, tmp_path / "file")


def test_interrupted_export_leaves_nothing(root, tmp_path):
    ckpt, _, _ = checkpoint_of(root, "s3_cpu_fp32")
    out = tmp_path / "out"
    out.mkdir()  # an existing empty directory stays as it was

    def interrupt(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(ckpt, out, max_shard_size="2KB", progress=interrupt)
    assert_untouched(out, [])


def test_bad_options(root, tmp_path):
    ckpt, _, _ = checkpoint_of(root, "s2_none_fp32")
    with pytest.raises(ExportError, match=r"unsupported export dtype 'int8'; choose fp32, bf16 or fp16"):
        export_checkpoint(ckpt, tmp_path / "out", dtype="int8")
    with pytest.raises(ExportError, match=r"Unknown unit 'gigs' in max shard size '2 gigs': use B, KB"):
        export_checkpoint(ckpt, tmp_path / "out", max_shard_size="2 gigs")
    with pytest.raises(
        ExportError,
        match=r"no key starts with the prefix 'model.' to strip; the keys begin like: "
        r"position_scale, seen_batches, embed.weight",
    ):
        export_checkpoint(ckpt, tmp_path / "out", strip_prefix="model.")
    ckpt0, _, _ = checkpoint_of(root, "s0_none_fp32")
    with pytest.raises(ExportError, match=r"a ZeRO stage 0 checkpoint does not record which parameters were frozen"):
        export_checkpoint(ckpt0, tmp_path / "out", exclude_frozen_parameters=True)
    assert_untouched(tmp_path / "out", None)


def test_load_exported_mismatch_lists_keys(root, tmp_path):
    ckpt, _, _ = checkpoint_of(root, "s2_none_fp32")
    export_checkpoint(ckpt, tmp_path / "out")
    bigger = TinyLM(big=True)
    before = {k: v.clone() for k, v in bigger.state_dict().items()}
    with pytest.raises(
        ExportError,
        match=r"does not match TinyLM: missing keys \(in the module, not in the export\): "
        r"\['big.weight', 'big.bias'\]",
    ):
        load_exported(bigger, tmp_path / "out")
    holder = torch.nn.Module()
    holder.net = TinyLM()
    with pytest.raises(
        ExportError,
        match=r"missing keys .*'net.position_scale'.*; unexpected keys \(in the export, "
        r"not in the module\): \['down.bias', 'down.weight', ",
    ):
        load_exported(holder, tmp_path / "out")
    narrow = TinyLM()
    narrow.up = torch.nn.Linear(24, 5)
    with pytest.raises(ExportError, match=r"shapes differ for up.weight: export \(37, 24\), module \(5, 24\)"):
        load_exported(narrow, tmp_path / "out", strict=False)
    assert all(torch.equal(v, before[k]) for k, v in bigger.state_dict().items())  # nothing was loaded
    with pytest.raises(ExportError, match=r"holds no model.safetensors or model.safetensors.index.json"):
        load_exported(bigger, tmp_path)


def _edit_model_states(ckpt: Path, tag: str, edit) -> None:
    paths = sorted((ckpt / tag).glob("*model_states.pt"))  # ZeRO-3: one per rank
    assert paths
    for path in paths:
        states = torch.load(path, weights_only=False)
        edit(states)
        torch.save(states, path)


@pytest.mark.parametrize("config", ["s1_none_fp32", "s2_cpu_fp32"])
def test_aliases_of_one_shared_tensor_that_disagree_in_shape(root, tmp_path, config):
    """The head is tied to the embedding; a checkpoint storing the head with another shape is one error naming both
    (every reader goes through the same check: export, fresh-evaluation loading, resharding)."""
    ckpt, tag = copy_of(root, config, tmp_path)
    shape = list(TinyLM().embed.weight.shape)

    def other_head_shape(states):
        assert states["shared_params"]["head.weight"] == "embed.weight"
        states["module"]["head.weight"] = torch.zeros(shape[0] + 1, shape[1])

    _edit_model_states(ckpt, tag, other_head_shape)
    with pytest.raises(CheckpointError) as caught:
        export_checkpoint(ckpt, tmp_path / "out")
    assert str(caught.value) == (
        f"{ckpt / tag}: 'head.weight' is tied to 'embed.weight', but the checkpoint stores 'head.weight' with shape "
        f"{[shape[0] + 1, shape[1]]} and 'embed.weight' with shape {shape}; a shared tensor has one shape. The "
        "checkpoint was edited or written by another model: export it from the run that wrote it."
    )
    assert_untouched(tmp_path / "out", None)


@pytest.mark.parametrize("config", ["s2_none_fp32", "s3_cpu_fp32"])
def test_a_shared_tensor_the_checkpoint_lacks_under_every_alias(root, tmp_path, config):
    ckpt, tag = copy_of(root, config, tmp_path)

    def tie_to_a_missing_name(states):
        states["shared_params"]["head.weight"] = "lost.weight"

    _edit_model_states(ckpt, tag, tie_to_a_missing_name)
    with pytest.raises(CheckpointError) as caught:
        export_checkpoint(ckpt, tmp_path / "out")
    assert str(caught.value) == (
        f"{ckpt / tag}: 'head.weight' is tied to 'lost.weight', but the checkpoint holds no data for either name"
    )
