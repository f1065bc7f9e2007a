"""What a ZeRO strategy's DeepSpeed config says, as properties: one definition for the Trainer's and Fabric's
strategies, which both keep the config in force in ``self.config``."""

from __future__ import annotations

from typing import Any

from lightspeed.core.zero.config.zero_recipe import config_offloads_optimizer, config_stage, config_uses_nvme

__all__ = ["ZeroConfigProperties"]


class ZeroConfigProperties:
    """Mixed into a ZeRO strategy whose ``config`` is its DeepSpeed config (``"auto"`` values resolved at set-up)."""

    config: dict[str, Any]

    @property
    def stage(self) -> int:
        """The ZeRO stage of the config in force."""
        return config_stage(self.config)

    @property
    def uses_nvme(self) -> bool:
        """Whether anything is offloaded to NVMe."""
        return config_uses_nvme(self.config)

    @property
    def offloads_optimizer(self) -> bool:
        """True when the optimizer step runs on the CPU/NVMe (DeepSpeed's CPU optimizers)."""
        return config_offloads_optimizer(self.config)

    @property
    def resolved_config(self) -> dict[str, Any]:
        """The DeepSpeed config in force (all ``"auto"`` values resolved once the processes are set up)."""
        return self.config

    @property
    def node_local_storage(self) -> bool:
        """Whether each node keeps its ranks' checkpoint files on its own disk (no shared filesystem)."""
        return bool(self.config.get("checkpoint", {}).get("use_node_local_storage", False))
