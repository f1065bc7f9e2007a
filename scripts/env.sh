# Sourced by the other scripts (run from the repository root).
# DeepSpeed compiles its CPU ops on first use into torch's extension cache. Keeping that cache inside .venv means two
# checkouts (or CI beside a developer tree) never rebuild each other's ops or wait on each other's build locks.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
# torch builds and loads those ops with the `ninja` it finds on PATH. It must be the venv's ninja, the one setup.sh
# built them with: ninja 1.13 (pip) and ninja <= 1.12 (/usr/bin) hash command lines differently in the shared
# .ninja_log, so each sees the other's build as "command line changed" and rebuilds every op. `import lightspeed`
# does the same for a venv that is not activated (lightspeed.core.zero.runtime.use_prebuilt_deepspeed_ops).
case ":$PATH:" in *":$PWD/.venv/bin:"*) ;; *) export PATH="$PWD/.venv/bin:$PATH" ;; esac
# One intra-op thread per rank: the multi-process jobs here put one rank on each core.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
