"""The keyword arguments of the ZeRO strategies, declared once for every front end (the Trainer's, Fabric's, Ray's).

Each front end's ``__init__`` takes its own few arguments by name and the rest as ``**arguments:
Unpack[ZeroKeywords]`` (PEP 692): IDEs complete them, type checkers check them and Lightning's ``LightningCLI``
(jsonargparse) reads them, with their documentation, from the typed dicts below. :data:`ZERO_DEFAULTS` holds their
defaults (the tuning knobs' are :class:`~lightspeed.core.zero.config.zero_recipe.ZeroTuning`'s) and
:func:`zero_arguments` checks what a front end was given and fills in the rest, so that a setting means the same under
every front end.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.constants import default_pg_timeout
from typing_extensions import TypedDict

from lightspeed.core.zero.config.choices import AUTO
from lightspeed.core.zero.config.keywords import refuse_unknown_keywords
from lightspeed.core.zero.config.model_recipe import ModelRecipe
from lightspeed.core.zero.config.zero_recipe import ZeroTuning

__all__ = ["ZERO_DEFAULTS", "ZeroKeywords", "ZeroRunKeywords", "keyword_names", "strategy_arguments", "zero_arguments"]


class ZeroRunKeywords(TypedDict, total=False):
    """The ZeRO strategies' arguments beyond the stage, offload targets, NVMe directory and config (which ``zero_auto``
    chooses or takes itself); every one may be left out (its default in brackets).

    Attributes:
        pin_memory: page-lock offloaded CPU buffers (faster host-device copies on CUDA; no effect on CPU) [True].
        reduce_bucket_size: elements per gradient reduce bucket; ``"auto"``: h² (h: the model's
            ``config.hidden_size``, else its widest ``nn.Linear``; DeepSpeed's default when there is neither)
            ["auto"].
        allgather_bucket_size: elements per all-gather bucket, stages 1-2 only; ``"auto"``: DeepSpeed's default
            ["auto"].
        prefetch_bucket_size: elements of parameters ZeRO-3 fetches ahead; ``"auto"``: 0.9·h² ["auto"].
        param_persistence_threshold: ZeRO-3 keeps parameters with at most this many elements whole on every rank;
            ``"auto"``: 10·h; ``0`` partitions every parameter, however small ["auto"].
        sub_group_size: ZeRO-3 optimizer sub-group size (elements); None: DeepSpeed's default (one parameter per
            sub-group with the optimizer on NVMe) [None].
        activation_checkpointing_policy: module classes (a set, e.g. ``{Block}``) whose instances' forward runs under
            ``deepspeed.checkpointing.checkpoint`` in training: only their inputs are kept for the backward pass,
            which runs their forward again. Applied before the engine is built; the model's code stays as it is
            [None].
        partition_activations: DeepSpeed's ``activation_checkpointing`` section (this argument and the next five),
            for the policy and for ``deepspeed.checkpointing.checkpoint`` calls in the model; the section is written
            only when the policy or one of these asks for it (or ``config=`` has it). ``"auto"``: off (it splits
            checkpoints across model-parallel ranks; there is no model parallelism to partition across) ["auto"].
        cpu_checkpointing: keep the checkpointed activations in host memory; ``"auto"``: on when parameters are
            offloaded and the device is CUDA ["auto"].
        contiguous_memory_optimization: copy checkpoints into one contiguous buffer (needs ``partition_activations``
            and ``number_checkpoints``); ``"auto"``: off ["auto"].
        number_checkpoints: the checkpointed blocks in one forward pass (for ``contiguous_memory_optimization``)
            [None].
        synchronize_checkpoint_boundary: synchronize the device at each checkpoint boundary (CUDA) [False].
        profile: DeepSpeed's timing of the checkpointed forward and backward passes [False].
        bf16_master_weights_and_grads: keep the master weights and their gradients in bf16 instead of fp32
            (DeepSpeed's low-memory states; needs precision="bf16-mixed" or "bf16-true"): 4 bytes less per trained
            parameter, at a cost in accuracy measured in ``bench/low_memory_states.py`` [False].
        bf16_optimizer_states: also keep the optimizer moments in bf16 (needs ``bf16_master_weights_and_grads``):
            another 4 bytes less per trained parameter with Adam [False].
        accelerator: the accelerator; the Trainer and Fabric set it from their ``accelerator=`` [None].
        parallel_devices: the devices of this node; the Trainer and Fabric set them from their ``devices=`` [None].
        cluster_environment: Lightning's cluster environment (torchrun, SLURM, ...), set by the Trainer and Fabric
            [None].
        process_group_backend: ``"nccl"`` or ``"gloo"``; ``None``: ``"nccl"`` on CUDA, ``"gloo"`` on the CPU [None].
        timeout: how long a collective may wait for the other ranks before a ``CollectiveTimeoutError`` names the
            collective and the rank that stopped answering [30 minutes].
        logging_level: the level of DeepSpeed's logger [logging.WARN].
        exclude_frozen_parameters: leave parameters with ``requires_grad=False`` out of checkpoints. ``"auto"``: when
            the model holds a PEFT model (``peft.get_peft_model``), whose frozen base comes back from the pretrained
            files; the save records a fingerprint of them, and resuming with other frozen weights is an error
            ["auto"].
        load_full_weights: the checkpoint to load (``ckpt_path=`` of the Trainer, ``fabric.load``'s path) may be a
            consolidated single-file checkpoint (written without ZeRO): its weights go into the partitioned model and
            the optimizer's fp32 master copies; optimizer states start fresh [False].
        node_local_storage: for clusters whose nodes share no filesystem: each node writes its own ranks' shards (and
            the files every node needs) into its own local checkpoint directory; a checkpoint counts as complete once
            every node committed its part (same as ``config={"checkpoint": {"use_node_local_storage": True}}``)
            [False].
        compile: compile the model with DeepSpeed's ``engine.compile()`` (``torch.compile`` of the module the engine
            wraps). A model compiled with ``torch.compile`` before ``fit`` or ``fabric.setup`` is compiled the same
            way, with its backend, mode and options [False].
        compile_kwargs: ``torch.compile`` arguments for ``engine.compile()`` (``backend``, ``mode``, ``options``,
            ``fullgraph``, ``dynamic``, ...); given alone, it asks for compilation too [None].
        leaf_modules: the modules whose parameters ZeRO-3 gathers whole when they are called (DeepSpeed's leaf
            modules), marked before the engine is built. ``"auto"``: the model's mixture-of-experts blocks (a module
            with an ``nn.ModuleList`` child named ``experts``, as HuggingFace's Mixtral, Qwen-MoE and DeepSeek blocks
            have), so ranks whose tokens reach different experts stay in step. Otherwise the modules to mark instead:
            module classes, class names or the ends of module names (``{MoeBlock}``, ``["Qwen3MoeSparseMoeBlock"]``,
            ``["mlp"]``); each must name a module of the model. ``None``: none. ZeRO-3 only ["auto"].
        sequence_parallel_size: split every sequence over groups of this many ranks (DeepSpeed's Ulysses attention,
            for a HuggingFace causal LM built with ``attn_implementation="sdpa"`` or flash attention): the ranks of a
            group read the same rows, each trains on its slice of their sequences (padded on the right to a
            multiple of the size, labels shifted over the whole sequence), and the model's loss is the token mean of
            the whole micro-batch on every rank. The model is called as ``model(**batch)`` with the slice. 1: off.
            See ``docs/long_context.md`` [1].
        tiled_mlp: run the MLP blocks of the HuggingFace causal LM over slices of the sequence (DeepSpeed's
            ``TiledMLP``, ``ceil(sequence / hidden size)`` slices): their intermediate activations exist for one slice
            at a time, at the cost of one more MLP forward in the backward pass. With or without sequence
            parallelism [False].
        tiled_logits_loss: compute the HuggingFace causal LM's training loss over chunks of tokens, so that the
            whole ``[tokens, vocabulary]`` logits never exist (each chunk's are made again in the backward pass):
            True (about 1 GiB of float32 logits per chunk) or the tokens per chunk. The model's output then has no
            logits when it is called with labels in training. With or without sequence parallelism [False].
        unused_parameters: what an optimizer step does to the parameters no rank used in it (a layer some steps
            skip, a head the step did not choose, experts no token reached). ``"skip"``: as in one process, their
            weights and optimizer state stay as they were, and under Adam each parameter keeps its own step count
            (saved in checkpoints); exact for SGD without dampening, RMSprop, Adagrad without ``lr_decay``, Adadelta,
            Adam and AdamW; another optimizer raises at the first step that leaves a parameter unused.
            ``"zero_gradient"``: they take a step on a zero gradient (momentum, weight decay and Adam's moments move
            them), at no cost. See ``docs/zero.md`` ["skip"].
    """

    pin_memory: bool
    reduce_bucket_size: int | str
    allgather_bucket_size: int | str
    prefetch_bucket_size: int | str
    param_persistence_threshold: int | str
    sub_group_size: int | None
    activation_checkpointing_policy: Collection[type[torch.nn.Module]] | type[torch.nn.Module] | None
    partition_activations: bool | str
    cpu_checkpointing: bool | str
    contiguous_memory_optimization: bool | str
    number_checkpoints: int | None
    synchronize_checkpoint_boundary: bool
    profile: bool
    bf16_master_weights_and_grads: bool
    bf16_optimizer_states: bool
    accelerator: Any
    parallel_devices: list[torch.device] | None
    cluster_environment: Any
    process_group_backend: str | None
    timeout: timedelta | None
    logging_level: int
    exclude_frozen_parameters: bool | str
    load_full_weights: bool
    node_local_storage: bool
    compile: bool
    compile_kwargs: dict[str, Any] | None
    leaf_modules: Collection[type[torch.nn.Module] | str] | type[torch.nn.Module] | str | None
    sequence_parallel_size: int
    tiled_mlp: bool
    tiled_logits_loss: bool | int
    unused_parameters: str


class _PlacementKeywords(TypedDict, total=False):
    stage: int
    offload_optimizer: str | bool | None
    offload_parameters: str | bool | None
    nvme_path: str | os.PathLike[str] | None
    config: str | os.PathLike[str] | dict[str, Any] | None


class ZeroKeywords(_PlacementKeywords, ZeroRunKeywords, total=False):
    """Every argument of a ZeRO strategy: where the states live, then :class:`ZeroRunKeywords`; every one may be left
    out (its default in brackets).

    Attributes:
        stage: ZeRO stage 0-3 (0: plain data parallel through DeepSpeed) [2].
        offload_optimizer: ``"none"``, ``"cpu"`` or ``"nvme"`` (``True`` means ``"cpu"``): where optimizer states live
            and the optimizer step runs ["none"].
        offload_parameters: ``"none"``, ``"cpu"`` or ``"nvme"``; stage 3 only ["none"].
        nvme_path: directory for NVMe offload; None: ``$LIGHTSPEED_NVME_PATH`` [None].
        config: DeepSpeed config dict or JSON path merged over the preset (its values win). ``"auto"`` is allowed
            wherever HF-style configs use it. Unknown keys and values that contradict the Trainer's or Fabric's
            settings are errors [None].
    """


#: every :class:`ZeroKeywords` argument's default
ZERO_DEFAULTS: Mapping[str, Any] = {
    "stage": 2,
    "offload_optimizer": "none",
    "offload_parameters": "none",
    "nvme_path": None,
    "config": None,
    **{field.name: field.default for field in dataclasses.fields(ZeroTuning)},
    "accelerator": None,
    "parallel_devices": None,
    "cluster_environment": None,
    "process_group_backend": None,
    "timeout": default_pg_timeout,
    "logging_level": logging.WARN,
    "exclude_frozen_parameters": AUTO,
    "load_full_weights": False,
    "node_local_storage": False,
    "compile": False,
    "compile_kwargs": None,
    "leaf_modules": AUTO,
    "sequence_parallel_size": 1,
    "tiled_mlp": False,
    "tiled_logits_loss": False,
    "unused_parameters": "skip",
}


def keyword_names(keywords: type) -> Sequence[str]:
    """The argument names a typed dict of this module declares, in order."""
    return list(keywords.__annotations__)


def zero_arguments(given: Mapping[str, Any], keywords: type, front_end_defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Every argument of ``keywords`` (:class:`ZeroKeywords` or :class:`ZeroRunKeywords`) and of the front end's own
    (``front_end_defaults``) by name: those ``given``, the rest at their defaults. The front end has refused the
    keywords it does not take before (with what to do instead)."""
    defaults = {**{name: ZERO_DEFAULTS[name] for name in keyword_names(keywords)}, **front_end_defaults}
    return {name: given.get(name, default) for name, default in defaults.items()}


def strategy_arguments(
    given: Mapping[str, Any], strategy: type, owner: str, front_end: str, front_end_defaults: Mapping[str, Any]
) -> tuple[ModelRecipe, dict[str, Any]]:
    """What a ZeRO front end's ``__init__`` builds from the keyword arguments it was ``given``: the recipe of its
    DeepSpeed config and every argument by name (defaults filled in, the activation-checkpointing policy parsed). A
    keyword ``strategy`` does not take is a ``TypeError`` naming ``owner`` (the class called) and what to do instead."""
    refuse_unknown_keywords(owner, given, strategy, front_end)
    arguments = zero_arguments(given, ZeroKeywords, front_end_defaults)
    recipe = ModelRecipe.from_arguments(arguments, front_end=front_end)
    return recipe, {**arguments, "activation_checkpointing_policy": recipe.tuning.policy}
