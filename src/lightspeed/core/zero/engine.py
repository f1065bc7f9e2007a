"""The ZeRO strategy steps that do not depend on which Lightning loop drives them (the Trainer's
:class:`~lightspeed.strategies.ZeroStrategy` or Fabric's :class:`~lightspeed.fabric.ZeroFabricStrategy`).

* :func:`prepare_deepspeed_process`: DeepSpeed's accelerator and the NVMe check, in every rank before the group;
* :func:`prepare_optimizer`: the optimizer an offloading config runs (CPU Adam/Adagrad), its scheduler retargeted;
* :func:`initialize_engine`: ``deepspeed.initialize`` with the device rank that also works on the CPU, a ZeRO-3
  model's mixture-of-experts blocks marked as leaf modules first (:mod:`lightspeed.core.zero.leaf_modules`);
* :func:`save_zero_checkpoint` / :func:`check_loadable`: the checkpoint directory layout every lightspeed reader
  (resume, ``lightspeed export``) understands, staged and committed only when all ranks finished;
* :func:`one_optimizer_error`: the message for a second optimizer.

No Lightning here; DeepSpeed is imported only inside the functions that need it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightspeed.core.common.allocator import return_freed_memory_promptly
from lightspeed.core.common.distributed import is_distributed
from lightspeed.core.errors import DeepSpeedConfigError, ExportError
from lightspeed.core.peft.detect import check_adapter_targets, resolve_frozen_exclusion
from lightspeed.core.peft.layout import ADAPTERS_KEY, adapter_layouts
from lightspeed.core.reliability import staging as atomic_dir
from lightspeed.core.reliability.node_local import NodePosition
from lightspeed.core.reliability.staged_saver import StagedCheckpointSaver
from lightspeed.core.reliability.staging import MODELS_MANIFEST_KEY
from lightspeed.core.zero.config import config_offloads_optimizer, config_stage, describe_config
from lightspeed.core.zero.cpu_adam_steps import replay_cpu_adam_steps_after_loads
from lightspeed.core.zero.cpu_optimizer import prepare_offloaded_optimizer, retarget_lr_scheduler
from lightspeed.core.zero.frozen_fingerprint import FINGERPRINT_KEY, frozen_fingerprint
from lightspeed.core.zero.leaf_modules import LeafModules
from lightspeed.core.zero.nvme_checkpoints import install_nvme_checkpoints
from lightspeed.core.zero.nvme_space import check_nvme_space
from lightspeed.core.zero.nvme_swapping import lightspeed_parameter_swapper
from lightspeed.core.zero.parameter_checks import check_shape_split_groups
from lightspeed.core.zero.runtime import (
    async_io_problem,
    clear_stale_build_locks,
    deepspeed_device_rank,
    use_deepspeed_accelerator,
)
from lightspeed.core.zero.stale_gradients import clear_stale_gradients
from lightspeed.core.zero.state_dtypes import keep_saved_state_dtypes
from lightspeed.core.zero.swapped_gradients import gradient_partition_allocated_untouched, release_swapped_gradients
from lightspeed.core.zero.unused_parameters import leave_unused_parameters

__all__ = [
    "CHECKPOINT_TAG",
    "FROZEN_EXCLUDED_KEY",
    "RESOLVED_CONFIG_FILENAME",
    "check_loadable",
    "initialize_engine",
    "one_optimizer_error",
    "prepare_deepspeed_process",
    "prepare_optimizer",
    "save_models_checkpoint",
    "save_zero_checkpoint",
]

#: file written next to DeepSpeed's files in every checkpoint directory
RESOLVED_CONFIG_FILENAME = "ds_config.json"
#: DeepSpeed's tag directory inside every checkpoint directory (Lightning's choice, kept for its readers)
CHECKPOINT_TAG = "checkpoint"
#: the manifest's record that the save left frozen parameters out (resuming takes them from the model as built)
FROZEN_EXCLUDED_KEY = "frozen_parameters_excluded"


def prepare_deepspeed_process(kind: str, uses_nvme: bool) -> None:
    """Make DeepSpeed use accelerator ``kind`` (``"cpu"``/``"cuda"``) in this rank, clear build locks that a killed
    op build left, and refuse NVMe offload where DeepSpeed's async I/O op cannot run, before the process group or any
    engine exists; under NVMe offload, freed host memory goes back to the operating system at once."""
    use_deepspeed_accelerator(kind)
    clear_stale_build_locks()  # a build killed half-way would make the op's next load wait forever
    if uses_nvme:
        problem = async_io_problem()
        if problem is not None:
            raise DeepSpeedConfigError(f"NVMe offload cannot run here: {problem}")
        return_freed_memory_promptly()  # NVMe offload is chosen to need less host memory (core/common/allocator.py)


def one_optimizer_error(got: str, where: str, several_models: str) -> DeepSpeedConfigError:
    """The error for anything but one optimizer for one engine: ``got`` what was passed (``"2 optimizers"``)
    ``where`` (e.g. ``"`configure_optimizers` returned"``); ``several_models``: how the front end gives several
    models (a GAN's generator and discriminator) an engine and an optimizer each."""
    return DeepSpeedConfigError(
        f"ZeRO strategies train one optimizer per model, but {where} {got}. For one model, use one optimizer with "
        f"several param groups (each group can have its own lr and weight_decay). For several models each with its "
        f"own optimizer (a GAN's generator and discriminator), {several_models}."
    )


def prepare_optimizer(
    optimizer: torch.optim.Optimizer, lr_scheduler: Any, config: dict[str, Any]
) -> tuple[torch.optim.Optimizer, str | None]:
    """The optimizer ``config`` trains with: under optimizer offload a torch Adam/AdamW/Adagrad becomes DeepSpeed's
    CPU version (``lr_scheduler``, a torch scheduler or None, is moved onto it); returns it and a log line or None.
    ``config`` may gain ``zero_force_ds_cpu_optimizer`` (see :func:`prepare_offloaded_optimizer`)."""
    if not config_offloads_optimizer(config):
        return optimizer, None
    converted, message = prepare_offloaded_optimizer(optimizer, config)
    if converted is not optimizer and lr_scheduler is not None:
        retarget_lr_scheduler(lr_scheduler, converted)
    return converted, message


def initialize_engine(
    config: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any,
    device_index: int | None,
    local_rank: int,
    leaf_modules: LeafModules | None = None,
    mpu: Any = None,
    unused_parameters: str = "skip",
) -> tuple[Any, Any, Any]:
    """``deepspeed.initialize`` on an existing process group; returns ``(engine, optimizer, lr_scheduler)``. Without
    a client ``optimizer`` DeepSpeed builds the one (and the scheduler) the config's sections describe, if any.

    ``device_index`` is the root device's CUDA index (None on the CPU, where the local rank is used). Under ZeRO-3 the
    ``leaf_modules`` (the strategy's argument; None: the mixture-of-experts blocks found) are marked first: DeepSpeed
    reads the flag while it hooks the model, and without it ranks routing to different experts fall out of step.
    ``mpu``: DeepSpeed's sequence-parallel groups (None without sequence parallelism). ``unused_parameters``: what a
    step does to the parameters no rank used (:mod:`~lightspeed.core.zero.unused_parameters`)."""
    import deepspeed

    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer is not None:
        own = set(map(id, model.parameters()))
        foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in own)
        if foreign:
            raise DeepSpeedConfigError(
                f"The optimizer given with {type(model).__name__} trains {foreign} parameter(s) that are not the "
                "model's: build the optimizer from this model's parameters (`torch.optim.AdamW(model.parameters())`)."
            )
        check_shape_split_groups(optimizer, model)
    check_adapter_targets(model)
    world_size = torch.distributed.get_world_size() if is_distributed() else 1
    check_nvme_space(model, config, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    (LeafModules() if leaf_modules is None else leaf_modules).mark(model, config)
    # the parameters an optimizer trains: the client's, or the one the config's "optimizer" section describes
    trains = optimizer is not None or isinstance(config.get("optimizer"), dict)
    with (
        lightspeed_parameter_swapper(config),  # a model built outside zero.Init is partitioned here
        gradient_partition_allocated_untouched(config),
    ):
        engine, deepspeed_optimizer, _, scheduler = deepspeed.initialize(
            args=argparse.Namespace(device_rank=deepspeed_device_rank(device_index, local_rank)),
            config=config,
            model=model,
            model_parameters=trainable if trains else [],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            mpu=mpu,
            dist_init_required=False,
        )
    if trains and config_stage(config) != 3:
        run_alone_while_switched_off(engine)
    if trains:
        clear_stale_gradients(deepspeed_optimizer)
        release_swapped_gradients(deepspeed_optimizer)
        install_nvme_checkpoints(engine)
        inner = getattr(deepspeed_optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):  # DeepSpeed's ZeRO optimizers wrap the one that steps
            keep_saved_state_dtypes(inner)
            replay_cpu_adam_steps_after_loads(engine, inner)
        leave_unused_parameters(engine, deepspeed_optimizer, model, unused_parameters)
    return engine, deepspeed_optimizer, scheduler


def run_alone_while_switched_off(engine: Any) -> None:
    """Make ``engine(...)`` call its module directly while every parameter of the module is switched off.

    DeepSpeed's engine forward prepares the backward of what it returns for the engine's own parameters (ZeRO's
    backward prologue and epilogue). With all of them switched off (``toggle_optimizer`` of another model: a GAN's
    generator loss through the discriminator), the loss trains none of them, and ZeRO-1/2's epilogue would reduce an
    empty bucket when the loss flows back through the engine (an ``IndexError`` inside DeepSpeed). A ZeRO-3 engine
    keeps its forward, which gathers the partitioned weights (and handles an empty epilogue)."""
    engine_forward = engine.forward
    module = engine.module

    def forward(*inputs: Any, **kwargs: Any) -> Any:
        if any(parameter.requires_grad for parameter in module.parameters()):
            return engine_forward(*inputs, **kwargs)
        return module(*inputs, **kwargs)

    engine.forward = forward


def save_zero_checkpoint(
    saver: StagedCheckpointSaver,
    engine: Any,
    target: str | os.PathLike[str],
    client_state: dict[str, Any],
    *,
    world_size: int,
    config: dict[str, Any],
    exclude_frozen_parameters: bool | str = False,
    manifest_extra: dict[str, Any] | None = None,
    node: NodePosition | None = None,
    rank_local: bool = False,
) -> Path:
    """Write ``engine``'s (sharded) state plus ``client_state`` into ``target`` through a staging directory that is
    committed (completion marker, resolved config beside it) only once every rank wrote its files. A collective:
    every rank calls it with the same ``target``. With ``node`` (node-local storage) every node commits its own
    ``target`` (see :class:`StagedCheckpointSaver`); with ``rank_local`` every rank its own ``target``, which merged
    make one checkpoint."""

    exclude = resolve_frozen_exclusion(exclude_frozen_parameters, engine.module)
    client_state = _with_checkpoint_extras(client_state, engine, exclude)

    def write(staging: Path) -> None:
        _engine_save(engine, staging, client_state, exclude)

    layout = {"zero_stage": config_stage(config), FROZEN_EXCLUDED_KEY: exclude}
    manifest = _manifest(world_size, layout, manifest_extra)
    extra_files = {RESOLVED_CONFIG_FILENAME: describe_config(config)}
    if node is not None:
        extra_files["latest"] = CHECKPOINT_TAG  # DeepSpeed writes it on rank 0's node only; every node resumes
    return saver.save(target, write, manifest=manifest, extra_files=extra_files, node=node, rank_local=rank_local)


def save_models_checkpoint(
    saver: StagedCheckpointSaver,
    engines: Mapping[str, Any],
    configs: Mapping[str, dict[str, Any]],
    target: str | os.PathLike[str],
    client_state: dict[str, Any],
    *,
    world_size: int,
    frozen: Sequence[str] = (),
    exclude_frozen_parameters: bool | str = False,
    manifest_extra: dict[str, Any] | None = None,
    rank_local: bool = False,
) -> Path:
    """Several trained models' engines into one committed checkpoint: each model's DeepSpeed save directory under
    ``target/<name>`` (the client state in the first one), the manifest listing them, so that resuming, exporting
    and ``lightspeed export`` find every model; models in ``frozen`` are not trained and not written. A collective."""
    names = list(engines)
    exclude = any(resolve_frozen_exclusion(exclude_frozen_parameters, engines[name].module) for name in names)
    states = [
        _with_checkpoint_extras(client_state if index == 0 else {}, engines[name], exclude)
        for index, name in enumerate(names)
    ]

    def write(staging: Path) -> None:
        for name, state in zip(names, states, strict=True):
            _engine_save(engines[name], staging / name, state, exclude)

    models = {name: {"zero_stage": config_stage(configs[name])} for name in names}
    layout = {MODELS_MANIFEST_KEY: models, "frozen_models": list(frozen), FROZEN_EXCLUDED_KEY: exclude}
    manifest = _manifest(world_size, layout, manifest_extra)
    extra_files = {f"{name}/{RESOLVED_CONFIG_FILENAME}": describe_config(configs[name]) for name in names}
    return saver.save(target, write, manifest=manifest, extra_files=extra_files, rank_local=rank_local)


def _with_checkpoint_extras(client_state: dict[str, Any], engine: Any, exclude: bool) -> dict[str, Any]:
    """``client_state`` plus, when the save leaves frozen parameters out, their fingerprint (checked on resume), and
    the adapter layouts of a PEFT model (so that ``lightspeed export`` writes PEFT's layout from the files)."""
    extras: dict[str, Any] = {}
    if exclude:
        extras[FINGERPRINT_KEY] = frozen_fingerprint(engine.module)
    try:
        layouts = adapter_layouts(engine.module)
    except ExportError:  # several PEFT models, an adapter type not held in weights: exported whole
        layouts = []
    if layouts:
        extras[ADAPTERS_KEY] = [layout.to_state() for layout in layouts]
    return {**client_state, **extras}


def _manifest(world_size: int, layout: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    """The completion marker's record of a lightspeed ZeRO checkpoint: writer, world size, tag, the ``layout``
    (one model's stage, or several models'), then the caller's ``extra`` (step, epoch)."""
    return {"writer": "lightspeed", "world_size": world_size, **layout, "tag": CHECKPOINT_TAG, **(extra or {})}


def _engine_save(engine: Any, directory: Path, client_state: dict[str, Any], exclude_frozen_parameters: bool) -> None:
    """``engine.save_checkpoint`` into ``directory`` under lightspeed's tag."""
    try:
        engine.save_checkpoint(
            str(directory),
            client_state=client_state,
            tag=CHECKPOINT_TAG,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
    except Exception as err:
        # A write error on one rank (a full disk; something in the client state that cannot be pickled, which only
        # rank 0 writes) happens after DeepSpeed's last collective but before its final barrier, where the other
        # ranks now wait: meet them there, so every rank reaches the saver's agreement (which raises the error on
        # every rank) instead of waiting until the process-group timeout. A failed collective (a dead peer) is not met.
        import torch.distributed as dist

        if is_distributed() and not isinstance(err, dist.DistError):
            dist.barrier()
        raise


def check_loadable(path: str | os.PathLike[str]) -> str | None:
    """Raise when ``path`` is not a checkpoint that can be resumed (missing, interrupted save); return a warning
    for a plain DeepSpeed checkpoint directory without lightspeed's completion marker, else None."""
    path = Path(path)
    if not path.exists():
        atomic_dir.require_complete(path)  # explains a save interrupted mid-swap, or that nothing is there
    if path.is_dir() and not atomic_dir.is_complete(path):
        if atomic_dir.staging_path(path).exists() or not (path / "latest").is_file():
            atomic_dir.require_complete(path)  # raises with the explanation
        return (
            f"Checkpoint {str(path)!r} was not written by lightspeed (no completion marker); loading it as a plain "
            "DeepSpeed checkpoint."
        )
    return None
