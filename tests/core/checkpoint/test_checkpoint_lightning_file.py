"""Exporting a single-file Lightning checkpoint (what the Trainer writes without DeepSpeed: one device, DDP, XLA).

One real ``L.Trainer(accelerator="cpu", devices=1).fit`` + ``trainer.save_checkpoint`` per module; the export must
equal the trained module's ``state_dict()`` bit for bit (after the requested dtype conversion), store the tied
head once, round-trip through ``load_exported``, and bad files must give one clear error with nothing written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from checkpoint_models import TinyLM  # noqa: E402
from lightning_file_fixture import TinyLightningLM, train_and_save  # noqa: E402

from lightspeed.core.checkpoint.lightning_file_reader import read_lightning_file  # noqa: E402
from lightspeed.core.checkpoint.plan import EXPORT_METADATA_KEY, TIED_METADATA_KEY  # noqa: E402
from lightspeed.errors import CheckpointError, ExportError  # noqa: E402
from lightspeed.export import export_checkpoint, load_exported  # noqa: E402

TIED, OWNER = "model.head.weight", "model.embed.weight"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    return train_and_save(tmp_path_factory.mktemp("lightning_file"))


def read_export(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every stored tensor of an export (all shards) and its ``__metadata__``."""
    from safetensors import safe_open

    tensors, metadata = {}, {}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            metadata = handle.metadata()
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors, metadata


def assert_untouched(out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if ".lightspeed-" in p.name] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_equals_the_trained_state_dict(trained, tmp_path, dtype):
    ckpt, reference = trained
    assert not torch.equal(reference[OWNER], TinyLM().embed.weight)  # the weights really are the trained ones
    out = tmp_path / "out"
    result = export_checkpoint(ckpt, out, dtype=dtype, max_shard_size="4KB")
    tensors, metadata = read_export(out)
    assert len(result.files) > 1 and (out / "model.safetensors.index.json").is_file()
    assert TIED not in tensors and json.loads(metadata[TIED_METADATA_KEY]) == {TIED: OWNER}
    assert result.tied == {TIED: OWNER} and result.skipped == ["note._extra_state"]
    assert sorted(tensors) == sorted(k for k in reference if k != TIED) and result.num_tensors == len(tensors)
    for key, tensor in tensors.items():
        expected = reference[key].to(dtype) if reference[key].is_floating_point() else reference[key]
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), key
    assert tensors["model.seen_batches"].dtype == torch.long and tensors["model.seen_batches"].item() == 4
    info = json.loads(metadata[EXPORT_METADATA_KEY])
    assert info["source"] == "lightning_checkpoint" and info["global_step"] == 4
    assert info["dtype"] == str(dtype).removeprefix("torch.")


def test_round_trip_through_load_exported(trained, tmp_path):
    ckpt, reference = trained
    export_checkpoint(ckpt, tmp_path / "out", max_shard_size="3KB")
    fresh = TinyLightningLM()
    assert load_exported(fresh, tmp_path / "out") == ([], [])
    state = fresh.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.items())
    assert fresh.model.head.weight is fresh.model.embed.weight


def test_strip_prefix_loads_into_the_bare_model(trained, tmp_path):
    ckpt, reference = trained
    result = export_checkpoint(ckpt, tmp_path / "out", strip_prefix="model.")
    assert result.tied == {"head.weight": "embed.weight"}
    bare = TinyLM()
    load_exported(bare, tmp_path / "out")
    assert all(torch.equal(v, reference[f"model.{k}"]) for k, v in bare.state_dict().items())


def test_weights_saved_in_bf16_are_upcast_exactly(trained, tmp_path):
    """bf16-true / XLA bf16 runs save bf16 weights; an fp32 export is their exact upcast, ties kept."""
    ckpt, reference = trained
    checkpoint = torch.load(ckpt, weights_only=False)
    module = TinyLightningLM()
    module.load_state_dict(checkpoint["state_dict"])
    checkpoint["state_dict"] = module.bfloat16().state_dict()
    torch.save(checkpoint, tmp_path / "bf16.ckpt")
    result = export_checkpoint(tmp_path / "bf16.ckpt", tmp_path / "out", dtype="fp32")
    tensors, _ = read_export(tmp_path / "out")
    assert result.tied == {TIED: OWNER}
    for key, tensor in tensors.items():
        expected = reference[key].bfloat16().float() if reference[key].is_floating_point() else reference[key]
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), key


def test_reading_loads_no_tensor_data(trained):
    """The reader returns byte ranges of the file: one per stored tensor, inside the file, none loaded."""
    ckpt, reference = trained
    info = read_lightning_file(ckpt)
    size = ckpt.stat().st_size
    assert [t.name for t in info.tensors] == [k for k in reference if k != TIED]
    for source in info.tensors:
        (piece,) = source.pieces
        assert piece.path == ckpt and 0 < piece.offset and piece.offset + source.numel * piece.itemsize <= size
        assert source.shape == tuple(reference[source.name].shape) and source.dtype == reference[source.name].dtype


def test_export_reads_each_stored_tensor_once_and_nothing_else(trained, tmp_path, monkeypatch):
    """Only the state_dict's bytes are read (not the Adam moments next to them), one tensor per read."""
    from lightspeed.core.checkpoint.torch_zip import RegionReader

    ckpt, reference = trained
    reads = []
    original = RegionReader.read_into

    def recording(self, region, out):
        reads.append((region.offset, region.numel * region.itemsize))
        return original(self, region, out)

    monkeypatch.setattr(RegionReader, "read_into", recording)
    export_checkpoint(ckpt, tmp_path / "out")
    stored = {(t.pieces[0].offset, t.numel * t.pieces[0].itemsize) for t in read_lightning_file(ckpt).tensors}
    assert sorted(reads) == sorted(stored) and len(reads) == len(reference) - 1  # the tied head is not read
    assert sum(n for _, n in reads) == sum(v.numel() * v.element_size() for k, v in reference.items() if k != TIED)


def test_options_a_single_file_cannot_honour(trained, tmp_path):
    ckpt, _ = trained
    with pytest.raises(
        ExportError,
        match=r"model.ckpt: a single-file Lightning checkpoint does not record which "
        r"parameters were frozen .* so exclude_frozen_parameters cannot be honoured",
    ):
        export_checkpoint(ckpt, tmp_path / "out", exclude_frozen_parameters=True)
    with pytest.raises(
        CheckpointError,
        match=r"model.ckpt is a single-file checkpoint, which has no tags; leave out "
        r"tag=\.\.\. \(--tag on the command line\)",
    ):
        export_checkpoint(ckpt, tmp_path / "out", tag="checkpoint")
    with pytest.raises(ExportError, match=r"no key starts with the prefix 'encoder.' to strip"):
        export_checkpoint(ckpt, tmp_path / "out", strip_prefix="encoder.")
    assert_untouched(tmp_path / "out")


def _bad_files(ckpt: Path, folder: Path) -> dict[str, tuple[Path, str]]:
    """Broken or foreign files and the message each must give."""
    weights = {"w": torch.ones(3)}
    cases = {
        "no_state_dict": (
            {"weights": weights, "epoch": 1},
            r"other.ckpt is not a Lightning checkpoint: it has no 'state_dict' entry \(top-level keys: "
            r"'weights', 'epoch'\); save it with trainer.save_checkpoint",
        ),
        "bare_state_dict": (
            weights,
            r"is not a Lightning checkpoint: it has no 'state_dict' entry and looks like a "
            r"bare state dict; wrap it first",
        ),
        "not_a_dict": ([torch.ones(2)], r"is not a Lightning checkpoint: it holds a list, not a dict"),
        "deepspeed_rank_file": (
            {"module": weights, "ds_version": "0.19"},
            r"is one rank file of a DeepSpeed checkpoint .* pass the checkpoint directory",
        ),
        "empty": ({"state_dict": {}}, r"the checkpoint's 'state_dict' holds no entries; there is nothing to export"),
    }
    made = {}
    for case, (obj, message) in cases.items():
        path = folder / case / "other.ckpt"
        path.parent.mkdir()
        torch.save(obj, path)
        made[case] = (path, message)
    truncated = folder / "truncated.ckpt"
    truncated.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size * 2 // 3])
    made["truncated"] = (truncated, r"truncated.ckpt is truncated or not a torch.save file")
    text = folder / "notes.ckpt"
    text.write_text("not a checkpoint\n")
    made["text"] = (text, r"notes.ckpt is truncated or not a torch.save file")
    corrupt = folder / "corrupt.ckpt"  # the bytes of one tensor cut out of the middle: every later record moves
    last = max(read_lightning_file(ckpt).tensors, key=lambda t: t.pieces[0].offset).pieces[0]
    data = ckpt.read_bytes()
    corrupt.write_bytes(data[: last.offset] + data[last.offset + last.numel * last.itemsize :])
    made["corrupt"] = (corrupt, r"corrupt.ckpt is truncated or corrupt \(Bad magic number")
    return made


BAD = ["no_state_dict", "bare_state_dict", "not_a_dict", "deepspeed_rank_file", "empty", "truncated", "text", "corrupt"]


@pytest.fixture(scope="module")
def bad_files(trained, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    return _bad_files(trained[0], tmp_path_factory.mktemp("bad"))


@pytest.mark.parametrize("case", BAD)
def test_bad_files_give_one_clear_error(bad_files, tmp_path, case):
    path, message = bad_files[case]
    with pytest.raises(CheckpointError, match=message):
        export_checkpoint(path, tmp_path / "out")
    assert_untouched(tmp_path / "out")
