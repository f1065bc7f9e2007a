"""``RayZeroStrategy`` and ``RayZeroFabricStrategy`` where they cannot work: outside a Ray Train training function,
with node-local storage (Ray's storage collects every worker's files itself), with a timeout (Ray's), and (Fabric)
with what Ray sets; one clear error each, before anything starts."""

from __future__ import annotations

from datetime import timedelta

import pytest

pytest.importorskip("ray.train", reason="needs Ray Train: pip install 'lightspeed[ray]'")

from lightspeed.ray import RayZeroFabricStrategy, RayZeroStrategy  # noqa: E402


@pytest.mark.parametrize("strategy", [RayZeroStrategy, RayZeroFabricStrategy])
def test_outside_a_ray_worker_the_error_says_where_to_build_it(strategy: type) -> None:
    with pytest.raises(RuntimeError) as error:
        strategy(stage=2)
    assert str(error.value) == (
        f"{strategy.__name__} runs inside a Ray Train training function: build it in the function you pass to "
        "ray.train.torch.TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=N)) and train there. "
        "Outside Ray, use lightspeed's strategies themselves (ZeroStrategy, ZeroFabricStrategy, or a strategy name "
        "such as 'zero2')."
    )


@pytest.mark.parametrize("strategy", [RayZeroStrategy, RayZeroFabricStrategy])
def test_node_local_storage_is_refused_with_the_reason(strategy: type) -> None:
    with pytest.raises(ValueError) as error:
        strategy(stage=3, node_local_storage=True)
    assert str(error.value) == (
        f"{strategy.__name__}(node_local_storage=True): not needed under Ray Train, whose storage collects the files "
        "every worker reports (each worker saves its own shard). Leave node_local_storage out."
    )


@pytest.mark.parametrize("strategy", [RayZeroStrategy, RayZeroFabricStrategy])
def test_a_timeout_is_refused_naming_rays_own(strategy: type) -> None:
    with pytest.raises(ValueError) as error:
        strategy(stage=2, timeout=timedelta(seconds=60))
    assert str(error.value) == (
        f"{strategy.__name__}(timeout=...): Ray Train creates the process group, so the collectives' timeout is "
        "Ray's: pass TorchTrainer(..., torch_config=ray.train.torch.TorchConfig(timeout_s=...)) and leave timeout out."
    )


@pytest.mark.parametrize("taken", ["cluster_environment", "parallel_devices"])
def test_what_ray_sets_is_refused_for_fabric(taken: str) -> None:
    with pytest.raises(ValueError) as error:
        RayZeroFabricStrategy(stage=2, **{taken: object()})
    assert str(error.value) == f"RayZeroFabricStrategy({taken}=...): Ray Train sets it; leave it out."


def test_a_fabric_node_count_other_than_rays_is_refused() -> None:
    strategy = RayZeroFabricStrategy.__new__(RayZeroFabricStrategy)  # as built in a worker of a 1-node Ray job
    strategy._ray_nodes, strategy.num_nodes = 1, 1
    assert strategy.num_nodes == 1
    strategy.num_nodes = 2  # what Fabric(num_nodes=2) sets
    with pytest.raises(ValueError) as error:
        strategy.num_nodes  # noqa: B018 - the property checks
    assert str(error.value) == (
        "Fabric(num_nodes=2), but Ray Train runs this job on 1 node(s): leave num_nodes out, RayZeroFabricStrategy "
        "takes it from Ray."
    )
