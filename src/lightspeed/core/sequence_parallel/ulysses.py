"""DeepSpeed's Ulysses attention (``UlyssesSPAttentionHF``) installed on one HuggingFace causal LM.

DeepSpeed's own ``register_with_transformers`` replaces the attention function process-wide, for good, with a fixed
micro-batch size; :class:`UlyssesInstallation` instead runs Ulysses only for the attention modules of the model it
was installed on (any other model in the process keeps the original function), follows each batch's size (the short
last batch of an epoch included) and is undone by :meth:`UlyssesInstallation.remove`, which also releases
DeepSpeed's sequence-parallel groups so that a later run can create its own.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from lightspeed.core.errors import SequenceParallelError
from lightspeed.core.sequence_parallel.loss import sequence_parallel_loss

__all__ = ["UlyssesInstallation", "find_causal_lm"]

#: attention implementations Ulysses can wrap (eager needs a whole 4-D mask, which sequence parallelism drops)
REPLACEABLE = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def find_causal_lm(model: torch.nn.Module) -> Any:
    """The one HuggingFace causal language model (a ``transformers`` ``*ForCausalLM``) in ``model``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = {name for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for name in _names(value)}
    found = [module for module in model.modules() if type(module).__name__ in names and hasattr(module, "config")]
    if len(found) != 1:
        what = "none" if not found else f"{len(found)} ({', '.join(type(m).__name__ for m in found)})"
        raise SequenceParallelError(
            f"sequence_parallel_size > 1 replaces the attention of one HuggingFace causal language model (a "
            f"transformers *ForCausalLM, e.g. LlamaForCausalLM) and found {what} in {type(model).__name__}. Build "
            "the model with transformers (from_pretrained or from_config), or train without sequence parallelism."
        )
    return found[0]


def _refuse_generation(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    raise SequenceParallelError(
        f"{type(model).__name__}.generate() cannot run while the model trains with sequence_parallel_size > 1: "
        "decoding adds one token at a time, which cannot be split over the group's ranks. Generate after the run "
        "(fit, validate, test) has ended, or with the exported weights in a run without sequence parallelism."
    )


def _names(value: Any) -> tuple[str, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (str(value),)


class UlyssesInstallation:
    """Ulysses attention and the whole-sequence loss on ``model``'s causal LM, over groups of ``size`` consecutive
    ranks (created here: a collective of every rank); ``loss_computed`` is called whenever the model's loss runs."""

    def __init__(self, model: torch.nn.Module, size: int, loss_computed: Callable[[], None]) -> None:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        causal_lm = find_causal_lm(model)
        config = causal_lm.config
        implementation = getattr(config, "_attn_implementation", None)
        if implementation not in REPLACEABLE:
            raise SequenceParallelError(
                f"sequence parallelism replaces the model's attention function, and {type(causal_lm).__name__} "
                f"uses attn_implementation={implementation!r}, which needs a whole attention mask. Build it with "
                f"attn_implementation='sdpa' (on the CPU) or a flash-attention variant (on CUDA)."
            )
        text = config.get_text_config()
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        if heads % size or (kv_heads % size and size % kv_heads):
            raise SequenceParallelError(
                f"sequence_parallel_size={size} splits attention heads over the group's ranks, and "
                f"{type(causal_lm).__name__} has {heads} attention heads and {kv_heads} key/value heads: the "
                f"attention heads must divide by {size}, and the key/value heads by {size} (or {size} by them)."
            )
        parallel_state_sp._release_sequence_parallel_groups()  # a previous run's, if it did not remove its own
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=size)
        self.mpu = parallel_state_sp
        self.group = parallel_state_sp.get_sequence_parallel_group()
        self.size = size
        self.rank = parallel_state_sp.get_sequence_parallel_rank()
        self.pad_token_id = int(getattr(config, "pad_token_id", None) or 0)
        self._registry = ALL_ATTENTION_FUNCTIONS
        self._implementation = implementation
        self._original_attention = ALL_ATTENTION_FUNCTIONS[implementation]
        self._ulysses = UlyssesSPAttentionHF(
            attn=self._original_attention,
            batch_size=1,
            attn_head_count=heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
            kv_head_count=kv_heads,
            num_hidden_layers=text.num_hidden_layers,
            process_group=self.group,
            seq_length_is_variable=True,
        )
        self._ulysses.core_attn_implementation = implementation
        self._modules = {id(module) for module in causal_lm.modules()}
        self.causal_lm = causal_lm
        self._had_own_loss = "_loss_function" in vars(causal_lm)
        self._original_loss = causal_lm.loss_function
        self._installed = self._attention  # one bound method: what remove() recognises in the registry
        ALL_ATTENTION_FUNCTIONS[implementation] = self._installed
        causal_lm.loss_function = sequence_parallel_loss(self._original_loss, self.group, loss_computed)
        self._own_generate = vars(causal_lm).get("generate")
        causal_lm.generate = types.MethodType(_refuse_generation, causal_lm)

    def _attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if id(module) not in self._modules:  # another model in the process: its own attention
            return self._original_attention(module, query, key, value, attention_mask, *args, **kwargs)
        self._follow_batch_size(query.shape[0])
        # the causal order over the gathered sequence replaces the mask HF built for one slice
        return self._ulysses(module, query, key, value, None, *args, **kwargs)

    def _follow_batch_size(self, batch_size: int) -> None:
        ulysses = self._ulysses
        if ulysses.batch_size == batch_size:
            return
        ulysses.batch_size = batch_size
        ulysses.required_query_shape = torch.Size([1, batch_size, ulysses.attn_head_count, ulysses.attn_head_size])
        ulysses.required_key_value_shape = torch.Size(
            [1, batch_size, ulysses.global_kv_head_count, ulysses.attn_head_size]
        )
        ulysses.required_context_shape = torch.Size(
            [1, batch_size, ulysses.attn_head_size * ulysses.attn_head_count // ulysses.world_size]
        )

    def owns(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` is (or holds) the causal LM this installation runs."""
        return any(module is self.causal_lm for module in model.modules())

    def remove(self) -> None:
        """Give the model its own attention and loss back and release DeepSpeed's sequence-parallel groups (and its
        global record of them, which the next engine built without sequence parallelism would read)."""
        if self._registry[self._implementation] is self._installed:
            self._registry[self._implementation] = self._original_attention
        if self._own_generate is None:
            vars(self.causal_lm).pop("generate", None)
        else:
            self.causal_lm.generate = self._own_generate
        if self._had_own_loss:
            self.causal_lm.loss_function = self._original_loss
        else:
            vars(self.causal_lm).pop("_loss_function", None)
        self.mpu._release_sequence_parallel_groups()
        from deepspeed.utils import groups

        if groups.mpu is self.mpu:  # set by the engine: the next engine without sequence parallelism would ask it
            groups.mpu = None
