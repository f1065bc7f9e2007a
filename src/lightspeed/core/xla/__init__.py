"""XLA (PJRT) devices: the runtime checks and the bf16 casting that replaces ``XLA_USE_BF16``/``XLA_DOWNCAST_BF16``;
padding to fixed sequence lengths and the recompilation alarm (``batch_tree``, ``padding``, ``recompilation``)."""
