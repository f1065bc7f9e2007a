"""The streaming safetensors writer and the lazy torch.save reader, on their own (single process, no DeepSpeed)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from lightspeed.core.checkpoint.plan import OutputTensor, select_keys
from lightspeed.core.checkpoint.safetensors_writer import parse_shard_size, plan_shards, write_shards
from lightspeed.core.checkpoint.torch_zip import FileRegion, OpaqueObject, RegionReader, load_lazy
from lightspeed.core.errors import ExportError


def sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "w32": torch.randn(7, 5, generator=generator),
        "w16": torch.randn(3, 11, generator=generator).half(),
        "wbf": torch.randn(13, generator=generator).bfloat16(),
        "ids": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def as_outputs(tensors: dict[str, torch.Tensor], produced: list[str] | None = None) -> list[OutputTensor]:
    def producer(name: str, value: torch.Tensor):
        def produce() -> torch.Tensor:
            if produced is not None:
                produced.append(name)
            return value

        return produce

    return [OutputTensor(n, tuple(v.shape), v.dtype, producer(n, v)) for n, v in tensors.items()]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2GB", 2 * 10**9),
        ("500MB", 500 * 10**6),
        ("1GiB", 2**30),
        ("4kb", 4000),
        ("1.5GB", 1_500_000_000),
        (1234, 1234),
        (None, None),
    ],
)
def test_parse_shard_size(text, expected):
    assert parse_shard_size(text) == expected


def test_parse_shard_size_errors():
    with pytest.raises(ExportError, match=r"Unknown unit 'apples' in max shard size '2 apples': use B, KB"):
        parse_shard_size("2 apples")
    with pytest.raises(ExportError, match=r"Cannot read max shard size 'lots': write a number with a unit"):
        parse_shard_size("lots")
    with pytest.raises(ExportError, match=r"max shard size must be positive, got 0"):
        parse_shard_size(0)
    with pytest.raises(ExportError, match=r"max shard size '16' has no unit: write e.g. '16GB' .* or '16GiB'"):
        parse_shard_size("16")


def test_single_file_is_valid_safetensors(tmp_path):
    tensors = sample_tensors()
    files = write_shards(tmp_path, as_outputs(tensors), None, {"format": "pt", "note": "x"})
    assert files == ["model.safetensors"]
    loaded = load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name


def test_shards_follow_hf_layout_and_size_limit(tmp_path):
    tensors = {f"layer{i}.weight": torch.full((10, 10), float(i)) for i in range(7)}  # 400 bytes each
    tensors["huge"] = torch.ones(50, 10)  # 2000 bytes: bigger than a shard, goes alone
    produced: list[str] = []
    files = write_shards(tmp_path, as_outputs(tensors, produced), 1000, {"format": "pt"})
    assert produced == list(tensors)  # each tensor produced exactly once, in order
    assert files == [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)] + ["model.safetensors.index.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 7 * 400 + 2000
    assert index["weight_map"]["huge"] == "model-00005-of-00005.safetensors"
    seen = {}
    for name in files[:-1]:
        shard = load_file(tmp_path / name)
        size = sum(t.numel() * t.element_size() for t in shard.values())
        assert size <= 1000 or list(shard) == ["huge"]
        seen.update({k: (name, v) for k, v in shard.items()})
    assert {k: n for k, (n, _) in seen.items()} == index["weight_map"]
    assert all(torch.equal(seen[k][1], v) for k, v in tensors.items())


def test_dtype_conversion_on_write(tmp_path):
    value = torch.randn(6, 3)
    spec = OutputTensor("w", (6, 3), torch.bfloat16, lambda: value)
    write_shards(tmp_path, [spec], None, {"format": "pt"})
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w"], value.bfloat16())


def test_shape_mismatch_is_refused(tmp_path):
    spec = OutputTensor("w", (2, 2), torch.float32, lambda: torch.zeros(4))
    with pytest.raises(ExportError, match=r"w: produced shape \(4,\), expected \(2, 2\)"):
        write_shards(tmp_path, [spec], None, {"format": "pt"})


def test_plan_shards_keeps_order():
    specs = as_outputs({f"t{i}": torch.zeros(i + 1) for i in range(6)})
    shards = plan_shards(specs, 12)
    assert [[s.name for s in shard] for shard in shards] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]


def test_select_keys_prefix_frozen_and_ties():
    keys = ["model.embed", "model.frozen", "model.head", "extra", "head_outside"]
    kinds = {"model.embed": "param", "model.frozen": "frozen", "extra": "buffer"}
    aliases = {"model.head": "model.embed", "head_outside": "model.embed"}
    stored, tied = select_keys(keys, kinds, aliases, exclude_frozen_parameters=True, strip_prefix="model.")
    assert stored == [("embed", "model.embed")] and tied == {"head": "embed"}
    # a tied key under the prefix whose owner is outside it is written itself
    stored, tied = select_keys(["a.w", "b.w"], {"a.w": "param"}, {"b.w": "a.w"}, strip_prefix="b.")
    assert stored == [("w", "a.w")] and tied == {}


class Explosive:
    """Unpickling this with pickle would run os.system; the lazy reader must not."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_lazy_reader_matches_torch_load_and_runs_no_code(tmp_path):
    base = torch.arange(40, dtype=torch.float32)
    flat = torch.randn(17)
    flat.ds_id = "3_9"  # DeepSpeed pickles attributes set on tensors
    obj = {
        "view": base[5:25],  # a view with a storage offset
        "whole": base,
        "bf16": torch.randn(4, 3).bfloat16(),
        "ints": torch.tensor([[1, 2], [3, 4]]),
        "flat": [flat],
        "param": torch.nn.Parameter(torch.ones(3)),
        "meta": {"stage": 3, "shape": torch.Size([2, 5]), "dtype": torch.float16},
        "danger": Explosive(str(tmp_path / "pwned")),
    }
    torch.save(obj, tmp_path / "file.pt")
    lazy = load_lazy(tmp_path / "file.pt")
    assert not (tmp_path / "pwned").exists()
    assert isinstance(lazy["danger"], OpaqueObject) and lazy["danger"].qualname.endswith(".system")
    assert lazy["meta"] == {"stage": 3, "shape": torch.Size([2, 5]), "dtype": torch.float16}
    assert lazy["flat"][0].attrs == {"ds_id": "3_9"}
    with RegionReader() as reader:
        for key in ("view", "whole", "bf16", "ints", "param"):
            region = lazy[key]
            assert isinstance(region, FileRegion)
            assert torch.equal(reader.read(region), obj[key].detach()), key
        assert torch.equal(reader.read(lazy["flat"][0].slice(4, 6)), flat[4:10])


def test_live_export_reports_non_tensor_entries(tmp_path):
    """export_engine lists state-dict entries it cannot write (extra state) in ``skipped``, as the file exporter
    does, and drops Lightning's old ``_forward_module.`` wrapper from every name (stage-0 engine, one process)."""
    from types import SimpleNamespace

    from lightspeed.core.checkpoint.live import export_engine
    from lightspeed.core.checkpoint.options import ExportOptions

    class Noted(torch.nn.Linear):
        def get_extra_state(self) -> dict:
            return {"note": "not a tensor"}

        def set_extra_state(self, state: dict) -> None:
            pass

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._forward_module = torch.nn.Sequential(Noted(3, 2))

    module = Wrapper()
    engine = SimpleNamespace(module=module, zero_optimization_stage=lambda: 0)
    result = export_engine(engine, tmp_path / "out", ExportOptions(max_shard_size=None))
    assert result.skipped == ["0._extra_state"]
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(exported) == ["0.bias", "0.weight"]
    assert torch.equal(exported["0.weight"], module._forward_module[0].weight.detach())
