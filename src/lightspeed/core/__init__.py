"""The shared core: plain PyTorch/DeepSpeed logic with no Lightning imports (config resolution, gather and
padding, accumulation arithmetic, checkpoint reading and export, memory estimates)."""
