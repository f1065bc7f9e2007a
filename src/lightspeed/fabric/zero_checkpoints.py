"""``fabric.save`` and ``fabric.load`` under the Fabric ZeRO strategy: the Trainer strategy's checkpoint layout,
written through the session's staging directory (committed only when every rank finished, node-local when asked),
checked before anything is loaded (one error on every rank), resharded when written by another number of processes,
and a consolidated weights file loaded into the (partitioned) model under ``load_full_weights=True``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies.deepspeed import _get_deepspeed_engines_from_state, _validate_state_keys
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightspeed.core.checkpoint.full_weights import read_full_weights
from lightspeed.core.checkpoint.loading import is_export
from lightspeed.core.zero import load_policy
from lightspeed.core.zero.weights import load_full_state_dict
from lightspeed.fabric.several_models import SeveralModelsMixin

if TYPE_CHECKING:
    from lightspeed.core.zero.session import ZeroSession

__all__ = ["ZeroCheckpointsMixin"]


class ZeroCheckpointsMixin(SeveralModelsMixin):
    """``save_checkpoint``/``load_checkpoint`` of :class:`~lightspeed.fabric.ZeroFabricStrategy` (mixed in before
    Lightning Fabric's ``DeepSpeedStrategy``, whose loading it calls once the checkpoint is checked)."""

    _session: ZeroSession
    load_full_weights: bool

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save through DeepSpeed into a staging directory; commit it only when every rank has finished."""
        if storage_options is not None:
            raise TypeError(
                "`fabric.save(..., storage_options=...)` is not supported by ZeRO strategies: DeepSpeed writes the "
                "checkpoint files itself."
            )
        if filter is not None:
            raise TypeError(
                "`fabric.save(..., filter=...)` is not supported by ZeRO strategies: DeepSpeed saves the whole "
                "(sharded) model and optimizer. Export the weights you need with `lightspeed export` afterwards."
            )
        engines = _get_deepspeed_engines_from_state(state)
        if not engines:
            raise ValueError(
                "`fabric.save` under ZeRO needs the model set up by `fabric.setup` in the state: pass it as e.g. "
                "`fabric.save(path, {'model': model, 'optimizer': optimizer})`."
            )
        if len(engines) > 1:
            self._save_models(self._named_engines(state), path, state)
            return
        engine = engines[0]
        excluded = (engine, engine.optimizer) if engine.optimizer is not None else (engine,)
        client_state = {k: v for k, v in state.items() if not any(v is obj for obj in excluded)}
        _validate_state_keys(client_state)
        client_state = self._convert_stateful_objects_in_state(client_state, filter={})
        self._session.save(
            engine,
            str(path),
            client_state,
            process=self,
            progress={"global_step": int(engine.global_steps)},
        )

    def _load_full_weights(
        self, target: str, state: dict[str, Any] | None, strict: bool, weights_only: bool | None
    ) -> dict[str, Any]:
        """``load_full_weights=True``: a consolidated file (``fabric.save`` of a plain strategy, ``torch.save`` of a
        state dict, a Lightning checkpoint, or lightspeed's safetensors export) into the (partitioned) model, tensor
        by tensor, then into the optimizer's fp32 master copies; the rest of ``state`` as Lightning restores it."""
        engines = _get_deepspeed_engines_from_state(state) if state else []
        if state is None or len(engines) != 1:
            raise ValueError(
                "`fabric.load` with `load_full_weights=True` needs exactly one model set up by `fabric.setup` in the "
                f"state, found {len(engines)}: pass it as e.g. `fabric.load(path, {{'model': model}})`."
            )
        engine = engines[0]
        model_key = next(name for name, value in state.items() if value is engine)
        weights, checkpoint = read_full_weights(
            target, model_key, lambda path: self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        )
        # as Fabric's own load: with strict, every other entry of `state` must be in the file (named if not)
        others = [name for name, value in state.items() if value is not engine and not isinstance(value, Optimizer)]
        _validate_keys_for_strict_loading(others, checkpoint, strict)
        missing, unexpected = load_full_state_dict(
            engine.module,
            weights,
            rank=self.global_rank,
            optimizer=engine.optimizer,
            strict=strict,
            source=f"checkpoint {target!r}",
        )
        if missing or unexpected:
            rank_zero_warn(
                f"lightspeed: `fabric.load(..., strict=False)` loaded {target!r} into the model without "
                f"{len(missing)} tensor(s) the file lacks ({', '.join(missing) or 'none'}) and skipped "
                f"{len(unexpected)} the model lacks ({', '.join(unexpected) or 'none'})."
            )
        for name, value in list(state.items()):
            if value is engine or name not in checkpoint or isinstance(value, (Module, Optimizer)):
                continue
            state[name] = checkpoint.pop(name)
        return checkpoint

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Check the checkpoint first (one error on every rank before anything is loaded), then load it through
        DeepSpeed; one written by another number of processes is resharded on the way."""
        if isinstance(state, (Module, Optimizer)):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        target = self.broadcast(str(path))
        if self.load_full_weights and (is_export(target) or Path(target).is_file()):
            return self._load_full_weights(target, state, strict, weights_only)
        target = self._session.node_path(target, self.broadcast)
        engines = _get_deepspeed_engines_from_state(state) if state else []
        if len(engines) > 1 and state is not None:
            return self._load_models(self._named_engines(state), self._several_models_target(path), state, strict)
        engine = engines[0] if len(engines) == 1 else None
        load_policy.check_before_loading(
            target,
            module=engine.module if engine is not None else None,  # node-local parts are checked, not their shapes
            strict=strict,
            node_rank=self.node_rank if self._session.node_local_storage else None,
            warn=rank_zero_warn,
        )
        if engine is None or self._session.node_local_storage:
            return super().load_checkpoint(target, state, strict=strict, weights_only=weights_only)
        strict = load_policy.deepspeed_strict(target, strict)  # checked above; frozen parameters left out pass
        with load_policy.checkpoint_to_load(engine, target, self.world_size, info=rank_zero_info) as load_path:
            return super().load_checkpoint(load_path, state, strict=strict, weights_only=weights_only)
