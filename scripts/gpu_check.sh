#!/usr/bin/env bash
# The GPU check of kvshrink (< 8 minutes on one GPU): the CUDA-marked tests, then the decode benchmark at
# Llama-3.1-8B's shape with random weights (scripts/gpu_bench.py; speed and bytes only).
# Runs from the repository without installing kvshrink (PYTHONPATH=src); needs torch >= 2.11 with CUDA,
# Triton >= 3.6, transformers >= 5.17; pytest for the tests (skipped with a message when missing).
#   scripts/gpu_check.sh [extra gpu_bench.py arguments, e.g. --lengths 8192]
# Environment: PYTHON (default python3), OUT (folder for the results, default gpu_check_out),
# TEST_TIMEOUT (default 150 s), BENCH_TIMEOUT (default 330 s).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
start=$(date +%s)

echo "== versions"
"$PY" - <<'PYEOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name() if torch.cuda.is_available() else "NONE")
for name in ("transformers", "triton", "pytest", "numba"):
    try:
        print(name, __import__(name).__version__)
    except Exception as exc:
        print(name, "missing:", type(exc).__name__, exc)
PYEOF

status=0
echo "== CUDA-marked tests"
if "$PY" -c "import pytest" 2>/dev/null; then
    files=$(grep -l "mark.cuda" tests/test_*.py)
    timeout "${TEST_TIMEOUT:-150}" "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs $files 2>&1 | tee "$OUT/tests.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "CUDA tests: exit $rc"; status=1; }
else
    echo "pytest is missing: CUDA tests skipped (pip install pytest)"
fi

echo "== decode benchmark (random weights: speed and bytes only)"
timeout "${BENCH_TIMEOUT:-330}" "$PY" scripts/gpu_bench.py --json "$OUT/gpu_bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "benchmark: exit $rc"; status=1; }
echo "== done in $(( $(date +%s) - start ))s, results in $OUT/ (exit $status)"
exit $status
