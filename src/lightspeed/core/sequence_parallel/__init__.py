"""Ulysses sequence parallelism (DeepSpeed's Arctic Long Sequence Training) for HuggingFace causal language models:
the ranks of one sequence-parallel group share every micro-batch, each holding a slice of its sequence, and exchange
attention heads for the whole sequence inside every attention layer.

* :mod:`.batch`: the batch each rank trains on (labels shifted on the whole sequence, then cut by the rank's slice);
* :mod:`.agreement`: the check that a group's ranks split the same rows;
* :mod:`.outputs`: an evaluation step's per-token outputs put back into whole sequences;
* :mod:`.loss`: the model's loss over the whole micro-batch, identical on every rank of the group;
* :mod:`.ulysses`: the attention installed through transformers' attention registry, and the groups;
* :mod:`.logits`: the model's loss over chunks of tokens, without whole logits (``tiled_logits_loss``);
* :mod:`.tiling`: the model's MLP blocks run over slices of the sequence (``tiled_mlp``);
* :mod:`.plan`: what a front end asks (sampler ranks, the gradient factor, the checks before the first step).
"""

from lightspeed.core.sequence_parallel.batch import shard_batch
from lightspeed.core.sequence_parallel.plan import SequenceParallel

__all__ = ["SequenceParallel", "shard_batch"]
