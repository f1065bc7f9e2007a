"""resolve_config: every "auto" rule, every Trainer/config mismatch, and the one-error-lists-all behaviour."""

from __future__ import annotations

import copy
import os
import re
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config import (
    OptimizerFacts,
    TrainingFacts,
    resolve_config,
    resolve_config_with_notes,
    validate_keys,
    zero_preset,
)

ADAMW = OptimizerFacts("AdamW", lr=2e-4, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05)


def facts(**overrides) -> TrainingFacts:
    values = dict(
        world_size=2,
        micro_batch_size=4,
        accumulate_grad_batches=3,
        gradient_clip_val=None,
        precision="32-true",
        hidden_size=10,
        optimizer=None,
        total_steps=None,
    )
    values.update(overrides)
    return TrainingFacts(**values)


def resolve_quietly(config: dict, training: TrainingFacts) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note expected unless a test says so
        return resolve_config(config, training)


# ------------------------------------------------------------------------------------------------------ auto rules
def test_batch_autos():
    out = resolve_quietly(
        {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto"},
        facts(),
    )
    assert out == {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "train_batch_size": 24}


def test_unknown_micro_batch_size_becomes_1_with_a_note():
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}
    with pytest.warns(
        UserWarning,
        match=re.escape(
            'The train dataloader\'s batch size is unknown, so train_micro_batch_size_per_gpu="auto" was set to 1.'
        ),
    ):
        out = resolve_config(config, facts(micro_batch_size=None))
    assert out["train_micro_batch_size_per_gpu"] == 1
    assert out["train_batch_size"] == 1 * 3 * 2


def test_unknown_micro_batch_size_is_derived_from_an_explicit_train_batch_size():
    out, notes = resolve_config_with_notes(
        {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 48}, facts(micro_batch_size=None)
    )
    assert out["train_micro_batch_size_per_gpu"] == 8 and out["train_batch_size"] == 48
    assert notes == [
        "The train dataloader's batch size is unknown; train_micro_batch_size_per_gpu=8 was derived "
        "from train_batch_size=48 / (accumulate_grad_batches=3 x 2 devices)."
    ]


def test_keys_that_must_match_the_trainer_are_filled_when_absent():
    out = resolve_quietly({}, facts(gradient_clip_val=0.5, precision="16-mixed"))
    assert out == {
        "gradient_accumulation_steps": 3,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.5,
        "fp16": {"enabled": True},
    }
    # nothing to fill for a 32-bit run without clipping: DeepSpeed's defaults (no clipping, fp32) already agree
    assert resolve_quietly({}, facts()) == {"gradient_accumulation_steps": 3, "train_micro_batch_size_per_gpu": 4}
    # an fp16 section without "enabled" would be off in DeepSpeed: it follows the precision like "auto"
    assert resolve_quietly({"fp16": {"loss_scale": 0}}, facts(precision="16-true"))["fp16"] == {
        "loss_scale": 0,
        "enabled": True,
    }


@pytest.mark.parametrize("clip, expected", [(None, 0.0), (0, 0.0), (0.0, 0.0), (1.5, 1.5), (2, 2.0)])
def test_gradient_clipping_auto(clip, expected):
    out = resolve_quietly({"gradient_clipping": "auto"}, facts(gradient_clip_val=clip))
    assert out["gradient_clipping"] == expected and isinstance(out["gradient_clipping"], float)


@pytest.mark.parametrize(
    "precision, fp16, bf16",
    [
        ("32-true", False, False),
        ("16-mixed", True, False),
        ("16-true", True, False),
        ("bf16-mixed", False, True),
        ("bf16-true", False, True),
    ],
)
def test_precision_autos(precision, fp16, bf16):
    out = resolve_quietly({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, facts(precision=precision))
    assert out["fp16"] == {"enabled": fp16} and out["bf16"] == {"enabled": bf16}


def test_legacy_bfloat16_section_follows_precision():
    out = resolve_quietly({"bfloat16": {"enabled": "auto"}}, facts(precision="bf16-mixed"))
    assert out == {"bfloat16": {"enabled": True}, "gradient_accumulation_steps": 3, "train_micro_batch_size_per_gpu": 4}


def test_zero_bucket_sizes_from_hidden_size():
    zero = resolve_quietly(zero_preset(3), facts(hidden_size=100))["zero_optimization"]
    assert zero["reduce_bucket_size"] == 10_000
    assert zero["stage3_prefetch_bucket_size"] == 9_000
    assert zero["stage3_param_persistence_threshold"] == 1_000
    # DeepSpeed's own field names (which it accepts as well as the stage3_ aliases) are resolved the same way
    zero = resolve_quietly(
        {"zero_optimization": {"stage": 3, "prefetch_bucket_size": "auto", "param_persistence_threshold": "auto"}},
        facts(hidden_size=7),
    )["zero_optimization"]
    assert (zero["prefetch_bucket_size"], zero["param_persistence_threshold"]) == (int(0.9 * 49), 70)


def test_allgather_bucket_auto_falls_back_to_deepspeed_default():
    zero = resolve_quietly(zero_preset(2), facts(hidden_size=100))["zero_optimization"]
    assert "allgather_bucket_size" not in zero and zero["reduce_bucket_size"] == 10_000


def test_unknown_hidden_size_drops_autos_so_deepspeed_defaults_apply():
    out, notes = resolve_config_with_notes(zero_preset(3), facts(hidden_size=None))
    zero = out["zero_optimization"]
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        assert key not in zero
    assert notes == [
        "The model's hidden size is unknown, so DeepSpeed's defaults are used for "
        "zero_optimization.reduce_bucket_size, zero_optimization.stage3_prefetch_bucket_size, "
        "zero_optimization.stage3_param_persistence_threshold. Write numbers into the DeepSpeed config "
        "to tune them."
    ]


def test_explicit_bucket_sizes_are_kept():
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 123, "stage3_prefetch_bucket_size": 45}}
    zero = resolve_quietly(config, facts(hidden_size=100))["zero_optimization"]
    assert zero == {"stage": 3, "reduce_bucket_size": 123, "stage3_prefetch_bucket_size": 45}


def test_optimizer_and_scheduler_autos():
    config = {
        "optimizer": {
            "type": "auto",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "amsgrad": False},
        },
        "scheduler": {
            "type": "OneCycle",
            "params": {"cycle_min_lr": 0.0, "cycle_max_lr": "auto", "cycle_first_step_size": 5},
        },
    }
    out = resolve_quietly(config, facts(optimizer=ADAMW, total_steps=77))
    assert out["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 2e-4, "betas": [0.8, 0.9], "eps": 1e-7, "weight_decay": 0.05, "amsgrad": False},
    }
    assert out["scheduler"]["params"]["cycle_max_lr"] == 2e-4
    warmup = resolve_quietly(
        {
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"warmup_max_lr": "auto", "total_num_steps": "auto", "warmup_num_steps": 3},
            }
        },
        facts(optimizer=ADAMW, total_steps=77),
    )
    assert warmup["scheduler"]["params"] == {"warmup_max_lr": 2e-4, "total_num_steps": 77, "warmup_num_steps": 3}


def test_input_is_not_modified():
    config = zero_preset(3, "cpu", "cpu")
    before = copy.deepcopy(config)
    out = resolve_quietly(config, facts(precision="bf16-mixed"))
    assert config == before
    out["zero_optimization"]["offload_param"]["pin_memory"] = False
    assert config == before


def test_matching_explicit_values_pass_unchanged():
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 3,
        "train_batch_size": 24,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": True},
    }
    assert resolve_quietly(config, facts(gradient_clip_val=1.0, precision="bf16-true")) == config


def test_explicit_clipping_is_allowed_when_the_trainer_does_not_clip():
    assert resolve_quietly({"gradient_clipping": 2.0}, facts())["gradient_clipping"] == 2.0


def test_micro_batch_size_is_not_checked_when_the_dataloader_is_unknown():
    out = resolve_quietly(
        {"train_micro_batch_size_per_gpu": 16, "train_batch_size": "auto"}, facts(micro_batch_size=None)
    )
    assert out["train_batch_size"] == 16 * 3 * 2


# ------------------------------------------------------------------------------------------------------ mismatches
@pytest.mark.parametrize(
    "config, overrides, line",
    [
        (
            {"gradient_accumulation_steps": 8},
            dict(accumulate_grad_batches=4),
            "gradient_accumulation_steps=8 in the DeepSpeed config, but Trainer(accumulate_grad_batches=4)",
        ),
        (
            {"train_micro_batch_size_per_gpu": 16},
            dict(),
            "train_micro_batch_size_per_gpu=16 in the DeepSpeed config, but the train dataloader's batch size is 4",
        ),
        (
            {"train_batch_size": 100},
            dict(),
            "train_batch_size=100 in the DeepSpeed config, but the batch size per device 4 x "
            "Trainer(accumulate_grad_batches=3) x 2 devices = 24",
        ),
        (
            {"gradient_clipping": 0.5},
            dict(gradient_clip_val=1.0),
            "gradient_clipping=0.5 in the DeepSpeed config, but Trainer(gradient_clip_val=1.0)",
        ),
        (
            {"bf16": {"enabled": True}},
            dict(precision="32-true"),
            'bf16.enabled=true in the DeepSpeed config, but Trainer(precision="32-true")',
        ),
        (
            {"bf16": {"enabled": False}},
            dict(precision="bf16-mixed"),
            'bf16.enabled=false in the DeepSpeed config, but Trainer(precision="bf16-mixed")',
        ),
        (
            {"fp16": {"enabled": True}},
            dict(precision="bf16-true"),
            'fp16.enabled=true in the DeepSpeed config, but Trainer(precision="bf16-true")',
        ),
        (
            {"fp16": {"enabled": False}},
            dict(precision="16-mixed"),
            'fp16.enabled=false in the DeepSpeed config, but Trainer(precision="16-mixed")',
        ),
    ],
)
def test_single_mismatch(config, overrides, line):
    with pytest.raises(DeepSpeedConfigError) as info:
        resolve_config(config, facts(**overrides))
    assert str(info.value) == (
        "The DeepSpeed config does not fit this run (1 problem):\n"
        f"  - {line}\n"
        'Make each pair agree: change the value in the DeepSpeed config (or set it to "auto" so it follows the '
        "Trainer), or change the Trainer argument."
    )


def test_fp16_and_bf16_both_enabled():
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape(
            "fp16.enabled and bf16.enabled are both true in the DeepSpeed config, but DeepSpeed can use only one of "
            'them; Trainer(precision="bf16-mixed") asks for bf16'
        ),
    ):
        resolve_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, facts(precision="bf16-mixed"))


def test_one_error_lists_every_mismatch():
    config = {
        "gradient_accumulation_steps": 8,
        "train_micro_batch_size_per_gpu": 16,
        "train_batch_size": 100,
        "gradient_clipping": 0.5,
        "fp16": {"enabled": True},
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    }
    with pytest.raises(DeepSpeedConfigError) as info:
        resolve_config(config, facts(gradient_clip_val=1.0, precision="bf16-mixed", accumulate_grad_batches=4))
    lines = str(info.value).splitlines()
    assert lines[0] == "The DeepSpeed config does not fit this run (7 problems):"
    assert lines[1:8] == [
        "  - gradient_accumulation_steps=8 in the DeepSpeed config, but Trainer(accumulate_grad_batches=4)",
        "  - train_micro_batch_size_per_gpu=16 in the DeepSpeed config, but the train dataloader's batch size is 4",
        "  - train_batch_size=100 in the DeepSpeed config, but the batch size per device 4 x "
        "Trainer(accumulate_grad_batches=4) x 2 devices = 32",
        "  - gradient_clipping=0.5 in the DeepSpeed config, but Trainer(gradient_clip_val=1.0)",
        '  - fp16.enabled=true in the DeepSpeed config, but Trainer(precision="bf16-mixed")',
        '  - bf16.enabled=false in the DeepSpeed config, but Trainer(precision="bf16-mixed")',
        '  - optimizer.params.lr is "auto", but the LightningModule\'s optimizer is unknown. Write the number '
        'instead, e.g. "lr": 0.001.',
    ]
    assert lines[8].startswith("Make each pair agree")


def test_errors_name_the_arguments_of_the_front_end_in_use() -> None:
    """Fabric's strategies pass ``front_end="Fabric"``: the messages name Fabric's arguments, not the Trainer's."""
    config = {"fp16": {"enabled": True}, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}
    with pytest.raises(DeepSpeedConfigError) as info:
        resolve_config(config, facts(precision="bf16-mixed", front_end="Fabric"))
    assert str(info.value).splitlines()[1:3] == [
        '  - fp16.enabled=true in the DeepSpeed config, but Fabric(precision="bf16-mixed")',
        '  - scheduler.params.total_num_steps is "auto", but the number of optimizer steps of the run is unknown '
        '(Fabric does not know the length of the run). Or write the number instead, e.g. "total_num_steps": 10000.',
    ]
    assert str(info.value).endswith('(or set it to "auto" so it follows Fabric), or change the Fabric argument.')
    with pytest.raises(DeepSpeedConfigError, match=r"^Fabric\(precision='64-true'\) cannot be used with DeepSpeed"):
        facts(precision="64-true", front_end="Fabric")
    with pytest.raises(DeepSpeedConfigError, match='or "auto" to take it from Fabric'):
        validate_keys({"train_batch_size": 0}, "Fabric")


# --------------------------------------------------------------------------------------------- unresolvable autos
@pytest.mark.parametrize(
    "config, overrides, line",
    [
        (
            {"optimizer": {"type": "auto", "params": {}}},
            dict(),
            'optimizer.type is "auto", but the LightningModule\'s optimizer is unknown. Write the optimizer name '
            'instead, e.g. "type": "AdamW".',
        ),
        (
            {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": "auto"}}},
            dict(optimizer=OptimizerFacts("SGD", lr=0.1)),
            'optimizer.params.betas is "auto", but the LightningModule\'s optimizer (SGD) has no betas. Write the '
            'number instead, e.g. "betas": [0.9, 0.999].',
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}},
            dict(),
            'scheduler.params.warmup_max_lr is "auto", but the LightningModule\'s optimizer (and so its learning rate) '
            'is unknown. Write the peak learning rate instead, e.g. "warmup_max_lr": 0.001.',
        ),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
            dict(),
            'scheduler.params.total_num_steps is "auto", but the number of optimizer steps of the run is unknown (set '
            'Trainer(max_steps=...) or a finite max_epochs). Or write the number instead, e.g. "total_num_steps": '
            "10000.",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto"}}},
            dict(optimizer=ADAMW),
            'scheduler.params.warmup_min_lr is "auto", but lightspeed cannot derive it from the Trainer or the model. '
            "Write the value instead, or remove the key.",
        ),
        (
            {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"}},
            dict(),
            'zero_optimization.stage3_max_live_parameters is "auto", but lightspeed cannot derive it from the Trainer '
            "or the model. Write the value instead (DeepSpeed's default is 1000000000), or remove the key.",
        ),
        (
            {"fp16": {"enabled": "auto", "initial_scale_power": "auto"}},
            dict(precision="16-mixed"),
            'fp16.initial_scale_power is "auto", but lightspeed cannot derive it from the Trainer or the model. Write '
            "the value instead (DeepSpeed's default is 16), or remove the key.",
        ),
        (
            {"steps_per_print": "auto"},
            dict(),
            'steps_per_print is "auto", but lightspeed cannot derive it from the Trainer or the model. Write the value '
            "instead, or remove the key.",
        ),
    ],
)
def test_unresolvable_auto(config, overrides, line):
    with pytest.raises(DeepSpeedConfigError) as info:
        resolve_config(config, facts(**overrides))
    assert str(info.value) == f"The DeepSpeed config does not fit this run (1 problem):\n  - {line}"


def test_keys_are_validated_first():
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape(
            "Unknown DeepSpeed config key 'gradient_accumulation_step' (did you mean 'gradient_accumulation_steps'?)"
        ),
    ):
        resolve_config({"gradient_accumulation_step": 8}, facts())


def test_auto_values_where_deepspeed_itself_accepts_auto_are_left_alone():
    # pipeline.stages and data_types.keep_in_fp32_modules take "auto" in DeepSpeed itself
    config = {"pipeline": {"stages": "auto"}, "data_types": {"keep_in_fp32_modules": "auto"}}
    out = resolve_quietly(config, facts())
    assert out["pipeline"] == {"stages": "auto"} and out["data_types"] == {"keep_in_fp32_modules": "auto"}


# ------------------------------------------------------------------------------------------------------- facts
def test_unsupported_precision():
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape(
            "Trainer(precision='64-true') cannot be used with DeepSpeed. Use one of '32-true', '16-mixed', "
            "'bf16-mixed', '16-true', 'bf16-true'."
        ),
    ):
        facts(precision="64-true")


@pytest.mark.parametrize(
    "field, value",
    [
        ("world_size", 0),
        ("accumulate_grad_batches", 0),
        ("micro_batch_size", 0),
        ("hidden_size", -3),
        ("gradient_clip_val", -1.0),
    ],
)
def test_facts_reject_impossible_values(field, value):
    with pytest.raises(ValueError, match=f"TrainingFacts.{field} must be"):
        facts(**{field: value})
