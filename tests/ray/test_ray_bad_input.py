"""``RayZeroStrategy`` where it cannot work: outside a Ray Train training function, and with node-local storage
(Ray's storage collects every worker's files itself); one clear error each, before anything starts."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.train", reason="needs Ray Train: pip install 'lightspeed[ray]'")

from lightspeed.ray import RayZeroStrategy  # noqa: E402


def test_outside_a_ray_worker_the_error_says_where_to_build_it() -> None:
    with pytest.raises(RuntimeError) as error:
        RayZeroStrategy(stage=2)
    assert str(error.value) == (
        "RayZeroStrategy runs inside a Ray Train training function: build the Trainer in the function you pass to "
        "ray.train.torch.TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=N)) and call "
        "trainer.fit() there. Outside Ray, use lightspeed.strategies.ZeroStrategy (or a strategy name such as "
        "'zero2')."
    )


def test_node_local_storage_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError) as error:
        RayZeroStrategy(stage=3, node_local_storage=True)
    assert str(error.value) == (
        "RayZeroStrategy(node_local_storage=True): not needed under Ray Train, whose storage collects the files every "
        "worker reports (each worker saves its own shard). Leave node_local_storage out."
    )
