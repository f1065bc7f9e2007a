#!/usr/bin/env bash
# The whole test suite, from a fresh machine: sets up .venv (and .venv-xla for the XLA tests), then runs pytest.
# Exit status is non-zero if any test fails or if pytest collects no tests (pytest's exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."
# the XLA environment (mostly a download) is set up beside the main one (mostly compiling DeepSpeed's CPU ops)
xla_log=$(mktemp)
bash scripts/setup_xla.sh >"$xla_log" 2>&1 &
xla_setup=$!
trap 'kill "$xla_setup" 2>/dev/null || true' EXIT  # setup.sh failed: do not leave the download running
bash scripts/setup.sh
xla_status=0
wait "$xla_setup" || xla_status=$?
trap - EXIT
cat "$xla_log"
rm -f "$xla_log"
[ "$xla_status" = 0 ] || { echo "[test] scripts/setup_xla.sh failed (exit $xla_status)" >&2; exit "$xla_status"; }
. scripts/env.sh
echo "[test] lint and types: ruff check, ruff format --check, mypy"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
echo "[test] main suite (.venv: torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'))"
.venv/bin/python -m pytest --durations=40 "$@"

if [ -f .venv-xla/SKIP_REASON ]; then
  echo "[test] XLA suite SKIPPED: $(cat .venv-xla/SKIP_REASON)"
else
  echo "[test] XLA suite (.venv-xla: torch_xla on PJRT CPU)"
  PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest -m xla -p no:cacheprovider tests/plugins/test_xla*.py tests/strategies/test_xla*.py
fi
