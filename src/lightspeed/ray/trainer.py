"""``RayZeroStrategy``: :class:`~lightspeed.strategies.ZeroStrategy` for a Trainer inside a Ray Train worker.

``ray.train.lightning.prepare_trainer`` accepts only Ray's own strategies, so this is a ``RayDeepSpeedStrategy`` as
well (Ray's device and sampler placement, beneath lightspeed's own). What changes against the plain strategy:

* it must run inside a Ray Train training function (the process group and the ranks come from Ray);
* checkpoints: each worker saves into the directory it reports (``RayTrainReportCallback`` gives every worker its
  own), and Ray merges the reported directories into one checkpoint in its storage. So every rank writes its own ZeRO
  shard into its own directory (rank 0 also the model states and the completion marker listing every rank's files),
  and the merged checkpoint is complete also when the workers share no filesystem. The same path on every rank (a
  shared ``ModelCheckpoint`` directory) saves as the plain strategy does.
"""

from __future__ import annotations

from typing import Any

import ray.train
from ray.train.lightning import RayDeepSpeedStrategy

from lightspeed.strategies.zero import ZeroStrategy

__all__ = ["RayZeroStrategy"]


class RayZeroStrategy(ZeroStrategy, RayDeepSpeedStrategy):  # type: ignore[misc]
    """lightspeed's ZeRO strategy inside ``ray.train.torch.TorchTrainer``; takes every
    :class:`~lightspeed.strategies.ZeroStrategy` argument except ``node_local_storage`` (Ray's storage collects
    each worker's files itself).

    Build it in the training function, with Ray's ``RayLightningEnvironment`` and ``RayTrainReportCallback``, and pass
    the Trainer through ``ray.train.lightning.prepare_trainer``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("node_local_storage"):
            raise ValueError(
                "RayZeroStrategy(node_local_storage=True): not needed under Ray Train, whose storage collects the "
                "files every worker reports (each worker saves its own shard). Leave node_local_storage out."
            )
        _require_ray_worker()
        super().__init__(*args, **kwargs)
        self._session.own_checkpoint_paths = True


def _require_ray_worker() -> None:
    """Raise a ``RuntimeError`` saying what to do outside a Ray Train training function."""
    try:
        ray.train.get_context().get_world_size()
    except RuntimeError as outside:
        raise RuntimeError(
            "RayZeroStrategy runs inside a Ray Train training function: build the Trainer in the function you pass to "
            "ray.train.torch.TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=N)) and call "
            "trainer.fit() there. Outside Ray, use lightspeed.strategies.ZeroStrategy (or a strategy name such as "
            "'zero2')."
        ) from outside
