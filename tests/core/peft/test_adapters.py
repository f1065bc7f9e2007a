"""PEFT models found inside a module, their target modules checked, their export layout asked of peft, and the
frozen-parameter fingerprint a checkpoint without the frozen base is checked with (one process)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs the peft extra (pip install 'lightspeed[peft]')")

from peft import LoraConfig, get_peft_model  # noqa: E402
from torch import nn  # noqa: E402

from lightspeed.core.errors import AdapterTargetError, CheckpointError  # noqa: E402
from lightspeed.core.peft.detect import adapter_models, check_adapter_targets, resolve_frozen_exclusion  # noqa: E402
from lightspeed.core.peft.layout import adapter_layouts  # noqa: E402
from lightspeed.core.zero.frozen_fingerprint import check_frozen_fingerprint, frozen_fingerprint  # noqa: E402


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(4, 4)
        self.v_proj = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)


class Holder(nn.Module):
    def __init__(self, targets: list[str] | str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = get_peft_model(Block(), LoraConfig(r=2, target_modules=targets))
        self.head = nn.Linear(2, 2)


def test_the_peft_model_is_found_where_it_sits_and_decides_the_frozen_exclusion() -> None:
    holder = Holder(["q_proj"])
    assert list(adapter_models(holder)) == ["model"]
    assert resolve_frozen_exclusion("auto", holder) is True
    assert resolve_frozen_exclusion("auto", nn.Linear(2, 2)) is False
    assert resolve_frozen_exclusion(False, holder) is False
    with pytest.raises(ValueError, match="exclude_frozen_parameters must be True, False or 'auto', got 'yes'"):
        resolve_frozen_exclusion("yes", holder)


def test_a_target_name_that_matches_no_module_is_an_error() -> None:
    check_adapter_targets(Holder(["q_proj", "v_proj"]))
    check_adapter_targets(Holder(r".*q_proj"))  # a regular expression: peft's own rules
    with pytest.raises(AdapterTargetError) as error:
        check_adapter_targets(Holder(["q_proj", "k_proj"]))
    assert str(error.value) == (
        "The PEFT model at 'model' has adapter 'default' with target_modules ['k_proj', 'q_proj'], but ['k_proj'] "
        "match no module of the model; peft would train the others only. Fix the names (modules are matched by their "
        "name or its last parts, e.g. 'q_proj')."
    )


def test_the_layout_is_the_one_peft_saves(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    holder = Holder(["q_proj", "v_proj"])
    (layout,) = adapter_layouts(holder)
    holder.model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert sorted(layout.names) == sorted(saved)
    state = holder.state_dict()
    assert all(torch.equal(state[key], saved[name]) for name, key in layout.names.items())
    assert _unordered_targets(layout.config_json) == _unordered_targets((tmp_path / "adapter_config.json").read_text())


def _unordered_targets(config_json: str) -> dict:
    """An adapter config with ``target_modules`` (a set in peft, written as a list in its iteration order) sorted."""
    config = json.loads(config_json)
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    return config


def test_the_fingerprint_catches_a_changed_frozen_weight() -> None:
    holder = Holder(["q_proj"])
    saved = frozen_fingerprint(holder)
    assert "model.base_model.model.out.weight" in saved and not any("lora_" in name for name in saved)
    check_frozen_fingerprint(Holder(["q_proj"]), saved, "ck")  # built the same way: passes
    changed = Holder(["q_proj"])
    with torch.no_grad():
        changed.model.base_model.model.out.weight[0, 0] += 1e-3
    with pytest.raises(CheckpointError, match=r"1 of this model's frozen parameters differ .*\(model\.base_model"):
        check_frozen_fingerprint(changed, saved, "ck")
