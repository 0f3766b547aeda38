#!/usr/bin/env bash
# Set up (or reuse) the environment, prepare the embedded default model (SmolLM2-135M) and run
# the main job: a 3-node ring on this machine (the starter + two workers on ports 8081, 8082).
# Extra arguments go to mdi-start, e.g. ./scripts/demo.sh --prompt "Once upon a time" --n-tokens 64
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh ""  # no extras; without the "" it would read demo.sh's own arguments as extras

PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT

for port in 8081 8082; do
    mdi-worker --port "$port" --threads 1 > "/tmp/mdi-worker-$port.log" 2>&1 &
    PIDS+=($!)
done
for port in 8081 8082; do
    for _ in $(seq 1 100); do
        python - "$port" <<'PY' && break
import sys, requests
try:
    requests.get("http://127.0.0.1:%s/health" % sys.argv[1], timeout=1).raise_for_status()
except Exception:
    sys.exit(1)
PY
        sleep 0.2
    done
done

if [ "$#" -eq 0 ]; then
    # The model keeps its GGUF's int4 blocks; each layer multiplies with the kernel measured
    # fastest on this CPU (runtime.quant_kernel: fast, the default).
    set -- --prompt "The capital of France is" --n-tokens 32 --temperature 0
fi
mdi-start --config configs/ring3.yaml "$@"
