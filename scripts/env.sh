# Sourced by the other scripts (run from the repository root).
# DeepSpeed compiles its CPU ops on first use into torch's extension cache. Keeping that cache inside .venv means two
# checkouts (or CI beside a developer tree) never rebuild each other's ops or wait on each other's build locks.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
# One intra-op thread per rank: the multi-process jobs here put one rank on each core.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
