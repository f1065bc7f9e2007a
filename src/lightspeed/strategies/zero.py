"""``ZeroStrategy``: DeepSpeed ZeRO stages 0-3 with CPU/NVMe offload, on CUDA and on CPU.

Built on Lightning's ``DeepSpeedStrategy`` (launchers, engine wiring, checkpoint hooks) with these changes:

* runs on ``accelerator="cpu"`` too (DeepSpeed's CPU accelerator over gloo), choosing DeepSpeed's accelerator itself;
* the DeepSpeed config comes from a named preset plus the user's ``config=``, validated for unknown keys and with
  every ``"auto"`` resolved from the Trainer and the model (see :mod:`lightspeed.core.zero.config`);
* ``torch.optim.Adam``/``AdamW`` become DeepSpeed's CPU Adam (``Adagrad``: CPU Adagrad) when the optimizer is
  offloaded; any other torch optimizer runs as it is on the offloaded weights;
* evaluation after ``fit`` reuses the training engine instead of building a second one;
* evaluation from a checkpoint (``validate/test/predict(ckpt_path=...)``) in a fresh process loads the weights of
  any stage and world size into the (partitioned) inference model itself, tensor by tensor;
* checkpoints are written to a staging directory and committed only after every rank finished;
* the process group lightspeed created is destroyed when the interpreter exits (never mid-teardown), and known
  third-party deprecation floods are filtered while the strategy runs;
* ``compile=True`` (or a LightningModule compiled with ``torch.compile``, which Lightning refuses under DeepSpeed)
  compiles through DeepSpeed's own ``engine.compile()`` (see :mod:`lightspeed.core.zero.compile`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightspeed.core.zero.config.keywords import refuse_unknown_keywords
from lightspeed.core.zero.config.model_recipe import ModelRecipe, arguments_outside_recipe
from lightspeed.core.zero.runtime import zero_device_kind
from lightspeed.core.zero.session import ZeroConfigProperties, ZeroSession
from lightspeed.core.zero.several_models import parse_model_options
from lightspeed.strategies.compile_takeover import CompileTakeoverMixin
from lightspeed.strategies.exact_accumulation import DeepSpeedExactAccumulationMixin
from lightspeed.strategies.launchers import check_start_method, fork_launcher_if_wanted
from lightspeed.strategies.process_group import ProcessGroupMixin
from lightspeed.strategies.resumable_data import ResumableDataMixin
from lightspeed.strategies.sequence_parallel import SequenceParallelMixin
from lightspeed.strategies.zero_checkpoints import ZeroCheckpointsMixin
from lightspeed.strategies.zero_engine import ZeroEngineMixin
from lightspeed.strategies.zero_models import ZeroModelsMixin

if TYPE_CHECKING:
    import deepspeed
    import lightning.pytorch as pl

__all__ = ["ZeroStrategy"]


class ZeroStrategy(  # type: ignore[misc]  # `config`: the session's, never None (Lightning's may be)
    ZeroEngineMixin,
    ZeroConfigProperties,
    CompileTakeoverMixin,
    ProcessGroupMixin,
    ResumableDataMixin,
    SequenceParallelMixin,
    DeepSpeedExactAccumulationMixin,
    ZeroModelsMixin,
    ZeroCheckpointsMixin,
    DeepSpeedStrategy,
):
    """DeepSpeed ZeRO for Lightning, on ``accelerator="cuda"`` (nccl) and ``accelerator="cpu"`` (gloo).

    Args:
        stage: ZeRO stage 0-3 (0: plain data parallel through DeepSpeed).
        offload_optimizer: ``"none"``, ``"cpu"`` or ``"nvme"`` (``True`` means ``"cpu"``): where optimizer states live
            and the optimizer step runs.
        offload_parameters: ``"none"``, ``"cpu"`` or ``"nvme"``; stage 3 only.
        nvme_path: directory for NVMe offload; defaults to ``$LIGHTSPEED_NVME_PATH``.
        pin_memory: page-lock offloaded CPU buffers (faster host-device copies on CUDA; no effect on CPU).
        reduce_bucket_size: elements per gradient reduce bucket; ``"auto"``: h² (h: the model's
            ``config.hidden_size``, else its widest ``nn.Linear``; DeepSpeed's default when there is neither).
        allgather_bucket_size: elements per all-gather bucket, stages 1-2 only; ``"auto"``: DeepSpeed's default.
        prefetch_bucket_size: elements of parameters ZeRO-3 fetches ahead; ``"auto"``: 0.9·h².
        param_persistence_threshold: ZeRO-3 keeps parameters with at most this many elements whole on every rank;
            ``"auto"``: 10·h; ``0`` partitions every parameter, however small.
        sub_group_size: ZeRO-3 optimizer sub-group size (elements), None for DeepSpeed's default.
        activation_checkpointing_policy: module classes (a set, e.g. ``{Block}``) whose instances' forward runs under
            ``deepspeed.checkpointing.checkpoint`` during training: only their inputs are kept for the backward pass,
            which runs their forward again. Applied before the engine is built; the model's code stays as it is.
        partition_activations: DeepSpeed's ``activation_checkpointing`` section (this argument and the next five),
            for the policy and for ``deepspeed.checkpointing.checkpoint`` calls in the model; the section is written
            only when the policy or one of these asks for it (or ``config=`` has it). ``"auto"``: off (it splits
            checkpoints across model-parallel ranks; there is no model parallelism to partition across).
        cpu_checkpointing: keep the checkpointed activations in host memory; ``"auto"``: on when parameters are
            offloaded and the device is CUDA.
        contiguous_memory_optimization: copy checkpoints into one contiguous buffer (needs ``partition_activations``
            and ``number_checkpoints``); ``"auto"``: off.
        number_checkpoints: the checkpointed blocks in one forward pass (for ``contiguous_memory_optimization``).
        synchronize_checkpoint_boundary: synchronize the device at each checkpoint boundary (CUDA).
        profile: DeepSpeed's timing of the checkpointed forward and backward passes.
        bf16_master_weights_and_grads: keep the master weights and their gradients in bf16 instead of fp32
            (DeepSpeed's low-memory states; needs precision="bf16-mixed" or "bf16-true"): 4 bytes less per trained
            parameter, at a cost in accuracy measured in ``bench/low_memory_states.py``.
        bf16_optimizer_states: also keep the optimizer moments in bf16 (needs ``bf16_master_weights_and_grads``):
            another 4 bytes less per trained parameter with Adam.
        config: DeepSpeed config dict or JSON path merged over the preset (its values win). ``"auto"`` is allowed
            wherever HF-style configs use it. Unknown keys and values that contradict Trainer arguments are errors.
        accelerator: Lightning's accelerator (set by the Trainer from ``Trainer(accelerator=...)``).
        parallel_devices: the devices of this node (set by the Trainer from ``Trainer(devices=...)``).
        cluster_environment: Lightning's cluster environment (torchrun, SLURM, ...; set by the Trainer).
        precision_plugin: Lightning's precision plugin (set by the Trainer from ``Trainer(precision=...)``).
        process_group_backend: ``"nccl"`` or ``"gloo"``; ``None``: ``"nccl"`` on CUDA, ``"gloo"`` on the CPU.
        timeout: how long a collective may wait for the other ranks before a ``CollectiveTimeoutError`` names the
            collective and the rank that stopped answering.
        logging_level: the level of DeepSpeed's logger.
        exclude_frozen_parameters: leave parameters with ``requires_grad=False`` out of checkpoints. ``"auto"``
            (default): when the model holds a PEFT model (``peft.get_peft_model``), whose frozen base comes back from
            the pretrained files; the save records a fingerprint of them, and resuming with other frozen weights is an
            error.
        load_full_weights: ``ckpt_path=`` may be a consolidated single-file checkpoint (written without ZeRO): its
            weights go into the partitioned model and the optimizer's fp32 master copies; optimizer states start
            fresh.
        sync_with_dataloader: exact gradient accumulation (see ``DeepSpeedExactAccumulationMixin``): ``True`` steps
            the short last window of an epoch with its gradient scaled to its real size; ``False`` requires full
            windows.
        node_local_storage: for clusters whose nodes share no filesystem: each node writes its own ranks' shards (and
            the files every node needs) into its own local checkpoint directory; a checkpoint counts as complete once
            every node committed its part (same as ``config={"checkpoint": {"use_node_local_storage": True}}``).
        start_method: ``"fork"`` starts the worker processes by forking (as Lightning's ``ddp_notebook``); ``None``
            (default) forks in an interactive session (Jupyter, Colab) and otherwise re-runs the script per process.
        compile: compile the model with DeepSpeed's ``engine.compile()`` (``torch.compile`` of the module the engine
            wraps). A LightningModule compiled with ``torch.compile`` before ``fit`` is compiled the same way, with
            its backend, mode and options.
        compile_kwargs: ``torch.compile`` arguments for ``engine.compile()`` (``backend``, ``mode``, ``options``,
            ``fullgraph``, ``dynamic``, ...); given alone, it asks for compilation too.
        models: several models in one LightningModule, each with its own engine: the attribute names of the models
            mapped to their own options (``stage``, ``offload_optimizer``, ``offload_parameters``; left out: the
            strategy's), e.g. ``{"generator": {}, "discriminator": {}}`` or ``{"student": {}, "teacher": {"stage":
            3, "offload_parameters": "cpu"}}``. Each optimizer of ``configure_optimizers`` trains one model; a model
            without one is frozen (under ZeRO-3 partitioned, forward only). Checkpoints hold each trained model's
            engine in its own folder; exports write each trained model to ``<dirpath>/<name>/``.
        leaf_modules: the modules whose parameters ZeRO-3 gathers whole when they are called (DeepSpeed's leaf
            modules), marked before the engine is built. ``"auto"``: the model's mixture-of-experts blocks (a module
            with an ``nn.ModuleList`` child named ``experts``, as HuggingFace's Mixtral, Qwen-MoE and DeepSeek blocks
            have), so ranks whose tokens reach different experts stay in step. Otherwise the modules to mark instead:
            module classes, class names or the ends of module names (``{MoeBlock}``, ``["Qwen3MoeSparseMoeBlock"]``,
            ``["mlp"]``); each must name a module of the model. ``None``: none. ZeRO-3 only.
        sequence_parallel_size: split every sequence over groups of this many ranks (DeepSpeed's Ulysses attention,
            for a HuggingFace causal LM built with ``attn_implementation="sdpa"`` or flash attention): the ranks of a
            group read the same rows, each trains on its slice of their sequences (padded on the right to a
            multiple of the size, labels shifted over the whole sequence), and the model's loss is the token mean of
            the whole micro-batch on every rank. ``training_step`` calls ``model(**batch)`` with the batch it is
            given. 1 (default): off. See ``docs/long_context.md``.
        tiled_mlp: run the MLP blocks of the HuggingFace causal LM over slices of the sequence (DeepSpeed's
            ``TiledMLP``, ``ceil(sequence / hidden size)`` slices): their intermediate activations exist for one slice
            at a time, at the cost of one more MLP forward in the backward pass. With or without sequence
            parallelism.
        tiled_logits_loss: compute the HuggingFace causal LM's training loss over chunks of tokens, so that the
            whole ``[tokens, vocabulary]`` logits never exist (each chunk's are made again in the backward pass):
            True (about 1 GiB of float32 logits per chunk) or the tokens per chunk. The model's output then has no
            logits when it is called with labels in training. With or without sequence parallelism.
        unused_parameters: what an optimizer step does to the parameters no rank used in it (a layer some steps
            skip, a head the step did not choose, experts no token reached). ``"skip"`` (default): as in one process,
            their weights and optimizer state stay as they were, and under Adam each parameter keeps its own step
            count (saved in checkpoints); exact for SGD without dampening, RMSprop, Adagrad without ``lr_decay``,
            Adadelta, Adam and AdamW; another optimizer raises at the first step that leaves a parameter unused.
            ``"zero_gradient"``: they take a step on a zero gradient (momentum, weight decay and Adam's moments move
            them), at no cost. See ``docs/zero.md``.
        **unsupported: none is taken: a keyword of Lightning's ``DeepSpeedStrategy`` that lightspeed does not take
            (e.g. ``offload_params_device``, ``logging_batch_size_per_gpu``) is a ``TypeError`` saying what to use
            instead.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: str | bool | None = "none",
        offload_parameters: str | bool | None = "none",
        nvme_path: _PATH | None = None,
        pin_memory: bool = True,
        reduce_bucket_size: int | str = "auto",
        allgather_bucket_size: int | str = "auto",
        prefetch_bucket_size: int | str = "auto",
        param_persistence_threshold: int | str = "auto",
        sub_group_size: int | None = None,
        activation_checkpointing_policy: Collection[type[torch.nn.Module]] | type[torch.nn.Module] | None = None,
        partition_activations: bool | str = "auto",
        cpu_checkpointing: bool | str = "auto",
        contiguous_memory_optimization: bool | str = "auto",
        number_checkpoints: int | None = None,
        synchronize_checkpoint_boundary: bool = False,
        profile: bool = False,
        bf16_master_weights_and_grads: bool = False,
        bf16_optimizer_states: bool = False,
        config: _PATH | dict[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any | None = None,
        precision_plugin: Any | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        logging_level: int = logging.WARN,
        exclude_frozen_parameters: bool | str = "auto",
        load_full_weights: bool = False,
        sync_with_dataloader: bool = True,
        node_local_storage: bool = False,
        start_method: str | None = None,
        compile: bool = False,
        compile_kwargs: dict[str, Any] | None = None,
        models: Mapping[str, Mapping[str, Any]] | Sequence[str] | None = None,
        leaf_modules: Collection[type[torch.nn.Module] | str] | type[torch.nn.Module] | str | None = "auto",
        sequence_parallel_size: int = 1,
        tiled_mlp: bool = False,
        tiled_logits_loss: bool | int = False,
        unused_parameters: str = "skip",
        **unsupported: Any,
    ) -> None:
        refuse_unknown_keywords(type(self).__name__, unsupported, ZeroStrategy, "Trainer")
        recipe = ModelRecipe.from_arguments(locals(), front_end="Trainer")
        deepspeed_config = recipe.config()
        options = parse_model_options(models, "ZeroStrategy(models=...)")
        not_with_several_models = {
            "compile": compile or compile_kwargs,
            "load_full_weights": load_full_weights,
            "node_local_storage": node_local_storage,
            "activation_checkpointing_policy": activation_checkpointing_policy,
        }
        self._init_lightning(deepspeed_config, {**locals(), "activation_checkpointing_policy": recipe.tuning.policy})
        self._init_several_models(options, recipe, not_with_several_models)

    def _init_lightning(self, deepspeed_config: dict[str, Any], arguments: Mapping[str, Any]) -> None:
        """Lightning's ``DeepSpeedStrategy`` set-up around an already built DeepSpeed config, whose ``"auto"`` values
        stay until setup (``arguments``: those of ``__init__`` by name, the parsed activation-checkpointing policy)."""
        check_start_method(arguments.get("start_method"))
        self._session = ZeroSession.from_arguments(
            deepspeed_config, arguments, type(self).__name__, "Trainer", rank_zero_info
        )
        strategy_kwargs = arguments_outside_recipe(
            arguments, DeepSpeedStrategy.__init__, DeepSpeedExactAccumulationMixin.__init__
        )
        super().__init__(config=deepspeed_config, **strategy_kwargs)
        self._start_method_choice = arguments.get("start_method")
        self._train_engine: deepspeed.DeepSpeedEngine | None = None
        self._failed = False  # set by on_exception, read by teardown
        self._init_several_models({}, None, {})

    def _device_kind(self) -> str:
        return zero_device_kind(self.accelerator)

    # ------------------------------------------------------------------ before any process starts
    @override
    def _configure_launcher(self) -> None:
        # Runs in Trainer.__init__, before launching: the right place for checks that must fail early and for the
        # environment every rank inherits.
        self._session.check_before_launch(self._device_kind(), self.precision_plugin.precision, self)
        launcher = fork_launcher_if_wanted(self, self._start_method_choice)
        if launcher is not None:
            self._launcher = launcher
            return
        super()._configure_launcher()

    # ------------------------------------------------------------------ process setup
    @override
    def setup_environment(self) -> None:
        kind = self._device_kind()
        self._session.start_process(kind, self)
        if kind == "cuda":
            super().setup_environment()  # Lightning's checks and CUDA device selection
            return
        assert self.accelerator is not None  # set by the Trainer before setup_environment
        self.accelerator.setup_device(self.root_device)
        self.setup_distributed()

    @override
    def _set_main_address(self) -> None:
        self._set_node_environment_variables()  # DeepSpeed's rank variables too

    @override
    def setup_distributed(self) -> None:
        if self._device_kind() == "cuda":
            super().setup_distributed()  # lightspeed's group (ProcessGroupMixin), then Lightning's CUDA set-up
            return
        # CPU devices carry no index, so Lightning's CUDA index check does not apply; DeepSpeed adopts the group.
        with self._lightspeed_process_group():
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        failed, self._failed = self._failed, False
        if failed:
            self._train_engine = None  # the engine of a failed run is not reused for evaluation
            self._drop_model_engines()
        try:
            self._teardown_lightning()
        finally:
            self._session.end_process()
        # The process group lightspeed created stays up until the interpreter exits (an ``atexit`` hook destroys it
        # then, while the interpreter is intact): the training engine kept for evaluation after ``fit``, ZeRO-3
        # partitioned modules and the user's own ``torch.distributed`` calls after a run (even a failed one) use it.

    def _teardown_lightning(self) -> None:
        if (self._train_engine is None and not self.model_engines) or self._device_kind() == "cpu":
            super().teardown()
            return
        # CUDA with the training engine kept for evaluation after `fit`: everything Lightning's teardown does except
        # moving the module and optimizer states to the CPU, which would break the engine's (sharded) weights.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
