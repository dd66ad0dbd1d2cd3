#!/usr/bin/env bash
# README command 2: the whole test suite (after scripts/setup.sh).
#   bash scripts/test.sh              # everything, slow end-to-end tests included
#   bash scripts/test.sh -m "not slow"  # quick subset; extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=/dev/null
source scripts/env.sh
# Real-model tests reuse the models the set-up built instead of rebuilding them in a temp dir.
export SPARSEVER_TEST_MODELS_ROOT="${SPARSEVER_TEST_MODELS_ROOT:-${VLLM_SPARSEVER_HOME:-$HOME/.cache/vllm-sparsever}/models}"
exec python -m pytest -ra --durations=30 "$@"
