#!/usr/bin/env bash
# Run the TRL adapter's tests against another TRL release in a throwaway venv.
#
#   compat/run_trl.sh VERSION [TRANSFORMERS_SPEC [PYTEST_ARGS...]]
#   compat/run_trl.sh 0.24.0 'transformers>=4.56.1,<4.58'
#   compat/run_trl.sh 0.20.0 'transformers>=4.53,<4.56' tests/test_trl_recompute.py -x
#
# The venv lives under ${COMPAT_VENV_ROOT:-/tmp} (never commit it); torch is pinned through
# constraints.txt (the CPU wheel). Without PYTEST_ARGS every tests/test_trl_*.py runs.
set -euo pipefail
VERSION="${1:?usage: compat/run_trl.sh TRL_VERSION [TRANSFORMERS_SPEC]}"
TRANSFORMERS_SPEC="${2:-transformers}"
shift $(( $# < 2 ? $# : 2 ))
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
VENV="${COMPAT_VENV_ROOT:-/tmp}/grpo_patches_trl-${VERSION}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q -c "$ROOT/constraints.txt" torch==2.13.0
  "$VENV/bin/pip" install -q -c "$ROOT/constraints.txt" "trl==${VERSION}" "$TRANSFORMERS_SPEC" \
    accelerate datasets tokenizers pytest hypothesis pluggy wrapt packaging setuptools
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT"
fi
"$VENV/bin/python" -c 'import trl, transformers, torch; print("trl", trl.__version__, "transformers", transformers.__version__, "torch", torch.__version__)'
cd "$ROOT"
if [ $# -eq 0 ]; then set -- tests/test_trl_*.py; fi
HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
