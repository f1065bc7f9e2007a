"""ZeRO-3 leaf modules without processes: which blocks ``leaf_modules="auto"`` finds, what explicit entries name, the
errors for entries that name nothing (or a container, which is never called), and that the flag is set before
``deepspeed.initialize`` under ZeRO-3 only. The runs of 2 ranks are in tests/strategies/test_zero_moe.py and
tests/fabric/test_fabric_moe.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from _support import moe
from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.engine import initialize_engine
from lightspeed.core.zero.leaf_modules import LeafModules, find_leaf_modules, moe_blocks
from lightspeed.fabric import ZeroAutoFabricStrategy, ZeroFabricStrategy
from lightspeed.strategies import ZeroAutoStrategy, ZeroStrategy

ZERO3: dict[str, Any] = {"zero_optimization": {"stage": 3}}


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Linear(4, 4)
        self.mlp = moe.SparseMoeBlock()
        self.shared_mlp = nn.Linear(4, 4)


class Stack(nn.Module):
    """Two layers, each with an MoE block named ``mlp``: found by ``layers.N.mlp``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))


class DictExperts(nn.Module):
    """Switch Transformers' shape: experts in an ``nn.ModuleDict``."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.experts = nn.ModuleDict({"expert_0": nn.Linear(4, 4), "expert_1": nn.Linear(4, 4)})


class FusedExperts(nn.Module):
    """Experts fused into one parameter (newer HuggingFace models): every call uses all of it, nothing to mark."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Linear(4, 8)


def leaves(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if getattr(module, "_z3_leaf", False)]


# ------------------------------------------------------------------------------------------------------ detection
def test_auto_finds_blocks_with_an_experts_module_list_or_dict_and_nothing_else() -> None:
    assert list(moe_blocks(Stack())) == ["layers.0.mlp", "layers.1.mlp"]
    assert list(moe_blocks(moe.make_moe_net())) == ["moe"]
    assert list(moe_blocks(DictExperts())) == [""]  # the model itself is the block
    assert moe_blocks(FusedExperts()) == {}
    assert moe_blocks(nn.Sequential(nn.Linear(2, 2))) == {}


def test_auto_marks_the_blocks_under_zero3_and_logs_their_classes_once(caplog: pytest.LogCaptureFixture) -> None:
    model = Stack()
    with caplog.at_level(logging.INFO, logger="lightspeed"):
        found = LeafModules.of("auto").mark(model, ZERO3)
    assert list(found) == leaves(model) == ["layers.0.mlp", "layers.1.mlp"]
    assert [record.getMessage() for record in caplog.records] == [
        "ZeRO-3 leaf modules (mixture-of-experts blocks found: each gathered whole when called, so ranks whose tokens "
        "reach different experts stay in step): SparseMoeBlock x2"
    ]


@pytest.mark.parametrize("config", [{"zero_optimization": {"stage": 2}}, {}], ids=["zero2", "no-zero"])
def test_nothing_is_marked_below_stage_3(config: dict[str, Any]) -> None:
    model = Stack()
    assert LeafModules.of("auto").mark(model, config) == {}
    assert LeafModules.of(["NoSuchBlock"]).mark(model, config) == {}  # not even checked: nothing would use it
    assert leaves(model) == []


def test_none_or_an_empty_collection_marks_nothing() -> None:
    for value in (None, [], set()):
        model = Stack()
        assert LeafModules.of(value).mark(model, ZERO3) == {}
        assert leaves(model) == []


# ------------------------------------------------------------------------------------------------ explicit entries
@pytest.mark.parametrize(
    "entry",
    [
        moe.SparseMoeBlock,
        "SparseMoeBlock",
        "_support.moe.SparseMoeBlock",
        "mlp",  # the end of `layers.N.mlp`, not of `layers.N.shared_mlp`
        "0.mlp",
    ],
    ids=["class", "class-name", "dotted-path", "name-suffix", "longer-suffix"],
)
def test_an_entry_names_modules_by_class_class_name_or_the_end_of_their_name(entry: Any) -> None:
    model = Stack()
    found = LeafModules.of(entry).mark(model, ZERO3)
    expected = ["layers.0.mlp"] if entry == "0.mlp" else ["layers.0.mlp", "layers.1.mlp"]
    assert list(found) == leaves(model) == expected


def test_explicit_entries_replace_detection_and_keep_only_the_outermost_modules() -> None:
    model = Stack()
    found = LeafModules.of({Layer, "attention"}).mark(model, ZERO3)
    assert list(found) == ["layers.0", "layers.1"]  # the attention and MoE blocks inside are part of each layer
    assert leaves(model) == ["layers.0", "layers.1"]


def test_an_entry_that_names_no_module_is_an_error_naming_it() -> None:
    with pytest.raises(DeepSpeedConfigError) as err:
        LeafModules.of(["mlp", "MixtralSparseMoeBlock"]).mark(Stack(), ZERO3)
    assert str(err.value) == (
        "leaf_modules entry 'MixtralSparseMoeBlock' names no module of Stack: give a module class of the model, a "
        "class name or the end of a module's name as `model.named_modules()` lists it (e.g. leaf_modules={MoeBlock}, "
        "leaf_modules=['Qwen3MoeSparseMoeBlock'] or leaf_modules=['mlp']). The model's module classes: Layer, Linear, "
        "ModuleList, Sequential, SparseMoeBlock, Stack, Tanh."
    )


def test_an_entry_found_in_an_earlier_model_of_the_run_may_be_missing_from_a_later_one() -> None:
    """One setting for every engine of a run: a GAN's discriminator lacks the generator's MoE blocks."""
    leaf_modules = LeafModules.of([moe.SparseMoeBlock])
    leaf_modules.mark(Stack(), ZERO3)
    assert leaf_modules.mark(nn.Sequential(nn.Linear(2, 2)), ZERO3) == {}
    with pytest.raises(DeepSpeedConfigError, match="entry SparseMoeBlock names no module of Sequential"):
        LeafModules.of([moe.SparseMoeBlock]).mark(nn.Sequential(nn.Linear(2, 2)), ZERO3)


def test_an_entry_naming_the_experts_container_is_refused_with_the_module_to_name_instead() -> None:
    with pytest.raises(DeepSpeedConfigError) as err:
        find_leaf_modules(Stack(), ["experts"])
    assert str(err.value) == (
        "leaf_modules names ModuleList `layers.0.mlp.experts`, a container that is never called itself, so ZeRO-3 "
        "would wait for its backward forever. Name the module that calls its entries: its parent `layers.0.mlp` "
        "(SparseMoeBlock), e.g. leaf_modules={SparseMoeBlock}."
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (3, "leaf_modules must be 'auto', None or a collection of module classes, class names or module-name"),
        ({"mlp": True}, "got {'mlp': True} (dict); e.g. leaf_modules={MoeBlock}"),
        ([nn.Linear(2, 2)], "Linear(in_features=2, out_features=2, bias=True) (a Linear instance): pass its class"),
        ([int], "int is not a torch.nn.Module subclass"),
        ([1.5], "leaf_modules holds entries that name no module: 1.5 (of type float). Pass module classes"),
        ([nn.Module], "torch.nn.Module matches every module, so the whole model would be one leaf"),
        (["mlp", " "], "leaf_modules holds entries that name no module: an empty string. Pass module classes"),
    ],
    ids=["number", "dict", "instance", "not-a-module", "float", "module-itself", "empty-string"],
)
def test_a_bad_argument_fails_when_the_strategy_is_created(value: Any, message: str) -> None:
    for strategy in (ZeroStrategy, ZeroFabricStrategy, ZeroAutoStrategy, ZeroAutoFabricStrategy):
        with pytest.raises(DeepSpeedConfigError) as err:
            strategy(leaf_modules=value)
        assert message in str(err.value), (strategy.__name__, str(err.value))


def test_the_strategies_keep_the_checked_argument() -> None:
    for strategy in (ZeroStrategy, ZeroFabricStrategy, ZeroAutoStrategy, ZeroAutoFabricStrategy):
        assert strategy()._session.leaf_modules.detects
        assert strategy(leaf_modules=None)._session.leaf_modules.entries == ()
        chosen = strategy(leaf_modules={moe.SparseMoeBlock, "mlp"})._session.leaf_modules
        assert chosen.entries == ("mlp", moe.SparseMoeBlock)  # a set, in a fixed order


# ------------------------------------------------------------------------------------------------ engine building
def test_the_blocks_are_marked_before_deepspeed_initialize_builds_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed

    seen: dict[str, Any] = {}

    def initialize(*, model: nn.Module, config: dict[str, Any], **_: Any) -> tuple[Any, Any, Any, Any]:
        seen["leaves"] = leaves(model)
        return object(), None, None, None

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    net = moe.make_moe_net()
    initialize_engine(ZERO3, net, torch.optim.SGD(net.parameters(), lr=1.0), None, None, 0)
    assert seen["leaves"] == ["moe"]
    net = moe.make_moe_net()
    initialize_engine(ZERO3, net, None, None, None, 0, LeafModules.of(None))
    assert seen["leaves"] == []
