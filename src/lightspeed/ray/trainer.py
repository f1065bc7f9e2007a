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

from ray.train.lightning import RayDeepSpeedStrategy
from typing_extensions import Unpack

from lightspeed.ray.worker import refuse_what_ray_decides, require_ray_worker
from lightspeed.strategies.zero import ZeroStrategy
from lightspeed.strategies.zero_keywords import TrainerZeroKeywords

__all__ = ["RayZeroStrategy"]


class RayZeroStrategy(ZeroStrategy, RayDeepSpeedStrategy):  # type: ignore[misc]
    """lightspeed's ZeRO strategy inside ``ray.train.torch.TorchTrainer``; takes every
    :class:`~lightspeed.strategies.ZeroStrategy` argument except ``node_local_storage`` (Ray's storage collects
    each worker's files itself) and ``timeout`` (Ray's ``TorchConfig(timeout_s=)``).

    Build it in the training function, with Ray's ``RayLightningEnvironment`` and ``RayTrainReportCallback``, and pass
    the Trainer through ``ray.train.lightning.prepare_trainer``."""

    def __init__(self, **kwargs: Unpack[TrainerZeroKeywords]) -> None:
        refuse_what_ray_decides(type(self).__name__, kwargs)
        require_ray_worker(type(self).__name__)
        super().__init__(**kwargs)
        self._session.own_checkpoint_paths = True
