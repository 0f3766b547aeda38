#!/usr/bin/env bash
# Everything mdi checks on an NVIDIA GPU, in one run that fits a short lease of a GPU machine:
#   1. the CUDA tests (tests/test_cuda.py, tests/test_gpu_transfers.py: skipped where there is
#      no GPU), in the foreground, while
#   2. the rest of the suite runs beside them with CUDA visible (pytest-xdist), capped in time;
#   3. then, on a quiet machine, scripts/bench_gpu.py (decode vs transformers, ring hops,
#      pipeline efficiency, int4 vs float16), whose JSON names the GPU.
# Usage: scripts/gpu_check.sh OUT_DIR. Logs and results land in OUT_DIR (six files).
# A machine without a package registry installs the wheels found in $MDI_WHEELS (default .whl:
# flask, waitress, pyzmq, gguf... downloaded elsewhere for its Python) and puts mdi on its path,
# with the mdi-worker / mdi-start commands the tests start.
# Time caps (seconds): MDI_SUITE_S (default 210) for the suite, MDI_BENCH_S (170) for the bench;
# MDI_BENCH_ARGS adds arguments to bench_gpu.py (e.g. "--parts hop,pipeline").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
WHEELS="${MDI_WHEELS:-.whl}"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - t0 )) s"; }

{ nvidia-smi || true; "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"; } >"$OUT/gpu.txt" 2>&1
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$WHEELS"/*.whl >>"$OUT/gpu.txt" 2>&1 \
        || echo "gpu_check: installing the wheels of $WHEELS failed (see gpu.txt)"
fi
# mdi itself without pip (pip install -e wants setuptools from a registry): a .pth file puts
# this checkout on the path, and each console script of setup.py gets a wrapper beside python.
"$PY" - <<'PYEOF' >>"$OUT/gpu.txt" 2>&1 || echo "gpu_check: installing mdi failed (see gpu.txt)"
import os, re, sys, sysconfig
root = os.getcwd()
with open(os.path.join(sysconfig.get_paths()["purelib"], "mdi-checkout.pth"), "w") as f:
    f.write(root + "\n")
for name, module, func in re.findall(r'"(mdi-[a-z]+)=([\w.]+):(\w+)"', open("setup.py").read()):
    path = os.path.join(os.path.dirname(sys.executable), name)
    with open(path, "w") as f:
        f.write("#!%s\nimport sys\nfrom %s import %s\nsys.exit(%s())\n" % (sys.executable, module, func, func))
    os.chmod(path, 0o755)
    print("gpu_check: wrote", path)
PYEOF
export PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"  # the wrappers
echo "gpu_check: installed ($(elapsed)); $(tail -n 1 "$OUT/gpu.txt")"

CUDA_TESTS="tests/test_cuda.py tests/test_gpu_transfers.py"
workers=$(( $(nproc) > 4 ? $(nproc) - 4 : 1 ))  # cores left to the CUDA tests' own processes
# SIGINT at the cap: pytest stops and still prints what passed and failed so far.
timeout -s INT -k 30 "${MDI_SUITE_S:-210}" "$PY" -m pytest tests -n "$workers" -v -rfE --timeout 180 \
    $(for f in $CUDA_TESTS; do echo --ignore "$f"; done) >"$OUT/suite.log" 2>&1 &
suite=$!
"$PY" -m pytest $CUDA_TESTS -v -rsfEP --timeout 300 --junitxml="$OUT/cuda_tests.xml" >"$OUT/cuda_tests.log" 2>&1
echo "gpu_check: CUDA tests done ($(elapsed)): $(tail -n 1 "$OUT/cuda_tests.log")"
wait "$suite"
rc=$?
[ "$rc" -eq 124 ] || [ "$rc" -eq 2 ] && echo "gpu_check: the suite was stopped at its cap (MDI_SUITE_S)" >>"$OUT/suite.log"
echo "gpu_check: suite done ($(elapsed), exit $rc): $(tail -n 1 "$OUT/suite.log")"

"$PY" scripts/bench_gpu.py --out "$OUT/bench_gpu.json" --budget-s "${MDI_BENCH_S:-170}" ${MDI_BENCH_ARGS:-} >"$OUT/bench_gpu.log" 2>&1
echo "gpu_check: bench done ($(elapsed)), exit $?"
echo "=== CUDA tests"; grep -E "^(FAILED|ERROR)|(passed|failed|skipped).* in " "$OUT/cuda_tests.log" | tail -n 40
echo "=== suite: $(grep -c " PASSED " "$OUT/suite.log") passed, $(grep -c " FAILED " "$OUT/suite.log") failed so far"
grep -E "^(FAILED|ERROR)|(passed|failed|Interrupted).* in " "$OUT/suite.log" | tail -n 30
echo "=== bench"; tail -n 40 "$OUT/bench_gpu.log"
