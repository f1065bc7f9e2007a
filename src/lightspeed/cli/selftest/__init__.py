"""``lightspeed test``: the command (:mod:`.command`), the worker it launches on every rank (:mod:`.worker`),
the torchrun runner (:mod:`.runner`) and the verdict (:mod:`.checks`)."""
