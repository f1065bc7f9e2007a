"""Checkpoints under the Trainer's ZeRO strategy: saved through the session's staging directory (committed only when
every rank finished, node-local when asked; several models each in their own folder), checked before anything is
loaded (one error on every rank), resharded when written by another number of processes, and for evaluation the
weights of any stage and world size loaded into the (partitioned) model itself, tensor by tensor."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightspeed.core.errors import CheckpointError
from lightspeed.core.zero import load_policy
from lightspeed.core.zero.weights import load_full_state_dict
from lightspeed.strategies.several_models import SeveralModelsMixin

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightspeed.core.zero.session import ZeroSession

__all__ = ["ZeroCheckpointsMixin"]


class ZeroCheckpointsMixin(SeveralModelsMixin):
    """``save_checkpoint``, ``remove_checkpoint`` and loading of :class:`~lightspeed.strategies.ZeroStrategy` (mixed
    in before Lightning's ``DeepSpeedStrategy``, whose loading it calls once the checkpoint is checked)."""

    _session: ZeroSession

    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError("The ZeRO strategy has no LightningModule yet; it is attached by the Trainer.")
        return module

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Any | None = None) -> None:
        """Save through DeepSpeed into a staging directory; commit it only when every rank has finished."""
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by ZeRO strategies: DeepSpeed "
                "writes the checkpoint files itself."
            )
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        progress = {"global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}
        if self.several_models:
            self._session.save_models(
                self.trained_models,
                self.model_configs,
                str(filepath),
                client_state,
                process=self,
                frozen=self.frozen_models,
                progress=progress,
            )
            return
        self._session.save(
            self.deepspeed_engine,
            str(filepath),
            client_state,
            process=self,
            progress=progress,
        )

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Node-local storage: every node's local rank 0 removes its own copy; otherwise Lightning's (rank 0)."""
        if not self._session.node_local_storage:
            super().remove_checkpoint(filepath)
            return
        path = self._session.checkpoint_path(str(filepath), self.broadcast)
        if self.local_rank == 0:
            self.checkpoint_io.remove_checkpoint(path)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # DeepSpeed's engine loaded sharded checkpoints in load_checkpoint; a consolidated file (load_full_weights)
        # goes into the partitioned model tensor by tensor, then into the optimizer's fp32 master copies, which
        # Lightning's own restore leaves stale (the first step would start from the weights before loading)
        if not (self.load_full_weights and self.zero_stage_3):
            return
        self.model_to_device()
        module = self._module()
        load_full_state_dict(
            module,
            dict(checkpoint["state_dict"]),
            rank=self.global_rank,
            optimizer=getattr(self.model, "optimizer", None),
            strict=strict,
            source="the checkpoint",
        )

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        module = self._module()
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        full_weights = self.load_full_weights and self.zero_stage_3
        if self._session.node_local_storage and not fitting:
            raise CheckpointError(
                f"Loading node-local checkpoint {str(path)!r}: evaluating from a node-local checkpoint needs every "
                "node's files in one place. Export it first (`lightspeed export node0/<ckpt> node1/<ckpt> OUT`) and "
                "load the export with `lightspeed.export.load_exported`, or resume training from it."
            )
        if self.several_models:
            return self._load_models_checkpoint(path, fitting)
        load_policy.check_before_loading(
            path,
            module=module if fitting and not self.load_full_weights else None,
            strict=module.strict_loading,
            node_rank=self.node_rank if self._session.node_local_storage else None,
            warn=rank_zero_warn,
        )
        if not fitting and not full_weights:
            return load_policy.load_weights_for_evaluation(
                module, path, rank=self.global_rank, strict=module.strict_loading
            )
        if self.load_full_weights or self._session.node_local_storage:
            return super().load_checkpoint(checkpoint_path, weights_only)
        engine = self.deepspeed_engine
        strict = load_policy.deepspeed_strict(path, module.strict_loading)
        with (
            load_policy.checkpoint_to_load(engine, path, self.world_size, info=rank_zero_info) as load_path,
            _strict_loading(module, strict),
        ):
            return super().load_checkpoint(load_path, weights_only)

    def _load_models_checkpoint(self, path: Path, fitting: bool) -> dict[str, Any]:
        """A several-model checkpoint: every trained model's engine from its own folder (checked first, one error on
        every rank), or for evaluation its weights into the (partitioned) model; returns the Trainer's state."""
        module = self._module()
        models = self._named_models()
        return load_policy.load_models(
            path,
            models,
            {name: self.model_engines[name] for name in models} if fitting else None,
            trained=list(self.trained_models) if fitting else [],
            world_size=self.world_size if fitting else None,  # evaluation reads any world size
            strict=module.strict_loading,
            rank=self.global_rank,
            warn=rank_zero_warn,
        )


@contextmanager
def _strict_loading(module: pl.LightningModule, strict: bool) -> Iterator[None]:
    """``module.strict_loading`` set to ``strict`` while Lightning's ``DeepSpeedStrategy`` hands it to DeepSpeed."""
    before = module.strict_loading
    module.strict_loading = strict
    try:
        yield
    finally:
        module.strict_loading = before
