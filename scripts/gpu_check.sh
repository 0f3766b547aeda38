#!/usr/bin/env bash
# Everything mdi checks on an NVIDIA GPU, in one run that fits a short lease of a GPU machine:
#   1. the CUDA tests (tests/test_cuda.py, tests/test_gpu_transfers.py: on the CPU where there is
#      no GPU), in the foreground, while
#   2. the rest of the suite runs beside them with CUDA visible (pytest-xdist), capped in time;
#   3. then, on a quiet machine, scripts/bench_gpu.py (decode vs transformers, ring hops,
#      pipeline efficiency, int4 vs float16, speculation in the ring), whose JSON names the GPU.
# Usage: scripts/gpu_check.sh OUT_DIR. Logs, JSON results and py-spy stacks land in OUT_DIR.
# A machine without a package registry installs the wheels found in $MDI_WHEELS (default .whl:
# flask, waitress, pyzmq, gguf, and py-spy for bench_gpu.py --pyspy; the ggml binding's sdist there
# is built with CUDA, see below; downloaded elsewhere for its
# Python with `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`) and puts mdi on its path,
# with the mdi-worker / mdi-start commands the tests start.
# Time caps (seconds): MDI_SUITE_S (default 210) for the suite, 0 to skip it; MDI_BENCH_S (170) for
# each bench run. MDI_CUDA_TESTS: the pytest selection of the CUDA tests (default both files; empty
# skips them). MDI_BENCH_ARGS adds arguments to bench_gpu.py (e.g. "--parts hop,pipeline"); several
# runs are separated by ";" and write bench_gpu_1.json, bench_gpu_2.json... (logs likewise).
set -uo pipefail
cd "$(dirname "$0")/.." || exit
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
bin_dir="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")"
export PATH="$bin_dir:$PATH"  # the wrappers
echo "gpu_check: installed ($(elapsed)); $(tail -n 1 "$OUT/gpu.txt")"

# ggml-cuda: where the ggml binding's sdist travelled in $WHEELS (`pip download --no-deps --no-binary :all:
# ggml-python==VERSION` of setup.py's pin), build it with CUDA for this GPU's architecture alone (its
# toolkit's nvcc; the CPU side as scripts/setup_env.sh builds it, AMX left out) and run the ggml device
# tests among the CUDA tests: a node with backend ggml and device cuda computes on it.
GGML_SDIST="$(ls "$WHEELS"/ggml_python-*.tar.gz 2>/dev/null | head -n 1)"
if [ -n "$GGML_SDIST" ]; then
    t1=$(date +%s)
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    if CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native -DGGML_NATIVE=ON -DGGML_LLAMAFILE=ON -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'" \
        CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install --no-deps --no-build-isolation --no-index \
        --force-reinstall --no-cache-dir "$GGML_SDIST" >"$OUT/ggml_cuda_build.log" 2>&1; then
        echo "gpu_check: ggml-python built with CUDA in $(( $(date +%s) - t1 )) s"
    else
        echo "gpu_check: building ggml-python with CUDA failed after $(( $(date +%s) - t1 )) s (ggml_cuda_build.log)"
    fi
    "$PY" -c "from mdi.model.ggml import lib; print('ggml:', lib.version(), 'GPU devices:', lib.gpu_device_names())" \
        >>"$OUT/gpu.txt" 2>&1
    tail -n 1 "$OUT/gpu.txt"
fi

CUDA_TESTS="${MDI_CUDA_TESTS-tests/test_cuda.py tests/test_gpu_transfers.py${GGML_SDIST:+ tests/test_ggml_device.py}}"
workers=$(( $(nproc) > 4 ? $(nproc) - 4 : 1 ))  # cores left to the CUDA tests' own processes
suite=""
if [ "${MDI_SUITE_S:-210}" != 0 ]; then
    # SIGINT at the cap: pytest stops and still prints what passed and failed so far.
    timeout -s INT -k 30 "${MDI_SUITE_S:-210}" "$PY" -m pytest tests -n "$workers" -v -rfE --timeout 180 \
        --ignore tests/test_cuda.py --ignore tests/test_gpu_transfers.py --ignore tests/test_ggml_device.py >"$OUT/suite.log" 2>&1 &
    suite=$!
fi
if [ -n "$CUDA_TESTS" ]; then
    # shellcheck disable=SC2086  # a selection: several paths, maybe -k EXPR
    "$PY" -m pytest $CUDA_TESTS -v -rsfEP --timeout 300 --junitxml="$OUT/cuda_tests.xml" >"$OUT/cuda_tests.log" 2>&1
    echo "gpu_check: CUDA tests done ($(elapsed)): $(tail -n 1 "$OUT/cuda_tests.log")"
fi
if [ -n "$suite" ]; then
    wait "$suite"
    rc=$?
    [ "$rc" -eq 124 ] || [ "$rc" -eq 2 ] && echo "gpu_check: the suite was stopped at its cap (MDI_SUITE_S)" >>"$OUT/suite.log"
    echo "gpu_check: suite done ($(elapsed), exit $rc): $(tail -n 1 "$OUT/suite.log")"
fi

IFS=';' read -r -a bench_runs <<<"${MDI_BENCH_ARGS:-}"
[ "${#bench_runs[@]}" -eq 0 ] && bench_runs=("")
i=0
for extra in "${bench_runs[@]}"; do
    i=$((i + 1))
    name=bench_gpu; [ "${#bench_runs[@]}" -gt 1 ] && name=bench_gpu_$i
    # shellcheck disable=SC2086  # arguments
    "$PY" scripts/bench_gpu.py --out "$OUT/$name.json" --budget-s "${MDI_BENCH_S:-170}" $extra >"$OUT/$name.log" 2>&1
    echo "gpu_check: bench $name ($extra) done ($(elapsed)), exit $?"
done
[ -f "$OUT/cuda_tests.log" ] && { echo "=== CUDA tests"; grep -E "^(FAILED|ERROR)|(passed|failed|skipped).* in " "$OUT/cuda_tests.log" | tail -n 40; }
if [ -f "$OUT/suite.log" ]; then
    echo "=== suite: $(grep -c " PASSED " "$OUT/suite.log") passed, $(grep -c " FAILED " "$OUT/suite.log") failed so far"
    grep -E "^(FAILED|ERROR)|(passed|failed|Interrupted).* in " "$OUT/suite.log" | tail -n 30
fi
for log in "$OUT"/bench_gpu*.log; do echo "=== $(basename "$log")"; tail -n 25 "$log"; done
