#!/usr/bin/env bash
# The one prepared device run (a single H100 or H200): replay every definition
# at recorded sizes with GPU timing and speed-of-light fractions, then sweep
# the largest recorded workload of each definition, then write a report; all
# under one folder. The wall budget (GPU_RUN_BUDGET_S, default 450 s) is
# split between the two phases; a phase past its share is stopped with SIGINT
# and keeps what it finished (the replay writes each result as it goes).
#
#   scripts/gpu_run.sh [OUT_DIR]        # on the GPU machine
#   DRY_RUN=1 scripts/gpu_run.sh DIR    # anywhere: the same steps at smoke
#                                       # scale, interpret mode (CI runs this)
#   GPU_RUN_DEFINITIONS=dense_gemm,moe  # only these definitions (name prefixes)
#
# Everything lands in OUT_DIR, and OUT_DIR.tar.gz holds it as one file (the
# device tool brings back at most 8 files).
#
# The GPU machine has jax, absl-py, chex, tqdm, tabulate, safetensors and
# matplotlib but no ml_collections: if a .whl/ folder is here (see the README),
# its wheels are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/gpu_run}
PY=${PYTHON:-python3}
BUDGET=${GPU_RUN_BUDGET_S:-450}
DEFS=${GPU_RUN_DEFINITIONS:-}
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

if [ "${DRY_RUN:-0}" = 1 ]; then
  REPLAY=(--config configs/smoke.py --config.interpret=True)
  SWEEP=(--lower_only --max_configs=2)
else
  REPLAY=(--config configs/replay.py --config.scale=full --config.warmup=3 --config.iters=10 --config.timeout_s=120)
  SWEEP=(--warmup=3 --iters=10)
fi

echo "== environment" | tee "$OUT/run.log"
$PY -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())' 2>&1 | tee -a "$OUT/run.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null | tee -a "$OUT/run.log"

echo "== replay (budget $((BUDGET * 2 / 3)) s)" | tee -a "$OUT/run.log"
timeout -s INT $((BUDGET * 2 / 3)) $PY -m jaxkern.replay "${REPLAY[@]}" --config.progress=False \
  --config.definitions="$DEFS" --config.output="$OUT/replay.jsonl" 2>&1 | tee -a "$OUT/run.log"
echo "replay exit ${PIPESTATUS[0]}" | tee -a "$OUT/run.log"

echo "== sweeps at the largest recorded axes (budget $((BUDGET / 3)) s)" | tee -a "$OUT/run.log"
deadline=$(( $(date +%s) + BUDGET / 3 ))
for name in $($PY -c "from jaxkern import registry
wanted = [w for w in '$DEFS'.split(',') if w]
print(' '.join(n for n in registry.names()
               if registry.get(n).implemented and (not wanted or any(n.startswith(w) for w in wanted))))"); do
  left=$(( deadline - $(date +%s) ))
  [ "$left" -le 5 ] && { echo "sweep budget spent before $name" | tee -a "$OUT/run.log"; break; }
  axes=$($PY -c "from jaxkern import registry, selection; print(','.join(f'{k}={v}' for k, v in selection.largest_recorded_axes(registry.get('$name').definition).items()))")
  timeout -s INT "$left" $PY -m jaxkern.sweep --definition="$name" --axes="$axes" "${SWEEP[@]}" \
    --output="$OUT/sweep_$name.jsonl" 2>&1 | tail -n 4 | tee -a "$OUT/run.log"
done

echo "== report" | tee -a "$OUT/run.log"
$PY -m jaxkern.report "$OUT/replay.jsonl" --out "$OUT/report" 2>&1 | tee "$OUT/summary.txt" | tee -a "$OUT/run.log"
echo "done: $OUT" | tee -a "$OUT/run.log"
tar -czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
