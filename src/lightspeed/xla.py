"""Fixed shapes for XLA: pad batches to a few sequence lengths, and an alarm for steps that compile again.

An XLA device compiles one graph per input shape; a batch with a new sequence length compiles again, which takes
far longer than the step. Pad every batch to one of a few lengths ("buckets"):

```python
from lightspeed.xla import bucket_collate, pad_to_bucket

loader = DataLoader(dataset, batch_size=8, collate_fn=bucket_collate((128, 256, 512), pad_value=pad_id))
batch = pad_to_bucket(batch, buckets=(128, 256, 512), pad_value=pad_id)  # or pad an already collated batch
```

The XLA strategies (``accelerator="xla"``) watch torch_xla's compile count and warn once
(:class:`XLARecompilationWarning`) when a step after the first ones compiles again because the batch's shapes or
dtypes changed. In a Fabric loop (or any other), :class:`RecompilationAlarm` does the same:
``alarm.observe(batch)`` at the start of every step, ``alarm.close()`` after the loop.

Nothing here imports torch_xla; the padding is plain PyTorch and works on any device. The defaults are public too:
``DEFAULT_BUCKETS`` (the buckets), ``DEFAULT_PAD_VALUES`` (the padding of ``labels`` and ``attention_mask``) and
``DEFAULT_WARMUP_STEPS`` (the steps the alarm lets compile).
"""

from lightspeed.core.xla.padding import DEFAULT_BUCKETS, DEFAULT_PAD_VALUES, bucket_collate, pad_to_bucket
from lightspeed.core.xla.recompilation import DEFAULT_WARMUP_STEPS, RecompilationAlarm, XLARecompilationWarning

__all__ = [
    "DEFAULT_BUCKETS",
    "DEFAULT_PAD_VALUES",
    "DEFAULT_WARMUP_STEPS",
    "RecompilationAlarm",
    "XLARecompilationWarning",
    "bucket_collate",
    "pad_to_bucket",
]
