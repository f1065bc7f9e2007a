"""XLA (PJRT) devices: the runtime checks and the bf16 casting that replaces ``XLA_USE_BF16``/``XLA_DOWNCAST_BF16``."""
