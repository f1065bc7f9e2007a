"""DeepSpeed ZeRO: the config recipe and its resolution (:mod:`.config`), the memory planner (:mod:`.planner`) and the
automatic choice built on it, the engine set-up and its checkpoints, DeepSpeed's runtime on CUDA and CPU, CPU
optimizers for offload, and DeepSpeed's side of exact accumulation."""
