#!/usr/bin/env bash
# The one prepared device run (a single H100 or H200). The rule
# (docs/perf/README.md): whenever a GPU is available, this is the first run
# on it, on the committed code, before any change.
#
# Sized for one 15-minute device allowance, machine start included: about
# GPU_RUN_BUDGET_S (default 480 s) of running, in phases:
#   1. one workload per recorded variant of every definition (111), recorded
#      sizes, device timer (jax.profiler), cold L2, definitions interleaved so
#      that all are reached early, a per-workload timeout; stopped at 9/16 of
#      the budget if not done;
#   1b. the same workloads of every definition that has a second kernel
#      backend (Mosaic GPU: dense GEMM, the grouped GEMM, the attention definitions,
#      sparse and mixed MLA) on that
#      backend, same timer, into replay_mosaic_gpu.jsonl, until 11/16;
#   1c. peers (jaxkern.peers: XLA's dot, cuDNN attention, tokamax's attention
#      and ragged_dot from the kit) on phase 1's workloads they cover, same
#      timer, into peers.jsonl, until 13/16;
#   2. the remaining records, resuming phase 1's results file, until 7/8;
#   3. config sweeps at the largest recorded axes, worst SOL fraction first,
#      only with the time left;
# then the report (with the peers beside our kernels), the environment, and OUT.tar.gz holding everything. A
# phase past its time stops with SIGINT and keeps what it finished (results
# are written as they come); a stuck workload is killed at its timeout.
#
#   scripts/gpu_run.sh [OUT_DIR]        # on the GPU machine (make gpu-run)
#   DRY_RUN=1 scripts/gpu_run.sh DIR    # anywhere: the same steps at smoke
#                                       # scale, interpret mode (CI runs this)
#   GPU_RUN_DEFINITIONS=dense_gemm,moe  # only these definitions (name prefixes)
#
# The GPU machine has jax, absl-py, chex, tqdm, tabulate, safetensors and
# matplotlib but no ml_collections, no tokamax and no network: `make
# device-kit` puts the missing wheels in .whl/, which this script unpacks
# (stdlib zipfile, no pip) into one temporary folder on PYTHONPATH: two are
# compiled and qwix has a namespace package, which Python cannot import from
# a wheel. Without .git, GIT_COMMIT names the commit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/gpu_run}
PY=${PYTHON:-python3}
DRY=${DRY_RUN:-0}
DEFS=${GPU_RUN_DEFINITIONS:-}
if [ "$DRY" = 1 ]; then BUDGET=${GPU_RUN_BUDGET_S:-1200}; else BUDGET=${GPU_RUN_BUDGET_S:-480}; fi
mkdir -p "$OUT"
LOG="$OUT/run.log"
: > "$LOG"
KIT=$(mktemp -d "${TMPDIR:-/tmp}/jaxkern-kit.XXXXXX")
trap 'rm -rf "$KIT"' EXIT
for wheel in .whl/*.whl; do
  [ -f "$wheel" ] && $PY -m zipfile -e "$wheel" "$KIT"
done
[ -n "$(ls -A "$KIT")" ] && export PYTHONPATH=$KIT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

say() { echo "$*" | tee -a "$LOG"; }
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
left_until() { echo $(( START + $1 - $(date +%s) )); }

# Counts of a results file: "N results (P passed, F failed, D definitions; timers: ...)".
count() {
  $PY - "$1" <<'EOF'
import collections, sys
from jaxkern import results
traces = results.read_traces(sys.argv[1])
st = collections.Counter(t.status.value for t in traces if t.status)
timers = collections.Counter(results.timer_of(t) or "untimed" for t in traces)
print(f"{len(traces)} results ({st['passed']} passed, {sum(v for k, v in st.items() if k not in ('passed', 'skipped'))} "
      f"failed, {len({t.definition for t in traces})} definitions; timers: "
      f"{', '.join(f'{k} {v}' for k, v in sorted(timers.items()))})")
EOF
}

if [ "$DRY" = 1 ]; then
  COMMON=(--config configs/smoke.py --config.interpret=True)
  PHASE1=(--config.max_workloads_per_definition=1)
  PHASE2=(--config.max_workloads_per_variant=0 --config.max_workloads_per_definition=2
          --config.definitions="${DEFS:-gdn_decode,qsa_index}")
  SWEEP=(--lower_only)
  SWEEP_PER_BACKEND=2  # candidates per kernel backend (--max_configs caps them all)
  PEERS=(--scale=smoke --warmup=1 --iters=1 --no-cold_l2)
  SWEEP_DEFS=${GPU_RUN_SWEEP_DEFINITIONS:-${DEFS:-dense_gemm_bf16_nt_n4096_k4096,moe_router}}
else
  COMMON=(--config configs/full.py --config.warmup=3 --config.iters=10 --config.cold_l2=True)
  PHASE1=(--config.max_workloads_per_variant=1 --config.timeout_s=45)
  PHASE2=(--config.max_workloads_per_variant=0 --config.timeout_s=60)
  SWEEP=(--warmup=3 --iters=10)
  SWEEP_PER_BACKEND=8
  PEERS=(--scale=full --warmup=3 --iters=10 --cold_l2)
  SWEEP_DEFS=${GPU_RUN_SWEEP_DEFINITIONS:-$DEFS}
fi
COMMON+=(--config.order=interleave --config.progress=False --config.output="$OUT/replay.jsonl")
[ -n "$DEFS" ] && [ "$DRY" != 1 ] && PHASE2+=(--config.definitions="$DEFS")
[ -n "$DEFS" ] && PHASE1+=(--config.definitions="$DEFS")

say "== environment"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  if git rev-parse HEAD >/dev/null 2>&1; then
    echo "git commit: $(git rev-parse HEAD)"
    echo "git changes not committed: $(git status --porcelain | wc -l)"
  else
    echo "git commit: ${GIT_COMMIT:-unknown (no .git here and no GIT_COMMIT)}"
  fi
  echo "kit wheels unpacked onto PYTHONPATH: $(ls .whl/*.whl 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')"
  echo "dry run: $DRY; budget: $BUDGET s; definitions: ${DEFS:-all}"
  $PY -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0]); print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print("devices", jax.devices())' 2>&1
  $PY - <<'EOF' 2>&1
from importlib import metadata
names = sorted({d.metadata["Name"] for d in metadata.distributions()}, key=str.lower)
print("packages:", " ".join(f"{n}=={metadata.version(n)}" for n in names
                            if n.lower().startswith(("jax", "ml_collections", "ml-collections", "nvidia", "numpy",
                                                     "tokamax", "qwix"))))
EOF
  if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1; else echo "nvidia-smi: not available"; fi
} > "$OUT/env.txt"
cat "$OUT/env.txt" >> "$LOG"
head -n 6 "$OUT/env.txt"

# phase NUMBER NAME DEADLINE_S ARGS...: one replay, stopped (SIGINT) at the deadline.
phase() {
  local n=$1 name=$2 deadline=$3
  shift 3
  local left t0 code file="$OUT/replay.jsonl" arg
  for arg in "$@"; do [[ $arg == --config.output=* ]] && file=${arg#--config.output=}; done
  left=$(left_until "$deadline")
  if [ "$left" -le 10 ]; then
    say "== phase $n ($name): skipped, no time left ($(elapsed) s elapsed)"
    return
  fi
  say "== phase $n ($name): start at $(elapsed) s, budget $left s"
  t0=$(date +%s)
  timeout -s INT -k 30 "$left" $PY -m jaxkern.replay "${COMMON[@]}" "$@" 2>&1 | tee -a "$LOG"
  code=${PIPESTATUS[0]}
  say "== phase $n ($name): end after $(( $(date +%s) - t0 )) s, $([ "$code" = 124 ] && echo "stopped at its budget" || echo "exit $code"); file: $(count "$file")"
}

phase 1 "one workload per recorded variant" $(( BUDGET * 9 / 16 )) "${PHASE1[@]}"
if [ "$DRY" = 1 ]; then
  # One definition of each Mosaic GPU kernel (its interpret mode is slow).
  MOSAIC_DEFS=${GPU_RUN_MOSAIC_DEFINITIONS:-dense_gemm_bf16_nt_n4096_k4096,noncausal_dense_attention_h32_d64}
else
  # The definitions with a kernel of the second backend (their full names).
  MOSAIC_DEFS=$($PY - "$DEFS" <<'EOF'
import sys
from jaxkern import registry
wanted = [w for w in sys.argv[1].split(",") if w]
print(",".join(n for n in registry.names() if registry.get(n).implemented and "mosaic_gpu" in registry.get(n).backends
               and (not wanted or any(n.startswith(w) for w in wanted))))
EOF
)
fi
if [ -n "$MOSAIC_DEFS" ]; then
  phase 1b "the same workloads on mosaic_gpu" $(( BUDGET * 11 / 16 )) "${PHASE1[@]}" --config.backend=mosaic_gpu \
    --config.definitions="$MOSAIC_DEFS" --config.output="$OUT/replay_mosaic_gpu.jsonl"
fi
left=$(left_until $(( BUDGET * 13 / 16 )))
if [ "$left" -gt 10 ]; then
  say "== phase 1c (peers on phase 1's workloads): start at $(elapsed) s, budget $left s"
  t0=$(date +%s)
  timeout -s INT -k 15 "$left" $PY -m jaxkern.peers --results "$OUT/replay.jsonl" --out "$OUT/peers.jsonl" \
    "${PEERS[@]}" 2>&1 | tee -a "$LOG"
  code=${PIPESTATUS[0]}
  say "== phase 1c (peers): end after $(( $(date +%s) - t0 )) s, exit $code; $(wc -l < "$OUT/peers.jsonl" 2>/dev/null || echo 0) peer results"
else
  say "== phase 1c (peers): skipped, no time left ($(elapsed) s elapsed)"
fi
phase 2 "the remaining records" $(( BUDGET * 7 / 8 )) "${PHASE2[@]}" --config.resume=True

# Sweep order: worst median SOL fraction first (device-timed), then the rest.
sweep_names=$($PY - "$OUT/replay.jsonl" "$SWEEP_DEFS" <<'EOF'
import statistics, sys
from jaxkern import registry, results
wanted = [w for w in sys.argv[2].split(",") if w]
names = [n for n in registry.names() if registry.get(n).implemented and (not wanted or any(n.startswith(w) for w in wanted))]
frac = {}
for t in results.read_traces(sys.argv[1]):
  f = (t.evaluation.performance or {}).get("sol_fraction")
  if f is not None and results.timer_of(t) == "device (profiler)":
    frac.setdefault(t.definition, []).append(f)
ordered = sorted(names, key=lambda n: statistics.median(frac[n]) if n in frac else float("inf"))
print(" ".join(f"{n}:{len(registry.get(n).backends)}" for n in ordered))  # name:kernel backends
EOF
)
say "== phase 3 (sweeps, worst SOL fraction first): start at $(elapsed) s, budget $(left_until "$BUDGET") s"
t0=$(date +%s)
swept=0
for entry in $sweep_names; do
  name=${entry%:*}
  left=$(left_until "$BUDGET")
  [ "$left" -le 10 ] && { say "sweep budget spent before $name"; break; }
  [ "$left" -gt 120 ] && left=120
  say "sweep $name at its largest recorded axes (up to $left s)"
  timeout -s INT -k 15 "$left" $PY -m jaxkern.sweep --definition="$name" "${SWEEP[@]}" \
    --max_configs=$(( SWEEP_PER_BACKEND * ${entry##*:} )) --output="$OUT/sweep_$name.jsonl" 2>&1 | tail -n 4 | tee -a "$LOG"
  swept=$(( swept + 1 ))
done
say "== phase 3 (sweeps): end after $(( $(date +%s) - t0 )) s, $swept definitions swept"

say "== report"
# summary.md is the table that replaces docs/perf/<device>.md (docs/perf/README.md).
REPORTED=("$OUT/replay.jsonl")
[ -s "$OUT/replay_mosaic_gpu.jsonl" ] && REPORTED+=("$OUT/replay_mosaic_gpu.jsonl")
[ -s "$OUT/peers.jsonl" ] && REPORTED+=(--peers "$OUT/peers.jsonl")  # the peer columns: best peer, peer/ours
$PY -m jaxkern.report "${REPORTED[@]}" --out "$OUT/report" --markdown "$OUT/summary.md" 2>&1 | tee "$OUT/summary.txt" | tee -a "$LOG"
say "done after $(elapsed) s: $OUT ($(count "$OUT/replay.jsonl"))"
tar -czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
echo "tarball: $OUT.tar.gz ($(du -h "$OUT.tar.gz" | cut -f1))"
