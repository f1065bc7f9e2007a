"""Exact gradient accumulation: the arithmetic that makes ``N`` micro-batches give the gradient of the big batch."""
