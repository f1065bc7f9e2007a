"""The strategies' ``bf16_master_weights_and_grads`` / ``bf16_optimizer_states``: the DeepSpeed ``bf16`` section they
build, the combinations DeepSpeed refuses or fails on named at construction (from the arguments or a user's ``bf16``
section), a precision that is not bf16 named when the config is resolved, and the planner's bytes with them and the
options it leaves out."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightspeed.core.errors import DeepSpeedConfigError, MemoryPlanError
from lightspeed.core.zero.config import ZeroTuning, build_zero_config
from lightspeed.core.zero.planner import ZERO_OPTIONS, Accounting, Budgets, Cluster, ModelCounts, plan
from lightspeed.core.zero.planner.accounting import estimate_option
from lightspeed.fabric import ZeroFabricStrategy
from lightspeed.strategies import ZeroStrategy


@pytest.mark.parametrize("strategy", [ZeroStrategy, ZeroFabricStrategy])
def test_the_arguments_become_deepspeed_bf16_keys(strategy: type) -> None:
    both = strategy(stage=2, bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    assert both.config["bf16"] == {
        "enabled": "auto",
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }
    offloaded = strategy(stage=2, offload_optimizer="cpu", bf16_master_weights_and_grads=True)
    assert offloaded.config["bf16"] == {"enabled": "auto", "bf16_master_weights_and_grads": True}
    assert strategy(stage=2).config["bf16"] == {"enabled": "auto"}


def test_combinations_deepspeed_refuses_are_named_at_construction() -> None:
    with pytest.raises(DeepSpeedConfigError, match="needs bf16_master_weights_and_grads=True with it"):
        ZeroTuning(bf16_optimizer_states=True)
    with pytest.raises(DeepSpeedConfigError) as error:
        build_zero_config(2, tuning=ZeroTuning(bf16_master_weights_and_grads=True))
    assert str(error.value) == (
        "bf16_master_weights_and_grads=True without bf16_optimizer_states keeps the optimizer moments in fp32, which "
        "DeepSpeed runs only with the optimizer offloaded (its CPU Adam): pass offload_optimizer='cpu' (e.g. "
        "strategy='zero2_offload'), or bf16_optimizer_states=True to keep everything in bf16."
    )


@pytest.mark.parametrize("given", ["arguments", "user_config"])
def test_bf16_master_weights_with_the_optimizer_on_nvme_are_refused_before_anything_is_built(
    given: str, tmp_path: Path
) -> None:
    """DeepSpeed's optimizer swapper would fail on a bare AssertionError in the first step."""
    master = {"bf16_master_weights_and_grads": True}
    tuning, user = (ZeroTuning(**master), None) if given == "arguments" else (ZeroTuning(), {"bf16": master})
    with pytest.raises(DeepSpeedConfigError) as error:
        build_zero_config(3, "nvme", "nvme", nvme_path=str(tmp_path), user_config=user, tuning=tuning)
    assert str(error.value) == (
        "bf16_master_weights_and_grads=True with the optimizer states on NVMe: DeepSpeed's optimizer swapper keeps "
        "fp32 swap buffers, and the first step would fail inside DeepSpeed. Offload the optimizer to the CPU instead "
        "(offload_optimizer='cpu', e.g. strategy='zero3_offload'), or keep fp32 master weights."
    )
    with pytest.raises(DeepSpeedConfigError, match="keeps the optimizer moments in fp32"):  # no offload, from the file
        build_zero_config(2, user_config={"bf16": master})


@pytest.mark.parametrize("states", [False, True])
def test_the_planner_never_chooses_an_option_deepspeed_cannot_run_with_the_bf16_states(states: bool) -> None:
    counts = ModelCounts(total_params=1_000_000, largest_layer_params=100_000)
    accounting = Accounting(bf16_master_weights_and_grads=True, bf16_optimizer_states=states)
    budgets = Budgets(device_memory=None, host_memory=2**40, nvme_free=2**40)
    result = plan(counts, Cluster(devices_per_node=2, nodes=1), budgets, accounting)
    refused = {v.estimate.option.name: v.reason for v in result.verdicts if v.reason.startswith("cannot run")}
    nvme = {"zero3_nvme": "cannot run: DeepSpeed's NVMe optimizer swapper does not run bf16 master weights"}
    without_offload = (
        "cannot run: bf16 master weights with fp32 moments run only with the optimizer offloaded to the CPU"
    )
    in_memory = {} if states else {o.name: without_offload for o in ZERO_OPTIONS if o.offload_optimizer == "none"}
    assert refused == {**in_memory, **nvme}
    assert result.choice is not None and result.choice.estimate.option.name == ("zero1" if states else "zero2_offload")


def test_a_precision_that_is_not_bf16_is_named_when_the_config_is_resolved() -> None:
    from lightspeed.core.zero.config import resolve_config
    from lightspeed.core.zero.config.facts import TrainingFacts

    config = build_zero_config(2, tuning=ZeroTuning(bf16_master_weights_and_grads=True, bf16_optimizer_states=True))
    facts = TrainingFacts(
        world_size=2,
        micro_batch_size=1,
        accumulate_grad_batches=1,
        gradient_clip_val=None,
        precision="32-true",
        hidden_size=None,
    )
    with pytest.raises(
        DeepSpeedConfigError,
        match=(
            r"bf16_master_weights_and_grads and bf16_optimizer_states keep training state in bf16, but "
            r'Trainer\(precision="32-true"\) \(they need precision="bf16-mixed" or "bf16-true"\)'
        ),
    ):
        resolve_config(config, facts)


def test_the_planner_counts_two_bytes_per_master_weight_gradient_and_moment() -> None:
    counts = ModelCounts(total_params=1_000_000, largest_layer_params=100_000)
    cluster = Cluster(devices_per_node=2, nodes=1)
    option = next(o for o in ZERO_OPTIONS if o.name == "zero2_offload")
    fp32 = estimate_option(option, counts, cluster, Accounting())
    both = estimate_option(
        option, counts, cluster, Accounting(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    )
    per_node = 1_000_000
    assert fp32.host.grads - both.host.grads == 2 * per_node  # fp32 -> bf16 gradients of the partitions
    assert fp32.host.optimizer - both.host.optimizer == (2 + 4) * per_node  # master 4 -> 2, Adam moments 8 -> 4
    with pytest.raises(MemoryPlanError, match="need a bf16 precision"):
        Accounting(precision="16-mixed", bf16_master_weights_and_grads=True)
