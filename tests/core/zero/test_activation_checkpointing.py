"""Activation checkpointing in core: the ``activation_checkpointing`` section built from the strategy arguments, its
``"auto"`` rules, the errors (exact messages), and ``activation_checkpointing_policy`` applied to a model in one
process (the 2-rank runs are tests/strategies/test_zero_activation_policy.py and
tests/fabric/test_fabric_activation_policy.py)."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's parser and checkpoint need an accelerator; no GPU here

import pytest
import torch
from torch import nn

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.activation_checkpointing import (
    CheckpointedForward,
    apply_policy,
    checkpointed_modules,
)
from lightspeed.core.zero.auto_choice import check_zero_auto_arguments, zero_auto_config
from lightspeed.core.zero.config import TrainingFacts, ZeroTuning, build_zero_config, resolve_config_with_notes
from lightspeed.core.zero.config.activation import checked_policy
from lightspeed.core.zero.planner import ZERO_OPTIONS

AUTO_SECTION = {
    "partition_activations": "auto",
    "cpu_checkpointing": "auto",
    "contiguous_memory_optimization": "auto",
    "synchronize_checkpoint_boundary": False,
    "profile": False,
}


class Block(nn.Module):
    """A residual block that owns a parameter directly and counts its forward calls."""

    calls = 0

    def __init__(self, width: int = 6, inner: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.full((width,), 0.5))
        self.inner = Block(width) if inner else None

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor | None = None) -> dict[str, object]:
        type(self).calls += 1
        y = x + self.gain * torch.tanh(self.fc(x))
        if self.inner is not None:
            y = self.inner(y)["out"]
        return {"out": y if shift is None else y + shift, "extra": (y.sum(), None)}


class Net(nn.Module):
    def __init__(self, blocks: int = 3, inner: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(inner=inner) for _ in range(blocks))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, shift=torch.full((6,), 0.1))["out"]
        return self.head(x)


def facts(device: str | None = "cpu") -> TrainingFacts:
    return TrainingFacts(
        world_size=2,
        micro_batch_size=4,
        accumulate_grad_batches=1,
        gradient_clip_val=None,
        precision="32-true",
        hidden_size=8,
        device=device,
    )


def section(config: dict) -> dict | None:
    return config.get("activation_checkpointing")


# ----------------------------------------------------------------------------------------------- the section
def test_no_section_unless_something_asks_for_one() -> None:
    assert section(build_zero_config(2)) is None
    assert section(build_zero_config(3, "cpu", "cpu", tuning=ZeroTuning(cpu_checkpointing="auto"))) is None


def test_the_policy_asks_for_the_section_with_every_auto_rule() -> None:
    built = build_zero_config(2, tuning=ZeroTuning(activation_checkpointing_policy={Block}))
    assert section(built) == AUTO_SECTION


@pytest.mark.parametrize(
    ("argument", "value"),
    [("profile", True), ("cpu_checkpointing", False), ("partition_activations", True), ("number_checkpoints", 4)],
)
def test_any_argument_away_from_its_default_asks_for_the_section(argument: str, value: object) -> None:
    built = build_zero_config(2, tuning=ZeroTuning(**{argument: value}))
    assert section(built) == {**AUTO_SECTION, argument: value}


def test_the_users_config_wins_key_by_key() -> None:
    built = build_zero_config(
        3,
        "cpu",
        "cpu",
        tuning=ZeroTuning(activation_checkpointing_policy=[Block], cpu_checkpointing=True, profile=True),
        user_config={"activation_checkpointing": {"cpu_checkpointing": False, "number_checkpoints": 3}},
    )
    assert section(built) == {**AUTO_SECTION, "cpu_checkpointing": False, "profile": True, "number_checkpoints": 3}


def test_zero_auto_takes_the_arguments_for_whichever_option_it_chooses() -> None:
    kwargs = {"activation_checkpointing_policy": Block, "profile": True, "logging_level": 10}
    _, tuning = check_zero_auto_arguments(None, kwargs, 0.2)
    assert kwargs == {"logging_level": 10}  # the rest are the front end's own
    assert tuning.policy == frozenset({Block})
    option = next(option for option in ZERO_OPTIONS if option.stage == 3)
    assert section(zero_auto_config(option, {}, tuning, None)) == {**AUTO_SECTION, "profile": True}


# ------------------------------------------------------------------------------------------------- "auto" rules
@pytest.mark.parametrize(
    ("offload_parameters", "device", "cpu_checkpointing"),
    [
        ("none", "cuda", False),
        ("cpu", "cuda", True),
        ("nvme", "cuda", True),
        ("cpu", "cpu", False),  # host memory already
    ],
)
def test_auto_rules(offload_parameters: str, device: str, cpu_checkpointing: bool, tmp_path) -> None:
    built = build_zero_config(
        3,
        "none",
        offload_parameters,
        nvme_path=tmp_path if offload_parameters == "nvme" else None,
        tuning=ZeroTuning(activation_checkpointing_policy={Block}),
    )
    resolved, notes = resolve_config_with_notes(built, facts(device))
    assert section(resolved) == {
        "partition_activations": False,
        "cpu_checkpointing": cpu_checkpointing,
        "contiguous_memory_optimization": False,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }
    assert notes == []


def test_without_a_device_the_rule_asks_deepspeeds_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed.accelerator

    built = build_zero_config(3, "cpu", "cpu", tuning=ZeroTuning(activation_checkpointing_policy={Block}))

    class Cuda:
        def device_name(self, device_index: int | None = None) -> str:
            return "cuda"

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", Cuda)
    assert section(resolve_config_with_notes(built, facts(None))[0])["cpu_checkpointing"] is True


def test_settings_without_effect_here_get_a_note_and_cpu_checkpointing_is_turned_off_on_the_cpu() -> None:
    built = build_zero_config(2, tuning=ZeroTuning(cpu_checkpointing=True, partition_activations=True))
    resolved, notes = resolve_config_with_notes(built, facts("cpu"))
    assert section(resolved)["cpu_checkpointing"] is False and section(resolved)["partition_activations"] is True
    assert notes == [
        "activation_checkpointing.cpu_checkpointing has no effect on the CPU device (the checkpoints are in host "
        "memory already) and DeepSpeed's copy would empty the checkpointed inputs there: turned off.",
        "activation_checkpointing.partition_activations splits checkpoints across model-parallel ranks; lightspeed "
        "trains without model parallelism, so each rank keeps whole checkpoints (DeepSpeed only copies them).",
    ]


def test_a_section_from_the_users_config_alone_is_resolved_and_parsed_by_deepspeed() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    user = {"activation_checkpointing": {"cpu_checkpointing": "auto", "partition_activations": "auto"}}
    resolved, _ = resolve_config_with_notes(build_zero_config(3, "cpu", "cpu", user_config=user), facts("cuda"))
    assert section(resolved) == {"cpu_checkpointing": True, "partition_activations": False}
    parsed = DeepSpeedConfig(copy.deepcopy(resolved)).activation_checkpointing_config
    assert (parsed.cpu_checkpointing, parsed.partition_activations) == (True, False)


# ------------------------------------------------------------------------------------------------------ errors
def test_a_bad_argument_is_refused_naming_it() -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        ZeroTuning(cpu_checkpointing="yes")
    assert str(info.value) == "cpu_checkpointing must be True, False or \"auto\", got 'yes'."


def test_every_bad_argument_is_listed_at_once() -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        ZeroTuning(partition_activations=1, synchronize_checkpoint_boundary="no", number_checkpoints=0)
    assert str(info.value) == (
        "3 problems in the activation checkpointing arguments:\n"
        '  1. partition_activations must be True, False or "auto", got 1.\n'
        "  2. synchronize_checkpoint_boundary must be True or False, got 'no'.\n"
        "  3. number_checkpoints must be None or a whole number >= 1 (the checkpointed blocks in one forward pass), "
        "got 0."
    )


def test_contiguous_buffers_without_partitioning_or_a_count_are_refused() -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        build_zero_config(2, tuning=ZeroTuning(contiguous_memory_optimization=True))
    assert str(info.value) == (
        "2 problems in the DeepSpeed config:\n"
        '  1. contiguous_memory_optimization is on, but partition_activations is "auto" (off without model '
        "parallelism): DeepSpeed copies only partitioned checkpoints into its contiguous buffers. Set "
        "partition_activations=True too, or turn contiguous_memory_optimization off.\n"
        "  2. contiguous_memory_optimization is on, but number_checkpoints is not set: DeepSpeed preallocates one "
        "buffer per checkpointed block. Set number_checkpoints to the number of checkpointed blocks in one forward "
        "pass."
    )
    contiguous = {"contiguous_memory_optimization": True, "partition_activations": True, "number_checkpoints": 3}
    assert section(build_zero_config(2, user_config={"activation_checkpointing": contiguous})) == contiguous


def test_bad_values_in_the_users_section_are_refused() -> None:
    user = {"activation_checkpointing": {"partition_activations": "yes", "number_checkpoints": "auto", "profile": 1}}
    with pytest.raises(DeepSpeedConfigError) as info:
        build_zero_config(2, user_config=user)
    assert str(info.value) == (
        "3 problems in the DeepSpeed config:\n"
        "  1. activation_checkpointing.partition_activations must be true, false or \"auto\", got 'yes'.\n"
        "  2. activation_checkpointing.profile must be true or false, got 1.\n"
        "  3. activation_checkpointing.number_checkpoints must be null or a whole number >= 1 (the checkpointed "
        "blocks in one forward pass), got 'auto'."
    )


def test_a_misspelt_key_gets_the_closest_one() -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        build_zero_config(2, user_config={"activation_checkpointing": {"cpu_checkpoint": True}})
    assert str(info.value) == (
        "Unknown DeepSpeed config key 'activation_checkpointing.cpu_checkpoint' (did you mean "
        "'activation_checkpointing.cpu_checkpointing'?). DeepSpeed ignores unknown keys silently, so this would have "
        "had no effect. Fix or remove it."
    )


# ------------------------------------------------------------------------------------------------------ the policy
def test_policy_forms() -> None:
    assert checked_policy(None) is None and checked_policy(set()) is None
    assert checked_policy(Block) == checked_policy([Block, Block]) == checked_policy((Block,)) == frozenset({Block})


def _dummy_policy(module: nn.Module) -> bool:
    return True


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (
            "Block",
            "activation_checkpointing_policy must be a set of torch.nn.Module classes, got a str ('Block'). Pass the "
            "classes whose instances' forward is checkpointed, e.g. activation_checkpointing_policy={Block} with the "
            "class of the model's repeated block.",
        ),
        (
            _dummy_policy,
            "activation_checkpointing_policy must be a set of torch.nn.Module classes, got a callable (_dummy_policy): "
            "wrap policies as FSDP takes them are not supported. Pass the classes whose instances' forward is "
            "checkpointed, e.g. activation_checkpointing_policy={Block} with the class of the model's repeated block.",
        ),
        (
            [Block, "Linear", nn.ReLU(), int, nn.Module],
            "activation_checkpointing_policy holds entries that are not module classes to checkpoint: 'Linear' (a "
            "str): pass the module class itself, not its name or an object; ReLU() (a ReLU instance): pass its class, "
            "e.g. ReLU; int is not a torch.nn.Module subclass; torch.nn.Module matches every module, so the whole "
            "model would be one checkpoint. Pass the classes of the model's blocks, e.g. "
            "activation_checkpointing_policy={Block} with the class of the model's repeated block.",
        ),
    ],
)
def test_a_policy_that_is_not_module_classes_is_refused(policy: object, message: str) -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        ZeroTuning(activation_checkpointing_policy=policy)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_a_policy_matching_no_module_is_refused() -> None:
    with pytest.raises(DeepSpeedConfigError) as info:
        apply_policy(Net(blocks=1), checked_policy({nn.Conv1d, nn.GRU}))
    assert str(info.value) == (
        "activation_checkpointing_policy={Conv1d, GRU} matches no module of the model, so nothing would be "
        "checkpointed. The model's module classes are: Net, ModuleList, Block, Linear. Name the class of its repeated "
        "block (the class object itself, from the module that defines the model)."
    )


def test_a_module_with_its_own_forward_attribute_is_refused() -> None:
    net = Net(blocks=2)
    net.blocks[1].forward = net.blocks[1].forward  # type: ignore[method-assign]
    with pytest.raises(DeepSpeedConfigError) as info:
        apply_policy(net, checked_policy({Block}))
    assert str(info.value) == (
        "activation_checkpointing_policy cannot checkpoint Block module 'blocks.1': its instance has its own `forward` "
        "attribute, which the policy would replace. Remove that attribute (define forward on the class), or leave the "
        "class out of the policy and call deepspeed.checkpointing.checkpoint in the model."
    )


def test_only_the_outermost_matches_are_checkpointed_and_applying_again_changes_nothing() -> None:
    net = Net(blocks=2, inner=True)
    keys = list(net.state_dict())
    message = apply_policy(net, checked_policy({Block, nn.Linear}))
    assert message == (
        "lightspeed: activation checkpointing: the forward of 2 x Block, 1 x Linear runs under deepspeed.checkpointing"
    )
    assert checkpointed_modules(net) == ["blocks.0", "blocks.1", "head"]
    first = net.blocks[0].forward
    apply_policy(net, checked_policy({Block, nn.Linear}))
    assert net.blocks[0].forward is first and checkpointed_modules(net) == ["blocks.0", "blocks.1", "head"]
    assert list(net.state_dict()) == keys and type(net.blocks[0]) is Block  # the model is the same model


def test_checkpointed_blocks_compute_the_same_gradients_and_run_forward_twice() -> None:
    torch.manual_seed(0)
    plain = Net()
    checkpointed = copy.deepcopy(plain)
    apply_policy(checkpointed, checked_policy({Block}))
    x = torch.randn(4, 6)  # the first block's input has no gradient: the anchor gives its parameters theirs
    calls = []
    for net in (plain, checkpointed):
        Block.calls = 0
        net(x).pow(2).sum().backward()
        calls.append(Block.calls)
    assert calls == [3, 6]  # the forward again in the backward pass
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert torch.equal(p.grad, q.grad), name
    Block.calls = 0
    with torch.no_grad():
        checkpointed(x)
    assert Block.calls == 3  # nothing recorded for a backward pass, nothing checkpointed


def test_a_deep_copy_checkpoints_its_own_blocks() -> None:
    net = Net(blocks=1)
    apply_policy(net, checked_policy({Block}))
    twin = copy.deepcopy(net)
    forward = twin.blocks[0].forward
    assert isinstance(forward, CheckpointedForward) and forward.module is twin.blocks[0]


def test_checkpointed_huggingface_decoder_layers_recompute_without_the_kv_cache() -> None:
    """HF models build a KV cache in training too (``use_cache`` defaults to True); a checkpointed layer that wrote its
    keys into it would find them there again when recomputed in the backward pass and attend to them twice."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    checkpointed = copy.deepcopy(plain)
    apply_policy(checkpointed, checked_policy({LlamaDecoderLayer}))
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    grads = []
    for model in (plain, checkpointed):
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6, msg=name)


def test_a_prefilled_kv_cache_in_a_checkpointed_layer_is_refused() -> None:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    apply_policy(model, checked_policy({LlamaDecoderLayer}))
    cache = DynamicCache(config=config)
    with torch.no_grad():  # a prompt run first: checkpointing is off without gradients, the cache fills
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(DeepSpeedConfigError) as info:
        model(input_ids=torch.zeros(1, 2, dtype=torch.long), cache=cache, labels=torch.zeros(1, 2).long())
    assert str(info.value) == (
        "activation_checkpointing_policy runs LlamaDecoderLayer twice (its forward again in the backward pass), and "
        "it is given a KV cache that already holds 3 positions (prefix tuning, or a prompt run before): the second run "
        "would find its own keys in the cache. Train without a prefilled cache, or leave LlamaDecoderLayer out of the "
        "policy."
    )
