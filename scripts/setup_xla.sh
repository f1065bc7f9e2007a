#!/usr/bin/env bash
# Creates .venv-xla, the separate environment the XLA tests run in, idempotently.
# torch_xla 2.9.0 needs exactly torch 2.9.0, so it cannot live in the main .venv (torch 2.13.0). The torch wheel
# from the registry is the CUDA build (several GB); that is expected. DeepSpeed is not installed here on purpose:
# `import lightspeed` must work without it. Where torch_xla cannot be installed (no wheel for this platform or
# Python), the script still exits 0, prints why and writes the reason to .venv-xla/SKIP_REASON so that test
# runners can show it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-xla
TORCH_VERSION=2.9.0
TORCH_XLA_VERSION=2.9.0
TEST_CMD="PJRT_DEVICE=CPU $VENV/bin/python -m pytest -m xla tests/plugins/test_xla*.py tests/strategies/test_xla*.py"
export PIP_DISABLE_PIP_VERSION_CHECK=1

skip() {
  mkdir -p "$VENV"
  echo "$1" >"$VENV/SKIP_REASON"
  echo "[setup_xla] SKIP: $1"
  exit 0
}

pip_q() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location"; return "${PIPESTATUS[0]}"; }

# One interpreter start (importing torch_xla takes a while) reports what is missing; when nothing is, it also
# checks that PJRT's CPU device computes, which is what the tests run on.
missing_parts() {
  PJRT_DEVICE=CPU "$VENV/bin/python" - <<PYEOF 2>/dev/null || echo "python"
missing = []
try:
    import torch, torch_xla
    assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
    assert torch_xla.__version__.split("+")[0] == "$TORCH_XLA_VERSION", torch_xla.__version__
except Exception:
    missing.append("torch_xla")
try:
    import lightning, torchmetrics, safetensors, pytest, pytest_timeout, psutil
except Exception:
    missing.append("stack")
try:
    import lightspeed
except Exception:
    missing.append("lightspeed")
if not missing:
    try:
        import torch_xla.core.xla_model as xm
        assert (torch.ones(2, device=xm.xla_device()) * 2).cpu().tolist() == [2.0, 2.0]
    except Exception:
        missing.append("pjrt_cpu")
print(" ".join(missing))
PYEOF
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup_xla] creating $VENV"
  "$PY" -m venv "$VENV" || skip "could not create a virtual environment with $PY (python3-venv missing?)"
fi

missing=$(missing_parts)
if [ -z "$missing" ]; then
  rm -f "$VENV/SKIP_REASON"
  echo "[setup_xla] $VENV is ready (run: $TEST_CMD)"
  exit 0
fi

if [[ " $missing " == *" torch_xla "* || " $missing " == *" python "* ]]; then
  echo "[setup_xla] installing torch==$TORCH_VERSION torch_xla==$TORCH_XLA_VERSION (large download, a few minutes)"
  pip_q "torch==$TORCH_VERSION" "torch_xla==$TORCH_XLA_VERSION" \
    || skip "pip could not install torch==$TORCH_VERSION with torch_xla==$TORCH_XLA_VERSION for $("$VENV/bin/python" -c 'import platform, sys; print(f"Python {sys.version.split()[0]} on {platform.machine()}")')"
fi

echo "[setup_xla] installing lightning, torchmetrics, safetensors, the test tools and lightspeed (without DeepSpeed)"
pip_q "lightning==2.6.6" torchmetrics safetensors pytest pytest-timeout psutil setuptools wheel \
  || { echo "[setup_xla] could not install the Lightning stack into $VENV" >&2; exit 1; }
# the editable install writes src/lightspeed.egg-info; setup.sh (run beside this script by test.sh) does too
{ flock 9; pip_q --no-build-isolation --no-deps -e .; } 9>.editable-install.lock || { echo "[setup_xla] could not install lightspeed into $VENV" >&2; exit 1; }

missing=$(missing_parts)
case " $missing " in
  *" torch_xla "*) skip "torch_xla==$TORCH_XLA_VERSION installed but cannot be imported with torch==$TORCH_VERSION here" ;;
  *" pjrt_cpu "*) skip "torch_xla $TORCH_XLA_VERSION is installed but its PJRT CPU device does not start here" ;;
  "  ") ;;
  *) echo "[setup_xla] still missing after installing: $missing" >&2; exit 1 ;;
esac
rm -f "$VENV/SKIP_REASON"
echo "[setup_xla] done: $VENV is ready (run: $TEST_CMD)"
