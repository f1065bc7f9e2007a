"""The shared core: plain PyTorch/DeepSpeed logic with no Lightning imports, one package per feature. Packages import
each other only downward, in this order: ``errors`` and ``common``; ``accumulation``, ``gather``, ``xla``;
``reliability``; ``checkpoint``; ``zero``."""
