"""The strategies' ``bf16_master_weights_and_grads`` / ``bf16_optimizer_states``: the DeepSpeed ``bf16`` section they
build, the combinations DeepSpeed refuses named at construction, a precision that is not bf16 named when the config is
resolved, and the planner's bytes with them."""

from __future__ import annotations

import pytest

from lightspeed.core.errors import DeepSpeedConfigError, MemoryPlanError
from lightspeed.core.zero.config import ZeroTuning, build_zero_config
from lightspeed.core.zero.planner import ZERO_OPTIONS, Accounting, Cluster, ModelCounts
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
