"""Loading, key validation, presets and merging of DeepSpeed configs (lightspeed.core.zero.config)."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's own config parser needs an accelerator; no GPU here

import pytest

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config import (
    TrainingFacts,
    describe_config,
    load_user_config,
    merge_configs,
    resolve_config,
    validate_keys,
    zero_preset,
)


def _deepspeed_parse(config: dict):
    """DeepSpeed's own parser (single process: world size 1)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(copy.deepcopy(config))


# --------------------------------------------------------------------------------------------- load_user_config
def test_load_none_gives_empty_dict():
    assert load_user_config(None) == {}


def test_load_dict_is_a_deep_copy():
    user = {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}
    loaded = load_user_config(user)
    assert loaded == user
    loaded["zero_optimization"]["stage"] = 3
    assert user["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("as_path", [str, Path])
def test_load_json_file(tmp_path, as_path):
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "gradient_clipping": 1.0}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert load_user_config(as_path(path)) == config


def test_load_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape(f"DeepSpeed config file '{path}' does not exist. Pass the path of an existing JSON file"),
    ):
        load_user_config(path)


def test_load_directory(tmp_path):
    with pytest.raises(
        DeepSpeedConfigError, match=re.escape(f"DeepSpeed config path '{tmp_path}' is a directory, not a file.")
    ):
        load_user_config(str(tmp_path))


def test_load_invalid_json_reports_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "zero_optimization": {"stage": 2},\n}\n')  # trailing comma on line 2
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape(
            f"DeepSpeed config file '{path}' is not valid JSON: Expecting property name enclosed in "
            "double quotes at line 3, column 1. Fix the JSON syntax there"
        ),
    ):
        load_user_config(path)


def test_load_top_level_not_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape(
            f"DeepSpeed config file '{path}' must hold a JSON object ({{...}}) at the top level, but it holds a "
            "JSON array."
        ),
    ):
        load_user_config(path)


def test_load_duplicate_key(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape(f"DeepSpeed config file '{path}' sets the key 'stage' twice in the same object."),
    ):
        load_user_config(path)


def test_load_wrong_type():
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape("The DeepSpeed config must be a dict, a path to a JSON file, or None; got a int."),
    ):
        load_user_config(3)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ validate_keys
def test_top_level_typo_is_named_with_suggestion():
    with pytest.raises(DeepSpeedConfigError) as info:
        validate_keys({"zero_optimisation": {"stage": 2}})
    assert str(info.value) == (
        "Unknown DeepSpeed config key 'zero_optimisation' (did you mean 'zero_optimization'?). DeepSpeed ignores "
        "unknown keys silently, so this would have had no effect. Fix or remove it."
    )


def test_nested_typo_is_named_with_dotted_suggestion():
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape(
            "Unknown DeepSpeed config key 'zero_optimization.stage3_prefetch_bucket_sise' (did you mean "
            "'zero_optimization.stage3_prefetch_bucket_size'?). DeepSpeed would stop on it with a pydantic "
            "validation error. Fix or remove it."
        ),
    ):
        validate_keys({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 100}})


@pytest.mark.parametrize(
    "config, dotted, suggestion",
    [
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
            "zero_optimization.offload_optimizer.pin_memroy",
            "zero_optimization.offload_optimizer.pin_memory",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"devise": "cpu"}}},
            "zero_optimization.offload_param.devise",
            "zero_optimization.offload_param.device",
        ),
        ({"fp16": {"enabled": True, "loss_scale_windows": 100}}, "fp16.loss_scale_windows", "fp16.loss_scale_window"),
        ({"bf16": {"enable": True}}, "bf16.enable", "bf16.enabled"),
        ({"optimizer": {"typ": "AdamW", "params": {}}}, "optimizer.typ", "optimizer.type"),
        ({"scheduler": {"type": "WarmupLR", "param": {}}}, "scheduler.param", "scheduler.params"),
        (
            {"activation_checkpointing": {"partitioned_activations": True}},
            "activation_checkpointing.partitioned_activations",
            "activation_checkpointing.partition_activations",
        ),
        ({"aio": {"block_sise": 1048576}}, "aio.block_sise", "aio.block_size"),
        ({"tensorboard": {"enabled": True, "output_dir": "x"}}, "tensorboard.output_dir", "tensorboard.output_path"),
        ({"comms_logger": {"enabled": True, "prof_al": True}}, "comms_logger.prof_al", "comms_logger.prof_all"),
        (
            {"flops_profiler": {"enabled": True, "profile_steps": 2}},
            "flops_profiler.profile_steps",
            "flops_profiler.profile_step",
        ),
        ({"checkpoint": {"writer": {"typ": "fast"}}}, "checkpoint.writer.typ", "checkpoint.writer.type"),
        ({"FP16": {"enabled": True}}, "FP16", "fp16"),
        # A valid key put in the wrong section: suggest where it belongs.
        ({"offload_optimizer": {"device": "cpu"}}, "offload_optimizer", "zero_optimization.offload_optimizer"),
    ],
)
def test_unknown_keys_at_every_level(config, dotted, suggestion):
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape(f"Unknown DeepSpeed config key '{dotted}' (did you mean '{suggestion}'?)."),
    ):
        validate_keys(config)


def test_unknown_key_without_any_close_match():
    with pytest.raises(DeepSpeedConfigError) as info:
        validate_keys({"qqqqqqqq": 1})
    assert str(info.value) == (
        "Unknown DeepSpeed config key 'qqqqqqqq'. DeepSpeed ignores unknown keys silently, "
        "so this would have had no effect. Fix or remove it."
    )


def test_all_problems_are_listed_in_one_error():
    config = {
        "zero_optimisation": {"stage": 2},
        "zero_optimization": {"stage": 5, "reduce_bucket_sise": 10},
        "fp16": {"enabeld": True},
        "gradient_acumulation_steps": 2,
    }
    with pytest.raises(DeepSpeedConfigError) as info:
        validate_keys(config)
    message = str(info.value)
    assert message.startswith("5 problems in the DeepSpeed config:\n")
    for expected in (
        "1. Unknown DeepSpeed config key 'zero_optimisation' (did you mean 'zero_optimization'?)",
        "2. Unknown DeepSpeed config key 'zero_optimization.reduce_bucket_sise' (did you mean "
        "'zero_optimization.reduce_bucket_size'?)",
        "3. Unknown DeepSpeed config key 'fp16.enabeld' (did you mean 'fp16.enabled'?)",
        "4. Unknown DeepSpeed config key 'gradient_acumulation_steps' (did you mean 'gradient_accumulation_steps'?)",
        "5. ZeRO stage must be 0, 1, 2 or 3, got 5",
    ):
        assert expected in message


@pytest.mark.parametrize("stage, shown", [(5, "5"), (-1, "-1"), ("3", "'3'"), (True, "True"), (2.5, "2.5")])
def test_zero_stage_must_be_0_to_3(stage, shown):
    with pytest.raises(DeepSpeedConfigError, match=re.escape(f"ZeRO stage must be 0, 1, 2 or 3, got {shown}")):
        validate_keys({"zero_optimization": {"stage": stage}})


def test_offload_values_are_checked():
    with pytest.raises(DeepSpeedConfigError) as info:
        validate_keys(
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "gpu"},
                    "offload_param": {"device": "nvme"},
                }
            }
        )
    message = str(info.value)
    assert "zero_optimization.offload_optimizer.device must be 'none', 'cpu' or 'nvme', got 'gpu'." in message
    assert (
        "zero_optimization.offload_param.device is 'nvme' but zero_optimization.offload_param.nvme_path is not set."
    ) in message
    assert "zero_optimization.offload_param only works with ZeRO stage 3, but the stage is 2." in message


def test_optimizer_offload_needs_a_zero_stage():
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape("zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3, but the stage is 0."),
    ):
        validate_keys({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})


def test_removed_deepspeed_key_gets_deepspeeds_explanation():
    with pytest.raises(
        DeepSpeedConfigError,
        match=r"DeepSpeed config key 'zero_optimization\.mics_shard_size' is no longer supported by "
        r"DeepSpeed: MiCS ZeRO-3 sharding has been removed",
    ):
        validate_keys({"zero_optimization": {"stage": 3, "mics_shard_size": 8}})


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"fp16": True},
            "DeepSpeed config key 'fp16' must be an object ({...} with its own keys), got True. Write it "
            'as a JSON object, e.g. "fp16": {"enabled": true}.',
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": "cpu"}},
            "DeepSpeed config key 'zero_optimization.offload_param' must be an object ({...} with its own keys), got "
            '\'cpu\'. Write it as a JSON object, e.g. "offload_param": {"device": "cpu"}.',
        ),
    ],
)
def test_section_must_be_an_object(config, message):
    with pytest.raises(DeepSpeedConfigError, match=re.escape(message)):
        validate_keys(config)


def test_scheduler_type_typo():
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape("Unknown DeepSpeed scheduler type 'WarmupLr' (did you mean 'WarmupLR'?) in scheduler.type."),
    ):
        validate_keys({"scheduler": {"type": "WarmupLr", "params": {}}})


def test_valid_variants_pass():
    validate_keys({})
    validate_keys(
        {
            # pydantic field names and their aliases are both accepted by DeepSpeed
            "zero_optimization": {
                "stage": 3,
                "prefetch_bucket_size": 10,
                "stage3_max_live_parameters": 10,
                "param_persistence_threshold": 5,
            },
            "bfloat16": {"enabled": True},  # DeepSpeed's old name for "bf16"
            "optimizer": {"type": "MyOwnOptimizer", "params": {"anything": 1, "goes": [1, 2]}},  # params are free-form
            "pipeline": {"stages": "auto"},  # free-form section
            "aio": None,
            "zero_allow_untested_optimizer": True,
        }
    )


def test_unknown_key_in_a_plain_section_really_is_ignored_by_deepspeed():
    """Why validate_keys exists: DeepSpeed takes this typo without a word and keeps its default."""
    parsed = _deepspeed_parse(
        {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {"partitioned_activations": True}}
    )
    assert parsed.activation_checkpointing_config.partition_activations is False
    with pytest.raises(DeepSpeedConfigError, match="did you mean 'activation_checkpointing.partition_activations'"):
        validate_keys({"activation_checkpointing": {"partitioned_activations": True}})


def test_unknown_key_in_a_strict_section_is_rejected_by_deepspeed_too():
    """Our 'DeepSpeed would stop on it' wording is accurate for pydantic sections."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    with pytest.raises(Exception, match="stage3_prefetch_bucket_sise"):
        DeepSpeedZeroConfig(stage=3, stage3_prefetch_bucket_sise=10)


HF_STYLE_CONFIG = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": 10, "total_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "activation_checkpointing": {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True},
    "tensorboard": {"enabled": False, "output_path": "logs/", "job_name": "run"},
    "csv_monitor": {"enabled": False},
    "wandb": {"enabled": False, "project": "p"},
    "comms_logger": {"enabled": False, "verbose": False, "prof_all": True, "debug": False},
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": True},
    "checkpoint": {"tag_validation": "Warn"},
    "data_types": {"grad_accum_dtype": "fp32"},
    "communication_data_type": "fp32",
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True,
}


def test_hf_style_config_with_every_section_passes_us_and_deepspeed():
    from lightspeed.core.zero.config import OptimizerFacts

    validate_keys(HF_STYLE_CONFIG)
    facts = TrainingFacts(
        world_size=1,
        micro_batch_size=4,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        precision="16-mixed",
        hidden_size=32,
        optimizer=OptimizerFacts("AdamW", lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1),
        total_steps=500,
    )
    parsed = _deepspeed_parse(resolve_config(HF_STYLE_CONFIG, facts))
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (
        8,
        4,
        2,
    )
    assert parsed.gradient_clipping == 1.0
    assert parsed.float16_config.enabled and not parsed.bfloat16_config.enabled
    assert parsed.optimizer_params == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert parsed.scheduler_params == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 10,
        "total_num_steps": 500,
    }
    zero = parsed.zero_config
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (
        32 * 32,
        int(0.9 * 32 * 32),
        320,
    )
    assert zero.gather_16bit_weights_on_model_save is True


# -------------------------------------------------------------------------------------------------- zero_preset
def _preset_cases():
    cases = [(0, "none", "none")]
    cases += [(stage, opt, "none") for stage in (1, 2) for opt in ("none", "cpu", "nvme")]
    cases += [(3, opt, par) for opt in ("none", "cpu", "nvme") for par in ("none", "cpu", "nvme")]
    return cases


@pytest.mark.parametrize("stage, offload_optimizer, offload_parameters", _preset_cases())
def test_presets_pass_validation_and_deepspeeds_parser(stage, offload_optimizer, offload_parameters, tmp_path):
    nvme = str(tmp_path) if "nvme" in (offload_optimizer, offload_parameters) else None
    preset = zero_preset(stage, offload_optimizer, offload_parameters, nvme_path=nvme)
    validate_keys(preset)
    facts = TrainingFacts(
        world_size=1,
        micro_batch_size=2,
        accumulate_grad_batches=3,
        gradient_clip_val=None,
        precision="bf16-mixed",
        hidden_size=16,
    )
    parsed = _deepspeed_parse(resolve_config(preset, facts))
    zero = parsed.zero_config
    assert zero.stage == stage
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (2, 3)
    assert parsed.bfloat16_config.enabled and not parsed.float16_config.enabled
    assert parsed.zero_allow_untested_optimizer is True
    if stage >= 1:
        assert zero.reduce_bucket_size == 16 * 16
    if stage >= 2:
        assert zero.overlap_comm is True and zero.contiguous_gradients is True
    if stage == 1:
        assert zero.overlap_comm is False  # DeepSpeed's own default for stage 1: nothing to overlap
    if stage == 3:
        assert (zero.prefetch_bucket_size, zero.param_persistence_threshold) == (int(0.9 * 256), 160)
    expected_opt = None if offload_optimizer == "none" else offload_optimizer
    assert (zero.offload_optimizer.device if zero.offload_optimizer else None) == expected_opt
    expected_par = None if offload_parameters == "none" else offload_parameters
    assert (zero.offload_param.device if zero.offload_param else None) == expected_par
    for offload in (zero.offload_optimizer, zero.offload_param):
        if offload is not None and offload.device == "nvme":
            assert str(offload.nvme_path) == nvme


def test_preset_uses_auto_for_everything_the_trainer_decides():
    preset = zero_preset(2)
    assert preset["train_micro_batch_size_per_gpu"] == "auto"
    assert preset["gradient_accumulation_steps"] == "auto"
    assert preset["gradient_clipping"] == "auto"
    assert preset["fp16"] == {"enabled": "auto"} and preset["bf16"] == {"enabled": "auto"}
    assert preset["zero_optimization"]["reduce_bucket_size"] == "auto"
    assert preset["zero_optimization"]["allgather_bucket_size"] == "auto"
    stage3 = zero_preset(3)["zero_optimization"]
    assert stage3["stage3_prefetch_bucket_size"] == "auto" and stage3["stage3_param_persistence_threshold"] == "auto"


def test_preset_accepts_whole_floats_like_deepspeed():
    zero = zero_preset(2, reduce_bucket_size=5e8, allgather_bucket_size=2e8)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 500_000_000 and isinstance(zero["reduce_bucket_size"], int)
    assert zero["allgather_bucket_size"] == 200_000_000


def test_preset_explicit_sizes_and_pin_memory():
    zero = zero_preset(
        3,
        "cpu",
        "cpu",
        pin_memory=False,
        reduce_bucket_size=1000,
        prefetch_bucket_size=900,
        param_persistence_threshold=50,
        sub_group_size=10_000,
    )["zero_optimization"]
    assert zero["reduce_bucket_size"] == 1000
    assert zero["stage3_prefetch_bucket_size"] == 900
    assert zero["stage3_param_persistence_threshold"] == 50
    assert zero["sub_group_size"] == 10_000
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": False}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stage=5), "ZeRO stage must be 0, 1, 2 or 3, got 5"),
        (
            dict(stage=2, offload_parameters="cpu"),
            "Parameter offload needs ZeRO stage 3, but stage is 2. Use stage 3 or offload_parameters='none'.",
        ),
        (dict(stage=0, offload_optimizer="cpu"), "Optimizer offload needs ZeRO stage 1, 2 or 3, but stage is 0."),
        (dict(stage=3, offload_optimizer="nvme"), "Offloading to 'nvme' needs nvme_path"),
        (
            dict(stage=3, offload_optimizer="cpu", nvme_path="/nvme"),
            "nvme_path='/nvme' is only used when offloading to 'nvme'.",
        ),
        (dict(stage=3, offload_optimizer="gpu"), "offload_optimizer must be 'none', 'cpu' or 'nvme', got 'gpu'."),
        (dict(stage=2, prefetch_bucket_size=100), "prefetch_bucket_size only applies to ZeRO stage 3, but stage is 2."),
        (dict(stage=1, sub_group_size=100), "sub_group_size only applies to ZeRO stage 3, but stage is 1."),
        (dict(stage=3, allgather_bucket_size=100), "allgather_bucket_size only applies to ZeRO stages 1 and 2"),
        (
            dict(stage=2, reduce_bucket_size=0),
            "reduce_bucket_size must be a positive whole number of elements or 'auto', got 0.",
        ),
        (
            dict(stage=3, sub_group_size=-1),
            "sub_group_size must be a positive whole number of elements or 'auto', got -1.",
        ),
        (
            dict(stage=2, reduce_bucket_size=2.5),
            "reduce_bucket_size must be a positive whole number of elements or 'auto', got 2.5.",
        ),
        (
            dict(stage=3, param_persistence_threshold=-1),
            "param_persistence_threshold must be a whole number of elements >= 0 or 'auto', got -1.",
        ),
    ],
)
def test_preset_errors(kwargs, message):
    with pytest.raises(DeepSpeedConfigError, match=re.escape(message)):
        zero_preset(**kwargs)


def test_param_persistence_threshold_zero_partitions_every_parameter():
    # DeepSpeed's own value for "keep no parameter whole", as accepted through config=; resolution keeps it
    config = zero_preset(stage=3, param_persistence_threshold=0)
    assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    facts = TrainingFacts(
        world_size=2,
        micro_batch_size=2,
        accumulate_grad_batches=1,
        gradient_clip_val=None,
        precision="32-true",
        hidden_size=32,
    )
    assert resolve_config(config, facts)["zero_optimization"]["stage3_param_persistence_threshold"] == 0


# ------------------------------------------------------------------------------------------------ merge_configs
def test_merge_is_deep_and_override_wins():
    base = zero_preset(3, "cpu")
    override = {
        "zero_optimization": {"offload_optimizer": {"pin_memory": False}, "stage3_max_live_parameters": 10},
        "gradient_clipping": 0.5,
        "fp16": {"enabled": True},
    }
    merged = merge_configs(base, override)
    assert merged["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert merged["zero_optimization"]["stage3_max_live_parameters"] == 10
    assert merged["zero_optimization"]["overlap_comm"] is True  # untouched base keys stay
    assert merged["gradient_clipping"] == 0.5
    assert merged["fp16"] == {"enabled": True}
    assert merged["bf16"] == {"enabled": "auto"}


def test_merge_replaces_non_dicts_and_leaves_inputs_untouched():
    base = {"a": {"b": [1, 2], "c": {"d": 1}}, "e": {"f": 1}}
    override = {"a": {"b": [3]}, "e": None, "g": {"h": [4]}}
    base_before, override_before = copy.deepcopy(base), copy.deepcopy(override)
    merged = merge_configs(base, override)
    assert merged == {"a": {"b": [3], "c": {"d": 1}}, "e": None, "g": {"h": [4]}}
    merged["a"]["c"]["d"] = 99
    merged["g"]["h"].append(5)
    assert base == base_before and override == override_before


def test_describe_config_round_trips_as_sorted_json():
    config = zero_preset(3, "cpu", "cpu")
    text = describe_config(config)
    assert json.loads(text) == config
    assert text.index('"bf16"') < text.index('"zero_optimization"')
    assert '\n  "fp16": {\n    "enabled": "auto"\n  }' in text


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "train_micro_batch_size_per_gpu",
            "8",
            "train_micro_batch_size_per_gpu must be a whole number >= 1 or \"auto\", got '8'.",
        ),
        ("gradient_accumulation_steps", 0, 'gradient_accumulation_steps must be a whole number >= 1 or "auto", got 0.'),
        ("train_batch_size", 32.0, 'train_batch_size must be a whole number >= 1 or "auto", got 32.0.'),
        (
            "gradient_clipping",
            -1.0,
            'gradient_clipping must be a number >= 0 (0 means no clipping) or "auto", got -1.0.',
        ),
    ],
)
def test_top_level_values_are_checked(key, value, message):
    with pytest.raises(DeepSpeedConfigError, match=re.escape(message)):
        validate_keys({key: value})


def test_bf16_and_its_old_name_together():
    with pytest.raises(
        DeepSpeedConfigError,
        match=re.escape(
            "The DeepSpeed config has both 'bf16' and its old name 'bfloat16'; DeepSpeed reads only 'bf16' then."
        ),
    ):
        validate_keys({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}})


def test_config_must_be_a_dict():
    with pytest.raises(DeepSpeedConfigError, match=re.escape("The DeepSpeed config must be a dict, got a str.")):
        validate_keys("ds.json")  # type: ignore[arg-type]
