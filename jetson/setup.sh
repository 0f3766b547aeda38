#!/usr/bin/env bash
# Set up a freshly flashed Jetson board for mdi: detect the L4T/JetPack release and say which
# torch matches it, install that torch (a wheel or an exact version: never an unpinned torch),
# mdi's other dependencies and mdi itself into a venv, and optionally the mdi-worker service.
# Run `jetson/setup.sh --help` for the flags; jetson/README.md walks through a whole ring.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RELEASE_FILE="${MDI_TEGRA_RELEASE:-/etc/nv_tegra_release}"  # overridable for tests
VENV=/opt/mdi/venv
PYTHON=python3
TORCH_WHEEL=""
TORCH_INDEX=""
TORCH_VERSION=""
TOKEN_FILE=""
APT=0
SERVICE=0
DRY_RUN=0
DETECT_ONLY=0
FORCE=0
GGML_CUDA=0

usage() {
    cat <<'EOF'
Usage: jetson/setup.sh TORCH [options]

Installs mdi into a venv on a Jetson board. TORCH must name one exact torch build:
  --torch-wheel PATH|URL   a torch wheel file or URL, e.g. NVIDIA's wheel for your JetPack
                           (run with --detect to see which one matches this board)
  --torch-version X.Y.Z    torch==X.Y.Z from PyPI (CPU-only on aarch64), or with:
  --torch-index URL        ... from this package index (PEP 503), e.g. a Jetson wheel index
An unpinned torch (an index without --torch-version, a range like '>=2.0') is refused:
pip would pick whatever build it finds, usually a CPU-only or wrong-CUDA one.

Options:
  --venv DIR         where to create the venv (default /opt/mdi/venv; needs sudo)
  --python PY        interpreter for the venv (default python3; JetPack 4 needs python3.8)
  --apt              first apt-get install the system packages (venv support, OpenBLAS)
  --service          also install the mdi-worker systemd service: user "mdi", /etc/mdi/
                     (mdi-worker.env, token) and /etc/systemd/system/mdi-worker.service
  --token-file FILE  with --service: the shared secret to install as /etc/mdi/token
  --detect           print the board, L4T/JetPack release and matching torch, then exit
  --dry-run          print every command instead of running it (works on any machine)
  --force            go on even though this is not a Jetson
  --ggml-cuda        build the ggml binding with CUDA too (nvcc from JetPack; a long build):
                     a node with device cuda and backend ggml then computes on the GPU
                     through ggml-cuda (not yet measured on a GPU: see jetson/README.md)
  -h, --help         this help

Examples:
  jetson/setup.sh --detect
  sudo jetson/setup.sh --apt --torch-wheel \
    https://developer.download.nvidia.com/compute/redist/jp/v512/pytorch/torch-2.1.0a0+41361538.nv23.06-cp38-cp38-linux_aarch64.whl
  sudo jetson/setup.sh --torch-wheel ~/torch-2.1.0-cp38-cp38-linux_aarch64.whl --python python3.8 \
    --service --token-file ~/mdi-token
EOF
}

say() { echo "setup: $*"; }
warn() { echo "setup: warning: $*" >&2; }
die() { echo "setup: error: $*" >&2; exit 2; }

# Run a command, or only print it (shell-quoted) with --dry-run.
run() {
    if [ "$DRY_RUN" = 1 ]; then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

as_root() {
    if [ "$(id -u)" -eq 0 ]; then run "$@"; else run sudo "$@"; fi
}

while [ "$#" -gt 0 ]; do
    case "$1" in
        --torch-wheel|--torch-index|--torch-version|--venv|--python|--token-file)
            [ "$#" -ge 2 ] || die "$1 needs a value"
            case "$1" in
                --torch-wheel) TORCH_WHEEL="$2" ;;
                --torch-index) TORCH_INDEX="$2" ;;
                --torch-version) TORCH_VERSION="$2" ;;
                --venv) VENV="$2" ;;
                --python) PYTHON="$2" ;;
                --token-file) TOKEN_FILE="$2" ;;
            esac
            shift 2 ;;
        --apt) APT=1; shift ;;
        --service) SERVICE=1; shift ;;
        --detect) DETECT_ONLY=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --force) FORCE=1; shift ;;
        --ggml-cuda) GGML_CUDA=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done
# A service without its secret is refused now, a dry run too: not after the long install.
if [ "$SERVICE" = 1 ]; then
    if [ -n "$TOKEN_FILE" ]; then
        [ -s "$TOKEN_FILE" ] || die "token file $TOKEN_FILE is missing or empty"
    elif [ ! -s /etc/mdi/token ]; then
        die "--service needs the shared secret: add --token-file FILE (see jetson/README.md)"
    fi
fi

# --- what board is this ----------------------------------------------------------------------
L4T=""
if [ -r "$RELEASE_FILE" ]; then
    # "# R35 (release), REVISION: 4.1, GCID: ..." -> 35.4.1
    L4T="$(sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\),.*/\1.\2/p' "$RELEASE_FILE" | head -n 1)"
fi
if [ -z "$L4T" ] && command -v dpkg-query >/dev/null 2>&1; then
    # "35.4.1-20230801124926" -> 35.4.1
    L4T="$(dpkg-query --showformat='${Version}' --show nvidia-l4t-core 2>/dev/null | cut -d- -f1 || true)"
fi
MODEL="unknown board"
if [ -r /proc/device-tree/model ]; then
    MODEL="$(tr -d '\0' < /proc/device-tree/model)"
fi

# JetPack release, its CUDA and Python, and the torch that matches it.
NV=https://developer.download.nvidia.com/compute/redist/jp
case "$L4T" in
    32.*)
        JETPACK="4.x (4.6.x for L4T 32.7)"; CUDA=10.2; SYSPY=3.6
        MATCH="none from NVIDIA: its JetPack 4 wheels stop at torch 1.10 for Python 3.6, and mdi needs
  torch >= 2.0 (scaled_dot_product_attention). Either bring a torch >= 2.0 built for Python 3.8 on
  this board (--python python3.8 --torch-wheel FILE; upstream torch 2.x needs patches to build
  against CUDA 10.2), or run on the CPU: --python python3.8 --torch-version 2.1.2 (PyPI, CPU-only)." ;;
    34.*|35.0.*|35.1.*)
        JETPACK="5.0.x"; CUDA=11.4; SYSPY=3.8
        MATCH="NVIDIA's JetPack 5.0 wheels are torch 1.12/1.13, too old for mdi (needs >= 2.0):
  upgrade to JetPack 5.1.2 or later (L4T 35.4+), then use the v512 wheel." ;;
    35.2.*|35.3.*)
        JETPACK="5.1 / 5.1.1"; CUDA=11.4; SYSPY=3.8
        MATCH="--torch-wheel $NV/v511/pytorch/torch-2.0.0+nv23.05-cp38-cp38-linux_aarch64.whl" ;;
    35.*)
        JETPACK="5.1.2 or later 5.1.x"; CUDA=11.4; SYSPY=3.8
        MATCH="--torch-wheel $NV/v512/pytorch/torch-2.1.0a0+41361538.nv23.06-cp38-cp38-linux_aarch64.whl" ;;
    36.0.*|36.1.*|36.2.*|36.3.*)
        JETPACK="6.0"; CUDA=12.2; SYSPY=3.10
        MATCH="a cp310 wheel from $NV/v60/pytorch/ (torch 2.2-2.4 builds for JetPack 6.0)" ;;
    36.*)
        JETPACK="6.1 / 6.2"; CUDA=12.6; SYSPY=3.10
        MATCH="--torch-wheel $NV/v61/pytorch/torch-2.5.0a0+872d972e41.nv24.08.17622132-cp310-cp310-linux_aarch64.whl
  (needs NVIDIA's cuSPARSELt library: see jetson/README.md)" ;;
    "")
        JETPACK=""; CUDA=""; SYSPY=""; MATCH="" ;;
    *)
        JETPACK="unknown"; CUDA="?"; SYSPY="?"
        MATCH="see NVIDIA's 'Installing PyTorch for Jetson Platform' for L4T $L4T" ;;
esac

if [ -n "$L4T" ]; then
    say "board: $MODEL"
    say "L4T $L4T = JetPack $JETPACK (CUDA $CUDA, system Python $SYSPY)"
    say "matching torch: $MATCH"
else
    say "not a Jetson: no $RELEASE_FILE and no nvidia-l4t-core package"
fi
[ "$DETECT_ONLY" = 1 ] && exit 0
if [ -z "$L4T" ] && [ "$DRY_RUN" = 0 ] && [ "$FORCE" = 0 ]; then
    die "this does not look like a Jetson (use --dry-run to see the steps, --force to install anyway)"
fi

# --- which torch: exactly one pinned build -----------------------------------------------------
VERSION_RE='^[0-9]+(\.[0-9]+)+([a-z]+[0-9]*)*(\.post[0-9]+)?(\+[A-Za-z0-9.]+)?$'  # no ranges, no wildcards
if [ -n "$TORCH_WHEEL" ] && { [ -n "$TORCH_VERSION" ] || [ -n "$TORCH_INDEX" ]; }; then
    die "give either --torch-wheel or --torch-version [--torch-index], not both"
fi
if [ -n "$TORCH_INDEX" ] && [ -z "$TORCH_VERSION" ]; then
    die "refusing to install an unpinned torch from $TORCH_INDEX: add --torch-version X.Y.Z"
fi
if [ -n "$TORCH_WHEEL" ]; then
    WHEEL_NAME="$(basename "$TORCH_WHEEL")"
    WHEEL_NAME="${WHEEL_NAME//%2B/+}"  # URLs may encode the local version's '+'
    [[ "$WHEEL_NAME" =~ ^torch-([^-]+)-(cp[0-9]+)-[^-]+-([^-]+)\.whl$ ]] ||
        die "--torch-wheel must be a torch wheel named torch-VERSION-cpXY-cpXY-PLATFORM.whl, got $WHEEL_NAME"
    TORCH_VERSION="${BASH_REMATCH[1]}"
    WHEEL_PY="${BASH_REMATCH[2]}"
    WHEEL_PLATFORM="${BASH_REMATCH[3]}"
    [[ "$TORCH_VERSION" =~ $VERSION_RE ]] || die "cannot read a torch version from $WHEEL_NAME"
    case "$TORCH_WHEEL" in
        http://*|https://*) ;;
        *) [ -f "$TORCH_WHEEL" ] || [ "$DRY_RUN" = 1 ] || die "no such wheel file: $TORCH_WHEEL" ;;
    esac
elif [ -n "$TORCH_VERSION" ]; then
    [[ "$TORCH_VERSION" =~ $VERSION_RE ]] ||
        die "refusing an unpinned torch: --torch-version must be one exact version like 2.1.2, got '$TORCH_VERSION'"
else
    die "refusing to install an unpinned torch: give --torch-wheel PATH|URL or --torch-version X.Y.Z${MATCH:+
  for this board: $MATCH}"
fi
TORCH_MAJOR="${TORCH_VERSION%%.*}"
[ "$TORCH_MAJOR" -ge 2 ] || die "mdi needs torch >= 2.0, got $TORCH_VERSION"

# --- the Python for the venv ---------------------------------------------------------------------
if [ "$APT" = 1 ]; then
    PYPKG="$(basename "$PYTHON")"
    PKGS=(libopenblas-dev "$PYPKG-venv")  # NVIDIA's torch links OpenBLAS; venv is not in python3 itself
    if [ "$PYPKG" = python3 ]; then
        PKGS+=(python3-pip)
    else
        PKGS+=("$PYPKG" "$PYPKG-dev")  # e.g. python3.8 from Ubuntu 18.04's universe on JetPack 4
    fi
    as_root apt-get update
    as_root apt-get install -y "${PKGS[@]}"
fi
PYVER=""
if command -v "$PYTHON" >/dev/null 2>&1; then
    PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
fi
if [ -z "$PYVER" ]; then
    [ "$DRY_RUN" = 1 ] || die "$PYTHON not found (add --apt, or --python python3.8 on JetPack 4)"
    warn "$PYTHON not found (dry run continues)"
else
    if [ "${PYVER%%.*}" -ne 3 ] || [ "${PYVER#*.}" -lt 8 ]; then
        die "mdi needs Python >= 3.8, $PYTHON is $PYVER (JetPack 4: --apt --python python3.8)"
    fi
    if [ -n "${WHEEL_PY:-}" ] && [ "$WHEEL_PY" != "cp${PYVER/./}" ]; then
        die "the torch wheel is for $WHEEL_PY but $PYTHON is Python $PYVER: pick the wheel or --python that match"
    fi
fi
if [ -n "${WHEEL_PLATFORM:-}" ] && [[ "$WHEEL_PLATFORM" != *"$(uname -m)" ]]; then
    warn "the torch wheel is for $WHEEL_PLATFORM, this machine is $(uname -m)"
fi
if [ -z "$TORCH_INDEX" ] && [ -z "$TORCH_WHEEL" ] && [ "$(uname -m)" = aarch64 ]; then
    warn "torch==$TORCH_VERSION from PyPI is a CPU-only build on aarch64: the GPU will not be used"
fi

# --- the venv: torch first, then mdi's other dependencies, then mdi without deps -----------------
if [ "$DRY_RUN" = 0 ] && [ ! -x "$VENV/bin/python" ]; then
    parent="$(dirname "$VENV")"
    while [ ! -d "$parent" ]; do parent="$(dirname "$parent")"; done
    [ -w "$parent" ] || die "cannot create $VENV: run with sudo, or pick --venv DIR"
fi
VPY="$VENV/bin/python"
run mkdir -p "$(dirname "$VENV")"
run "$PYTHON" -m venv "$VENV"
run "$VPY" -m pip install --upgrade pip
if [ -n "$TORCH_WHEEL" ]; then
    run "$VPY" -m pip install "$TORCH_WHEEL"
elif [ -n "$TORCH_INDEX" ]; then
    # torch alone from the index, then its own dependencies (sympy, ...) from PyPI: a second
    # index must never get the chance to offer a different build of torch itself.
    run "$VPY" -m pip install --no-deps --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"
    run "$VPY" -m pip install "torch==$TORCH_VERSION"
else
    run "$VPY" -m pip install "torch==$TORCH_VERSION"
fi

# mdi's requirements from setup.py (read with ast, not run), minus torch, which stays as installed.
HOSTPY="$PYTHON"
[ -n "$PYVER" ] || HOSTPY=python3  # dry run without the venv's interpreter
mapfile -t DEPS < <("$HOSTPY" - "$ROOT/setup.py" <<'PY'
import ast, re, sys
tree = ast.parse(open(sys.argv[1]).read())
for node in ast.walk(tree):
    if isinstance(node, ast.keyword) and node.arg == "install_requires":
        for req in ast.literal_eval(node.value):
            if re.split(r"[<>=!~; \[]", req, 1)[0].lower() != "torch":
                print(req)
PY
)
[ "${#DEPS[@]}" -gt 0 ] || die "could not read install_requires from $ROOT/setup.py"
TORCH_PIN="$VENV/torch-constraint.txt"
if [ "$DRY_RUN" = 1 ]; then
    echo "+ (write torch==<installed version> to $TORCH_PIN)"
else
    "$VPY" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' > "$TORCH_PIN"
fi
# The ggml binding (the ggml backend's library) builds from source for this board's CPU, as
# llama.cpp builds (-mcpu=native, llamafile's kernels), and with CUDA when asked (JetPack's nvcc).
GGML_ARGS="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=ON"
if [ "$GGML_CUDA" = 1 ]; then
    NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
    [ -x "$NVCC" ] || [ "$DRY_RUN" = 1 ] || die "--ggml-cuda: nvcc not found (JetPack installs it in /usr/local/cuda/bin)"
    GGML_ARGS="$GGML_ARGS -DGGML_CUDA=on -DCMAKE_CUDA_COMPILER=$NVCC"
fi
GGML_REQ=""
for req in "${DEPS[@]}"; do
    case "$req" in ggml-python*) GGML_REQ="$req" ;; esac
done
[ -n "$GGML_REQ" ] || die "setup.py names no ggml-python requirement"
say "building $GGML_REQ for this board ($GGML_ARGS): several minutes"
run env CMAKE_ARGS="$GGML_ARGS" "$VPY" -m pip install --no-cache-dir "$GGML_REQ" "numpy<2"
# numpy<2: NVIDIA's Jetson torch wheels are built against NumPy 1.x.
run "$VPY" -m pip install -c "$TORCH_PIN" "${DEPS[@]}" "numpy<2"
run "$VPY" -m pip install --no-deps "$ROOT"

# --- check that torch survived and mdi imports ---------------------------------------------------
CHECK='import torch, mdi, mdi.worker.app
cuda = torch.cuda.is_available()
print("setup: mdi %s, torch %s, CUDA %s" % (mdi.__version__, torch.__version__,
      torch.cuda.get_device_name(0) if cuda else "not available (CPU only)"))'
if [ "$DRY_RUN" = 1 ]; then
    echo "+ $VPY -c <import torch, mdi; report torch version and CUDA device>"
else
    [ "$(cat "$TORCH_PIN")" = "$("$VPY" -c 'from importlib.metadata import version; print("torch==" + version("torch"))')" ] ||
        die "torch changed while installing mdi's dependencies: $(cat "$TORCH_PIN") expected"
    "$VPY" -c "$CHECK" || die "the venv's torch or mdi does not import (see the error above)"
fi

# --- optional: the systemd service ---------------------------------------------------------------
if [ "$SERVICE" = 1 ]; then
    UNIT=/etc/systemd/system/mdi-worker.service
    if ! id mdi >/dev/null 2>&1; then
        as_root useradd --system --home-dir /var/lib/mdi --no-create-home --shell /usr/sbin/nologin \
            --user-group --groups video mdi
    fi
    as_root install -d -m 0750 -o root -g mdi /etc/mdi
    if [ -n "$TOKEN_FILE" ]; then  # (checked with the arguments)
        as_root install -m 0640 -o root -g mdi "$TOKEN_FILE" /etc/mdi/token
    fi
    if [ ! -f /etc/mdi/mdi-worker.env ] || [ "$DRY_RUN" = 1 ]; then
        as_root install -m 0640 -o root -g mdi "$ROOT/jetson/mdi-worker.env.example" /etc/mdi/mdi-worker.env
    else
        say "keeping the existing /etc/mdi/mdi-worker.env"
    fi
    # The unit names /opt/mdi/venv; point it at the venv actually used.
    if [ "$DRY_RUN" = 1 ]; then
        echo "+ sed 's#/opt/mdi/venv/#$VENV/#' $ROOT/jetson/mdi-worker.service > $UNIT"
    else
        sed "s#/opt/mdi/venv/#$VENV/#" "$ROOT/jetson/mdi-worker.service" | as_root tee "$UNIT" >/dev/null
    fi
    as_root systemctl daemon-reload
    as_root systemctl enable mdi-worker
    as_root systemctl restart mdi-worker
    say "service installed: systemctl status mdi-worker; settings in /etc/mdi/mdi-worker.env"
fi
say "done: $VENV/bin/mdi-worker --help"
