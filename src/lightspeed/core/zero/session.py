"""One ZeRO run, whichever front end drives it (the Trainer's ``ZeroStrategy``, Fabric's ``ZeroFabricStrategy``, a
Ray Train worker): :class:`ZeroSession` holds the DeepSpeed config in force and the compile request, makes the checks
that must fail before any process starts, prepares each process, builds engines, writes checkpoints through a
staging directory (node-local when asked) and does the step bookkeeping that DeepSpeed's ``engine.step()`` would.

The front ends keep only what their framework decides: when each of these runs, and with which of its objects. The
session knows nothing of Lightning; what it logs goes through the ``info`` function the front end gives it (its
rank-zero logger).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from lightspeed.core.common.distributed import global_rank
from lightspeed.core.common.logs import LOG_LEVEL_ENV, logger
from lightspeed.core.common.process import ProcessPlace
from lightspeed.core.reliability.launched_world import check_launched_world, external_launcher
from lightspeed.core.reliability.node_local import describe_position, node_local_path
from lightspeed.core.reliability.staged_saver import StagedCheckpointSaver, each_rank_its_own_path
from lightspeed.core.sequence_parallel import SequenceParallel
from lightspeed.core.zero import third_party_warnings
from lightspeed.core.zero.accumulation import clip_norm_at_step, scale_deepspeed_gradients_at_step
from lightspeed.core.zero.activation_checkpointing import apply_policy
from lightspeed.core.zero.compile import (
    CompileRequest,
    check_compile_supported,
    compile_engine,
    compile_request,
    prepare_zero3_for_compile,
)
from lightspeed.core.zero.config import (
    TrainingFacts,
    describe_config,
    find_hidden_size,
    resolve_config_with_notes,
    summarize_config,
)
from lightspeed.core.zero.config.activation import Policy
from lightspeed.core.zero.config.resolution import (
    UNKNOWN_HIDDEN_SIZE_NOTE,
    fill_sizes_from_the_model,
    sizes_waiting_for_the_model,
)
from lightspeed.core.zero.config.zero_recipe import (
    config_offloads_optimizer,
    config_stage,
    config_uses_nvme,
)
from lightspeed.core.zero.engine import (
    initialize_engine,
    prepare_deepspeed_process,
    prepare_optimizer,
    save_models_checkpoint,
    save_zero_checkpoint,
)
from lightspeed.core.zero.leaf_modules import LeafModules
from lightspeed.core.zero.nvme_swapping import size_nvme_swapping
from lightspeed.core.zero.release import EngineRecord
from lightspeed.core.zero.runtime import (
    check_device_of_local_rank,
    check_precision_supported,
    export_deepspeed_accelerator,
)
from lightspeed.core.zero.unused_parameters import check_unused_parameters_mode

__all__ = ["ZeroConfigProperties", "ZeroSession"]


class ZeroSession:
    """The state and the steps of one ZeRO run that do not depend on the front end.

    Args:
        config: the DeepSpeed config, ``"auto"`` values still in it (:meth:`resolve` fills them in).
        compile: what ``engine.compile()`` is called with (None: the model is not compiled).
        activation_checkpointing_policy: module classes whose forward is checkpointed in training.
        node_local_storage: each node writes its own ranks' checkpoint files into its own directory.
        exclude_frozen_parameters: leave frozen parameters out of checkpoints (``"auto"``: those of a PEFT model).
        front_end: ``"Trainer"`` or ``"Fabric"``, for the messages that name the user's call.
        info: the front end's rank-zero logger.
        leaf_modules: the modules marked as ZeRO-3 leaf modules in every engine's model (default: the
            mixture-of-experts blocks found).
        sequence_parallel_size: ranks that split each sequence (Ulysses attention; 1: off).
        tiled_mlp: run the model's MLP blocks over slices of the sequence (DeepSpeed's ``TiledMLP``).
        tiled_logits_loss: compute the model's training loss over chunks of tokens (True, or the tokens per chunk).
        unused_parameters: ``"skip"`` leaves the parameters no rank used in a step as one process does;
            ``"zero_gradient"`` gives them a zero-gradient step (:mod:`~lightspeed.core.zero.unused_parameters`).
    """

    def __init__(
        self,
        config: dict[str, Any],
        *,
        compile: CompileRequest | None,
        activation_checkpointing_policy: Policy | None,
        node_local_storage: bool,
        exclude_frozen_parameters: bool | str,
        front_end: str,
        info: Callable[[str], None],
        leaf_modules: LeafModules | None = None,
        sequence_parallel_size: int = 1,
        tiled_mlp: bool = False,
        tiled_logits_loss: bool | int = False,
        unused_parameters: str = "skip",
    ) -> None:
        if node_local_storage:
            config.setdefault("checkpoint", {})["use_node_local_storage"] = True
        self.config = config
        self.compile_request = compile
        self.compiled_with: CompileRequest | None = None  # what the last engine was compiled with
        self.activation_checkpointing_policy = activation_checkpointing_policy
        self.leaf_modules = LeafModules() if leaf_modules is None else leaf_modules
        self.sequence_parallel = SequenceParallel(sequence_parallel_size, tiled_mlp, tiled_logits_loss)
        self.unused_parameters = unused_parameters
        if exclude_frozen_parameters != "auto" and not isinstance(exclude_frozen_parameters, bool):
            raise ValueError(
                f"exclude_frozen_parameters must be True, False or 'auto', got {exclude_frozen_parameters!r}"
            )
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self.front_end = front_end
        self.saver = StagedCheckpointSaver()
        self.own_checkpoint_paths = False  # see save_target; the Ray front end sets it
        self._info = info
        self._config_logged = False
        self._sizes_waiting: list[str] = []  # "auto" sizes resolved before the model was built
        self._step_restores: list[Callable[[], None]] = []  # per-step overrides, undone after the next step
        self._pending_norm: torch.Tensor | None = None  # returned by clip_at_step, filled in by the next step
        self._placement: tuple[str, int | None, int] | None = None  # set by start_process

    @classmethod
    def from_arguments(
        cls,
        config: dict[str, Any],
        arguments: Mapping[str, Any],
        owner: str,
        front_end: str,
        info: Callable[[str], None],
    ) -> ZeroSession:
        """The session of a front end built with ``arguments`` (every one of
        :class:`~lightspeed.core.zero.config.arguments.ZeroRunKeywords` by name, from
        :func:`~lightspeed.core.zero.config.arguments.zero_arguments`; the activation-checkpointing policy already
        parsed). ``leaf_modules`` and ``unused_parameters`` are checked here, so a bad one fails when the strategy is
        created; ``owner`` names the strategy class in messages."""
        return cls(
            config,
            compile=compile_request(arguments["compile"], arguments["compile_kwargs"], owner),
            activation_checkpointing_policy=arguments["activation_checkpointing_policy"],
            node_local_storage=arguments["node_local_storage"],
            exclude_frozen_parameters=arguments["exclude_frozen_parameters"],
            front_end=front_end,
            info=info,
            leaf_modules=LeafModules.of(arguments["leaf_modules"]),
            sequence_parallel_size=arguments["sequence_parallel_size"],
            tiled_mlp=arguments["tiled_mlp"],
            tiled_logits_loss=arguments["tiled_logits_loss"],
            unused_parameters=check_unused_parameters_mode(arguments["unused_parameters"], owner),
        )

    @property
    def node_local_storage(self) -> bool:
        """Whether each node keeps its ranks' checkpoint files on its own disk (no shared filesystem)."""
        return bool(self.config.get("checkpoint", {}).get("use_node_local_storage", False))

    # ------------------------------------------------------------------ before any process starts, in each process
    def check_before_launch(self, device_kind: str, precision: str, launch: ProcessPlace) -> None:
        """What must fail before any process starts (precision, compilation, the launched world's layout, its split
        into sequence-parallel groups), and the environment every rank inherits (DeepSpeed's accelerator)."""
        check_precision_supported(device_kind, precision)
        self.sequence_parallel.check_world(launch.num_nodes * launch.num_processes)
        if self.compile_request is not None:
            check_compile_supported(self.compile_request, self.config, device_kind)
        export_deepspeed_accelerator(device_kind)
        launcher = external_launcher(launch.cluster_environment)
        check_launched_world(*launcher, launch.num_nodes, launch.num_processes, front_end=self.front_end)

    def start_process(
        self,
        device_kind: str,
        process: ProcessPlace,
        *,
        process_group: AbstractContextManager[object] | None = None,
        steps: Sequence[Callable[[], object]] = (),
    ) -> None:
        """In each process: where its engines run (the CUDA index of ``process.root_device``; none on the CPU),
        DeepSpeed's accelerator and ops and the filter of known third-party deprecation floods (until
        :meth:`end_process`). A front end's distributed set-up follows, the same on CUDA and on the CPU (Lightning's
        DeepSpeed set-up refuses the CPU): on CUDA this process's device must be the one of its local rank, as
        Lightning requires; ``process_group`` (lightspeed's, created first) is entered and the front end's ``steps``
        run inside it in Lightning's order (seed, world ranks, DeepSpeed adopting the group, ...). A loop without a
        front end passes neither and creates its group itself."""
        self._placement = (device_kind, process.root_device.index, process.local_rank)
        EngineRecord.set_finished(self, False)
        third_party_warnings.install()
        prepare_deepspeed_process(device_kind, config_uses_nvme(self.config))
        if device_kind == "cuda":
            check_device_of_local_rank(process.root_device, process.local_rank)
        with process_group or nullcontext():
            for step in steps:
                step()

    def end_process(self) -> None:
        """Undo :meth:`start_process`'s warning filter and the sequence-parallel attention (the front end's
        teardown); this run's engines may be released when another run builds its own."""
        third_party_warnings.uninstall()
        self.sequence_parallel.remove()
        EngineRecord.set_finished(self, True)

    # ------------------------------------------------------------------ config
    def resolve(self, config: dict[str, Any], facts: TrainingFacts) -> list[str]:
        """Make ``config`` with its ``"auto"`` values resolved from ``facts`` the config in force; returns the notes
        to log (:meth:`log_config`). Under sequence parallelism DeepSpeed's batch arithmetic counts data-parallel
        groups, not ranks."""
        facts = dataclasses.replace(facts, world_size=self.sequence_parallel.data_parallel_size(facts.world_size))
        self._sizes_waiting = sizes_waiting_for_the_model(config) if facts.hidden_size is None else []
        self.config, notes = resolve_config_with_notes(config, facts)
        if self._sizes_waiting:  # derived from the model when its engine is built (build_engine)
            notes = [note for note in notes if not note.startswith(UNKNOWN_HIDDEN_SIZE_NOTE)]
        return notes

    def log_config(self, notes: list[str]) -> None:
        """Log the resolution ``notes`` and the config in force, once per session."""
        if self._config_logged:
            return
        for note in notes:
            self._info(f"lightspeed: {note}")
        self._info(
            f"lightspeed: DeepSpeed config: {summarize_config(self.config)} (the whole config: {LOG_LEVEL_ENV}=DEBUG; "
            "saved as ds_config.json in every checkpoint)"
        )
        if global_rank() == 0:
            logger.debug("resolved DeepSpeed config\n%s", describe_config(self.config))
        self._config_logged = True

    def _fill_sizes_from(self, model: torch.nn.Module, config: dict[str, Any]) -> None:
        """The bucket sizes a config resolved before the model was built (``configure_model``) leaves to DeepSpeed's
        defaults, derived from the built model's hidden size now: DeepSpeed's 5e8-element reduce bucket would hold
        every gradient of a model of a few hundred million parameters at once."""
        zero = config.get("zero_optimization")
        waiting = [name for name in self._sizes_waiting if isinstance(zero, dict) and name not in zero]
        if not waiting:  # nothing left to DeepSpeed's defaults in this config (each engine's config is filled once)
            return
        hidden = find_hidden_size(model)
        if hidden is None:
            self._sizes_waiting = []
            self._info(f"lightspeed: {UNKNOWN_HIDDEN_SIZE_NOTE}{', '.join(waiting)}.")
            return
        filled = fill_sizes_from_the_model(config, waiting, hidden)
        if filled:
            sizes = ", ".join(f"{name}={config['zero_optimization'][name]}" for name in filled)
            self._info(f"lightspeed: from the built model's hidden size {hidden}: {sizes}")

    # ------------------------------------------------------------------ torch.compile
    def take_over_compile(self, request: CompileRequest, device_kind: str | None) -> None:
        """A model compiled with ``torch.compile`` before the run: compiled by ``engine.compile()`` with ``request``
        unless the strategy's own arguments asked for compilation (``device_kind`` None: not known yet)."""
        if self.compile_request is None:
            self.compile_request = request
        if device_kind is not None:
            check_compile_supported(self.compile_request, self.config, device_kind)

    def prepare_compile(self, model: torch.nn.Module, config: dict[str, Any], device_kind: str) -> None:
        """Before an engine is built: refuse what DeepSpeed cannot compile, mark ZeRO-3 leaf modules."""
        if self.compile_request is None:
            return
        check_compile_supported(self.compile_request, config, device_kind)
        marked = prepare_zero3_for_compile(model, config)
        if marked:
            self._info(
                f"lightspeed: ZeRO-3 leaf modules for the compiled forward (all their parameters gathered on entry): "
                f"{', '.join(marked)}"
            )

    def compile(self, engine: Any, request: CompileRequest | None = None) -> None:
        """``engine.compile()`` with ``request`` (default: the session's; nothing when there is none)."""
        request = request or self.compile_request
        if request is None:
            return
        self._info(f"lightspeed: {request.source} runs as DeepSpeed's {request.describe()}")
        compile_engine(engine, request)
        self.compiled_with = request

    # ------------------------------------------------------------------ engines
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> torch.optim.Optimizer:
        """The optimizer the config trains with (DeepSpeed's CPU Adam/Adagrad under optimizer offload)."""
        optimizer, message = prepare_optimizer(optimizer, scheduler, self.config)
        if message is not None:
            self._info(message)
        return optimizer

    def build_engine(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
        *,
        config: dict[str, Any] | None = None,
        training: bool = True,
    ) -> tuple[Any, Any, Any]:
        """``(engine, optimizer, scheduler)`` for ``model`` under ``config`` (default: the config in force), on this
        process's device: the activation checkpointing policy applied first when ``training``, ZeRO-3 leaf modules
        marked, compiled when asked; under sequence parallelism Ulysses attention installed on the model first; NVMe
        swap buffers sized from the model."""
        if self._placement is None:
            raise RuntimeError("ZeroSession.build_engine runs in a process set up by start_process")
        device_kind, device_index, local_rank = self._placement
        self.release_other_runs()
        config = self.config if config is None else config
        if training:
            message = apply_policy(model, self.activation_checkpointing_policy)
            if message is not None:
                self._info(message)
        self.prepare_compile(model, config, device_kind)
        self.sequence_parallel.check_config(config_stage(config), config.get("zero_optimization") or {})
        self._fill_sizes_from(model, config)
        size_nvme_swapping(config, model, torch.distributed.get_world_size())
        mpu = self.sequence_parallel.install(model, compiled=self.compile_request is not None)
        engine, deepspeed_optimizer, deepspeed_scheduler = initialize_engine(
            config,
            model,
            optimizer,
            scheduler,
            device_index,
            local_rank,
            self.leaf_modules,
            mpu=mpu,
            unused_parameters=self.unused_parameters,
        )
        self.compile(engine)
        self.own(engine)
        return engine, deepspeed_optimizer, deepspeed_scheduler

    def release_other_runs(self) -> None:
        """Release the engines of the runs (sessions) that ended in this process, before this one builds its own:
        DeepSpeed never frees them otherwise (:mod:`~lightspeed.core.zero.release`)."""
        EngineRecord.release_finished_but(self)

    def own(self, engine: Any) -> None:
        """Count ``engine`` (built by :meth:`build_engine`, or by a front end's own several-model set-up) as this
        run's: released when another run builds its engines."""
        EngineRecord.add(self, engine)

    def inference_config(self) -> dict[str, Any]:
        """The config of an engine that only runs the forward pass (evaluation without training first): the
        precision and, under ZeRO-3, the partitioning (with its NVMe settings) of the config in force."""
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                config[key] = self.config[key]
        if config_stage(self.config) == 3:
            config["zero_allow_untested_optimizer"] = self.config.get("zero_allow_untested_optimizer", True)
            config["zero_optimization"] = self.config["zero_optimization"]
            if "aio" in self.config:
                config["aio"] = self.config["aio"]
        return config

    # ------------------------------------------------------------------ checkpoints
    def save_target(self, path: str, broadcast: Callable[[Any], Any], *, node_local: bool = True) -> tuple[str, bool]:
        """Where this rank saves a checkpoint and whether every rank saves into a path of its own (a collective).

        Normally rank 0's ``path`` (:meth:`checkpoint_path`; with ``node_local=False`` never a node's own). With
        :attr:`own_checkpoint_paths` (Ray Train, whose workers each report a directory of their own that Ray merges):
        a different path on every rank is kept, each rank writing its own files there; the same path on every rank
        saves as usual; anything else is an error."""
        if self.own_checkpoint_paths and each_rank_its_own_path(path):
            return str(path), True
        if not node_local:
            return str(broadcast(str(path))), False
        return self.checkpoint_path(path, broadcast), False

    def checkpoint_path(self, path: str, broadcast: Callable[[Any], Any]) -> str:
        """Rank 0's ``path`` (a collective, through the front end's ``broadcast``), as this node's own path under
        node-local storage."""
        return self.node_path(str(broadcast(str(path))), broadcast)

    def node_path(self, path: str, broadcast: Callable[[Any], Any]) -> str:
        """Rank 0's ``path`` as this node's own path under node-local storage (a collective there), else ``path``."""
        return node_local_path(path, broadcast(os.getcwd())) if self.node_local_storage else path

    def save(
        self,
        engine: Any,
        path: str,
        client_state: dict[str, Any],
        *,
        process: ProcessPlace,
        progress: dict[str, Any],
    ) -> None:
        """Save ``engine`` and ``client_state`` through DeepSpeed into a staging directory, committed only when every
        rank finished (on node-local storage, this node's part, with its position)."""
        node = describe_position(process.node_rank, process.local_rank) if self.node_local_storage else None
        target, rank_local = self.save_target(path, process.broadcast)
        options = self._save_options(process, progress, rank_local)
        save_zero_checkpoint(self.saver, engine, target, client_state, config=self.config, node=node, **options)

    def save_models(
        self,
        engines: Mapping[str, Any],
        configs: Mapping[str, dict[str, Any]],
        path: str,
        client_state: dict[str, Any],
        *,
        process: ProcessPlace,
        frozen: Sequence[str],
        progress: dict[str, Any],
    ) -> None:
        """Save the trained models' ``engines`` (each with its config) into one checkpoint at rank 0's ``path``, the
        models in ``frozen`` named but not written; shared storage only (node-local saves of several models are refused
        when the models are set up)."""
        target, rank_local = self.save_target(path, process.broadcast, node_local=False)
        options = self._save_options(process, progress, rank_local)
        save_models_checkpoint(self.saver, engines, configs, target, client_state, frozen=frozen, **options)

    def _save_options(self, process: ProcessPlace, progress: dict[str, Any], rank_local: bool) -> dict[str, Any]:
        """What every checkpoint save of this run is told besides its engines and target."""
        return {
            "world_size": process.world_size,
            "exclude_frozen_parameters": self.exclude_frozen_parameters,
            "manifest_extra": progress,
            "rank_local": rank_local,
        }

    # ------------------------------------------------------------------ a step the front end makes itself
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss a front end backpropagates: sequence parallelism's check that it is the model's own, and the
        factor ZeRO-3 needs under it (``loss`` itself otherwise)."""
        return self.sequence_parallel.scale_loss(loss, config_stage(self.config))

    def clip_at_step(self, engine: Any, max_norm: float) -> torch.Tensor:
        """Clip the gradient norm to ``max_norm`` inside ``engine``'s next optimizer step; returns the tensor the
        step fills in with the total norm before clipping (NaN until then)."""
        self._step_restores.append(clip_norm_at_step(engine, max_norm))
        if self._pending_norm is None:
            self._pending_norm = torch.full((), float("nan"))
        return self._pending_norm

    def scale_at_step(self, engine: Any, factor: float) -> None:
        """Multiply the gradients ``engine``'s next optimizer step uses by ``factor`` (before clipping)."""
        self._step_restores.append(scale_deepspeed_gradients_at_step(engine, factor))

    @property
    def step_pending(self) -> bool:
        """True while a per-step override (window factor, clipping) waits for the next optimizer step."""
        return bool(self._step_restores)

    def undo_step_overrides(self) -> None:
        """After the optimizer step (also a failed one): the clipping and scaling asked for it end."""
        restores, self._step_restores = self._step_restores, []
        for restore in reversed(restores):
            restore()

    def count_step(self, engine: Any, optimizer: Any, config_scheduler: Any) -> None:
        """What ``engine.step()`` does and a front end that steps the ZeRO optimizer itself bypasses: the measured
        gradient norm into the engine (``engine.get_global_grad_norm()``) and into the tensor :meth:`clip_at_step`
        returned; the step counted (a skipped one too, on fp16 overflow) with its samples, so checkpoints and a
        resumed engine know it; ``config_scheduler`` (the config's, or None) stepped unless the step was skipped."""
        measured = getattr(optimizer, "_global_grad_norm", None)  # DeepSpeed's ZeRO optimizer's
        pending, self._pending_norm = self._pending_norm, None
        if measured is not None:
            if engine is not None:
                engine._global_grad_norm = float(measured)
            if pending is not None:
                pending.fill_(float(measured))
        if engine is None:
            return
        if getattr(optimizer, "overflow", False):
            engine.skipped_steps += 1
        elif config_scheduler is not None:
            config_scheduler.step()
        engine.global_steps += 1
        engine.global_samples += engine.train_batch_size()


class ZeroConfigProperties:
    """Mixed into a ZeRO front end whose run is ``self._session``; ``config`` is the session's DeepSpeed config
    (``"auto"`` values resolved at set-up), which Lightning's own strategy code reads and sets as ``self.config``."""

    _session: ZeroSession

    @property
    def config(self) -> dict[str, Any]:
        """The DeepSpeed config in force (the session's)."""
        return self._session.config

    @config.setter
    def config(self, config: dict[str, Any]) -> None:
        self._session.config = config

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
        return self._session.node_local_storage

    @property
    def sequence_parallel_size(self) -> int:
        """The ranks that split each sequence (1: no sequence parallelism)."""
        return self._session.sequence_parallel.size

    @property
    def sequence_parallel(self) -> SequenceParallel:
        """The run's sequence parallelism (what evaluation callbacks ask to put per-token slices back together)."""
        return self._session.sequence_parallel

    @property
    def activation_checkpointing_policy(self) -> Policy | None:
        """The module classes whose forward is checkpointed in training (None: none)."""
        return self._session.activation_checkpointing_policy
