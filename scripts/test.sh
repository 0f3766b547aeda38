#!/usr/bin/env bash
# Set up (or reuse) the environment with the test dependencies and run the whole test suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k ring, or the quick loop
# ./scripts/test.sh -m "not slow" (markers: pytest.ini). CI (.ci/run) passes none: every test,
# then the ring's features again with every node computing on ggml (the suite's tests run on
# torch, the reference, unless they name a backend; MDI_BACKEND=ggml ./scripts/test.sh FILES
# runs any of them on ggml).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh test

if [ "$#" -gt 0 ]; then
    exec python -m pytest -q "$@"  # pytest.ini: tests/ when no file is named
fi
# Two test processes side by side (pytest-xdist, a file's tests in one of them):
# most tests wait on node processes they started, which left a 2-core machine's second core idle
# much of the time. MDI_TEST_PROCESSES=1 runs the suite in one process.
PROCESSES="${MDI_TEST_PROCESSES:-2}"
SPREAD=()
if [ "$PROCESSES" -gt 1 ]; then
    SPREAD=(-n "$PROCESSES" --dist loadfile)
fi
# --durations: the slowest tests, named in CI's log: where the suite's minutes go
python -m pytest -q ${SPREAD[@]+"${SPREAD[@]}"} --durations=20
echo "--- the same features on the ggml backend ---"
MDI_BACKEND=ggml exec python -m pytest -q ${SPREAD[@]+"${SPREAD[@]}"} \
    tests/test_ring.py tests/test_batching.py tests/test_context.py tests/test_recovery.py \
    tests/test_prefix_cache.py tests/test_speculation.py tests/test_perplexity.py \
    tests/test_serve.py tests/test_serve_sampling.py tests/test_structured_outputs.py tests/test_adapter_ring.py \
    tests/test_serve_adapters.py tests/test_soft_prompt.py tests/test_serve_tools.py tests/test_tools.py \
    tests/test_sampling_fields.py tests/test_serve_control_tokens.py tests/test_serve_big_prompts.py \
    tests/test_speculation_draft.py tests/test_serve_vllm_fields.py
