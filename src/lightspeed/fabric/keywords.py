"""What a Fabric loop does to train several models, each with its own optimizer (for the one-optimizer error)."""

from __future__ import annotations

__all__ = ["SEVERAL_MODELS"]

SEVERAL_MODELS = (
    "set each up with its own optimizer: `fabric.setup(generator, opt_g)`, `fabric.setup(discriminator, opt_d)`"
)
