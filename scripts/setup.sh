#!/usr/bin/env bash
# Creates .venv with everything lightspeed needs on this machine, idempotently.
# CPU torch 2.13.0 is pinned (a plain `torch` would pull several GB of CUDA wheels); DeepSpeed is built
# against it without build isolation; libaio-dev is installed for NVMe offload; DeepSpeed's CPU ops are
# compiled once into the torch extensions cache so the first training run does not pay for it.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! dpkg -s libaio-dev >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  echo "[setup] installing libaio-dev (DeepSpeed async_io, needed for NVMe offload)"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q libaio-dev >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q libaio-dev >/dev/null; } \
    || echo "[setup] WARNING: could not install libaio-dev; zero3_nvme will be unavailable"
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip_q() { pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
if ! python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch ${LIGHTSPEED_TORCH_VERSION:-2.13.0}"
  pip_q "torch==${LIGHTSPEED_TORCH_VERSION:-2.13.0}"
fi
if ! python -c "import lightspeed, deepspeed, pytest, transformers, jsonargparse, mypy, nbclient, ipykernel, mkdocs, mkdocstrings, material" >/dev/null 2>&1 || [ ! -x .venv/bin/ruff ]; then
  echo "[setup] installing lightspeed and its dependencies"
  pip_q setuptools wheel ninja
  # the editable install writes src/lightspeed.egg-info; setup_xla.sh (run beside this script by test.sh) does too
  { flock 9; pip_q --no-build-isolation -e ".[test]"; } 9>.editable-install.lock
fi
python -c "import lightspeed, deepspeed" || { echo "[setup] installation failed" >&2; exit 1; }

echo "[setup] building DeepSpeed CPU ops into $TORCH_EXTENSIONS_DIR (cached after the first time)"
# a build killed half-way leaves its lock behind and every later run would wait on it forever. Only a lock older
# than any real build is stale: removing a fresh one lets a second process build the same op at the same time as a
# test run (or another setup.sh), and torch's release of the removed lock then fails in one of them.
find "$TORCH_EXTENSIONS_DIR" -mindepth 2 -maxdepth 2 -name lock -mmin +60 -print -delete 2>/dev/null \
  | sed 's/^/[setup] removed a stale build lock: /' || true
DS_ACCELERATOR=cpu python - <<'PYEOF'
import os
import subprocess
import warnings
warnings.filterwarnings("ignore")
# exactly what every run does before DeepSpeed builds anything: this cache, and the venv's ninja first on PATH
from lightspeed.core.zero.runtime import use_prebuilt_deepspeed_ops
use_prebuilt_deepspeed_ops()
from deepspeed.accelerator import get_accelerator
accelerator = get_accelerator()
for name in ("CPUAdamBuilder", "CPUAdagradBuilder", "ShareMemCommBuilder", "PinMemoryBuilder", "AsyncIOBuilder"):
    builder = accelerator.create_op_builder(name)
    if builder is not None and builder.is_compatible(verbose=False):
        builder.load(verbose=False)
        # a later run must find nothing to rebuild (ninja decides from the command lines it logged)
        build_dir = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], builder.NAME)
        dry = subprocess.run(["ninja", "-n", "-d", "explain"], cwd=build_dir, capture_output=True, text=True)
        if "no work to do" not in dry.stdout:
            raise SystemExit(f"[setup] DeepSpeed op {builder.NAME} would be rebuilt by the next run:\n{dry.stdout}{dry.stderr}")
        print(f"[setup] DeepSpeed op {builder.NAME} ready")
    else:
        print(f"[setup] DeepSpeed op {name} not buildable here" + (" (NVMe offload unavailable: install libaio-dev)" if name == "AsyncIOBuilder" else ""))
PYEOF
echo "[setup] done: .venv is ready"
