#!/usr/bin/env bash
# One command for a lent GPU machine (torch, triton and transformers installed; no package index):
#   bash benchmarks/gpu.sh              # on the GPU machine, at most ~6 minutes
#   bash benchmarks/gpu.sh --prepare    # here, first: the wheels it may need into .cache/gpu-wheels
#   GPU_SH_STEPS="lm_head trl_step" bash benchmarks/gpu.sh   # only those steps (a rerun)
# Steps, each with its own time limit inside a 6-minute budget (a step that cannot import what it
# needs is recorded as failed with its log, the others still run):
#   1. kernels + gpu tier: tests/test_tiled_fold.py (the Triton kernels compiled, on CUDA tensors),
#      tests/test_gpu_tier.py, tests/test_tiled_loss_bf16.py
#   2. the lm-head table: benchmarks/lm_head_loss.py --device cuda --dtype bfloat16, dense / project
#      / TRL's head, 3 rounds round-robin, then the project at a 1 GiB tile budget beside dense
#   3. bf16 accuracy: benchmarks/bf16_grad_error.py at N 2048, H 1024, V 32000
#   4. benchmarks/trl_step.py --device cuda: TRL's GRPOTrainer step, unpatched / patched / tiled_loss
# Results: $OUT (the device tool's folder) or benchmarks/results/gpu/: gpu_results.md (versions,
# each step's exit code, time and output tail) and the JSON of the lm-head tables and trl_step.py.
# What must travel with the working tree: benchmarks/README.md, "On a lent GPU".
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=.cache/gpu-wheels
# pure-Python wheels (and the small compiled ones, per Python version) the steps import; pyarrow and
# pandas (datasets' own dependencies, 70 MB) are too big to carry: trl_step.py needs them on the machine
PURE=(pluggy iniconfig pytest trl accelerate datasets dill fsspec)
COMPILED=(wrapt xxhash multiprocess)

pinned() {  # the versions this interpreter has installed (the ones the tests pass with), else the newest
  "$PY" -c 'import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)' "$@"
}

if [ "${1:-}" = "--prepare" ]; then
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" $(pinned "${PURE[@]}")
  for v in 3.10 3.11 3.12 3.13; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$WHEELS" \
      $(pinned "${COMPILED[@]}")
  done
  du -sh "$WHEELS"
  exit 0
fi

OUT_DIR=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/gpu_results.md"
BUDGET=${GPU_SH_BUDGET_S:-360}
START=$(date +%s)

# grpo_patches from this tree, uninstalled: grpo_patches.adapters is the top-level adapters/ (an install
# maps it), so a link gives it that name for this run; removed at the end
LINK=""
if ! "$PY" -c "import grpo_patches.adapters" >/dev/null 2>&1; then
  ln -s ../adapters grpo_patches/adapters && LINK=grpo_patches/adapters
fi
SITE=$(mktemp -d)  # the carried wheels this machine lacks, installed for this run only
trap 'rm -rf "$SITE" "$LOGS"; [ -n "$LINK" ] && rm -f "$LINK"' EXIT
LOGS=$(mktemp -d)  # full logs and outputs; $OUT_DIR gets the summary and the JSON (a few files)
declare -A DISTS=([pluggy]="pluggy" [wrapt]="wrapt" [pytest]="pytest iniconfig" [trl]="trl" [accelerate]="accelerate"
                  [datasets]="datasets dill fsspec xxhash multiprocess")
missing=()
for mod in pluggy wrapt pytest trl accelerate datasets; do
  "$PY" -c "import $mod" >/dev/null 2>&1 || missing+=("$mod")
done
if [ ${#missing[@]} -gt 0 ] && [ -d "$WHEELS" ]; then  # the carried wheels of what this machine lacks
  dists=()
  for mod in "${missing[@]}"; do dists+=(${DISTS[$mod]}); done
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" --find-links "$WHEELS" "${dists[@]}" \
    >"$LOGS/install.log" 2>&1 || echo "carried wheels: install failed (see below)" >>"$LOGS/install.log"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
unset TRITON_INTERPRET

{
  echo "# benchmarks/gpu.sh, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  "$PY" - <<'EOF' 2>&1
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "transformers", "trl", "accelerate", "datasets", "pytest", "grpo_patches"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as exc:
        print(name, "MISSING:", type(exc).__name__, exc)
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF
  echo "missing here, installed from $WHEELS: ${missing[*]:-nothing}"
  [ -f "$LOGS/install.log" ] && tail -n 5 "$LOGS/install.log"
  echo '```'
} >"$RESULTS"

STEPS=" ${GPU_SH_STEPS:-kernels lm_head lm_head_1GiB_tiles bf16_grad_error trl_step} "  # a rerun may pick some
step() {  # step NAME LIMIT_S COMMAND...: run within the budget left, record exit code, time and tail
  local name=$1 limit=$2
  shift 2
  [[ "$STEPS" == *" $name "* ]] || return 0
  local left=$((BUDGET - ($(date +%s) - START)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -le 5 ]; then
    printf '\n## %s\n\nnot run: the %s s budget is spent\n' "$name" "$BUDGET" >>"$RESULTS"
    return
  fi
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  {
    printf '\n## %s\n\n`%s` -> exit %s in %s s (limit %s s)\n\n```\n' "$name" "$*" "$rc" "$(($(date +%s) - t0))" "$limit"
    tail -n 45 "$LOGS/$name.log"
    echo '```'
  } >>"$RESULTS"
}

step kernels 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_tiled_fold.py tests/test_gpu_tier.py \
  tests/test_tiled_loss_bf16.py
step lm_head 150 "$PY" benchmarks/lm_head_loss.py --device cuda --dtype bfloat16 --impl dense project trl \
  --rounds 3 --repeats 5 --threads 8 --timeout 100 --out-dir "$LOGS/lm_head"
step lm_head_1GiB_tiles 40 "$PY" benchmarks/lm_head_loss.py --device cuda --dtype bfloat16 --vocab 151936 \
  --impl dense project --project-tile-memory 1073741824 --repeats 5 --threads 8 --timeout 35 \
  --out-dir "$LOGS/tile_1GiB"
step bf16_grad_error 40 "$PY" benchmarks/bf16_grad_error.py --sizes 2048,1024,32000 \
  --impl dense-bf16 tiled-bf16 trl-bf16 --repeats 3 --threads 8
step trl_step 100 "$PY" benchmarks/trl_step.py --device cuda --fractions 0.75 \
  --variants unpatched patched patched_tiled --rounds 1 --steps 4 --warmup 2 --hidden 1024 --layers 8 \
  --vocab 32000 --completion-tokens 256 --threads 8 --timeout 90 --out-dir "$LOGS/trl_step"
cp "$LOGS/lm_head/lm_head_loss.json" "$OUT_DIR/lm_head_loss.json" 2>/dev/null
cp "$LOGS/tile_1GiB/lm_head_loss.json" "$OUT_DIR/lm_head_loss_1GiB.json" 2>/dev/null
cp "$LOGS/trl_step/trl_step.json" "$OUT_DIR/trl_step.json" 2>/dev/null
printf '\ntotal %s s\n' "$(($(date +%s) - START))" >>"$RESULTS"
echo "wrote $RESULTS"
