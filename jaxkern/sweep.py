"""Sweeps kernel configs (block sizes, num_warps, num_stages, splits) of one
definition at given axes, over every kernel backend of its family (or the
one `--backend` names): each candidate is compiled, checked against the
reference, and timed; the candidates of all backends form one ranking and
the table ends with the fastest correct (backend, config).

  python -m jaxkern.sweep --definition=dense_gemm_bf16_nt_n4096_k4096 --axes=M=4125
  python -m jaxkern.sweep --definition=noncausal_dense_attention_h32_d64 \
      --axes=B=1,Nq=2352,Nk=51 --max_configs=8 --output=/tmp/sweep.jsonl

`--max_configs=N` runs N candidates in all, taken in turn from each
backend's list (each list starts with that backend's heuristic config), so
`--max_configs=2` on a family with two backends runs both heuristics.
A candidate that fails to compile or run is reported with the definition,
the backend's kernel, the config and the first lines of the compiler's (or
runtime's) own message.

Without a GPU the kernels run in interpret mode: correctness holds, timings
do not predict GPU performance. Each row names its timer (`jaxkern.bench`:
on a GPU the device time per call from a profiler trace, L2 flushed before
each call). With `--aot` (the default when the `aot`
extra is installed, see `jaxkern.aot`) every candidate is first compiled for
sm_90a with XLA's GPU compiler and ptxas; a config that spills registers,
overflows shared memory or fails to compile is reported (status `spills`,
`smem_overflow`, `aot_error`) and not run, so `--write_tuned` never records
one. `--lower_only` checks that every candidate
lowers for an abstract H100 instead of running it. `--write_tuned` records
each backend's fastest correct config in `configs/tuned/<device kind>.json`
for the inputs' shape bucket (see `jaxkern.tuning`); replay, sweep and
`jaxkern.ops` use it from then on for that device kind (`backend="pallas"`:
the backend whose entry is the fastest).
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

import jax
from absl import app, flags

from jaxkern import aot as aot_lib
from jaxkern import backends, bench, command_line, registry, selection, tuning
from jaxkern.aot.report import first_lines
from pallas_kernels.shared.common import resolve_interpret
from pallas_kernels.shared.lowering import lower_for_h100

_DEFINITION = flags.DEFINE_string("definition", None, "Definition name.", required=True)
_AXES = flags.DEFINE_string(
  "axes", "", "Variable axes, e.g. 'M=4125' or 'B=1,Nq=2352,Nk=51' (default: the largest recorded ones)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Input synthesis seed.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed runs per config.")
_ITERS = flags.DEFINE_integer("iters", 5, "Timed runs per config (median reported).")
_MAX_CONFIGS = flags.DEFINE_integer(
  "max_configs",
  0,
  "Run at most this many candidates in total, over all backends (taken in turn from each backend's list, "
  "heuristic first; 0 = every candidate).",
)
_INTERPRET = flags.DEFINE_bool("interpret", None, "Interpret mode (default: when no GPU is present).")
_LOWER_ONLY = flags.DEFINE_bool("lower_only", False, "Only check deviceless H100 lowering of each candidate.")
_OUTPUT = flags.DEFINE_string("output", "", "Optional JSONL file, one line per config.")
_AOT = flags.DEFINE_bool(
  "aot",
  None,
  "Compile each candidate for sm_90a first and skip those that spill or "
  "overflow shared memory (default: when the aot extra is installed).",
)
_AOT_TARGET = flags.DEFINE_string("aot_target", aot_lib.DEFAULT_TARGET, "GPU target of --aot.")
_WRITE_TUNED = flags.DEFINE_bool(
  "write_tuned", False, "Record each backend's fastest correct config in configs/tuned/<device kind>.json."
)
_BACKEND = flags.DEFINE_string(
  "backend",
  "pallas",
  "Kernel backend whose candidates run: pallas (every backend of the family) | triton | mosaic_gpu.",
)


def parse_axes(text: str) -> dict[str, int]:
  try:
    return selection.parse_axes(text)
  except ValueError as e:
    raise app.UsageError(str(e)) from None


# Row statuses of configs the sm_90a compile rejected (never run, never tuned).
AOT_REJECTED = {aot_lib.SPILLS: "spills", aot_lib.SMEM_OVERFLOW: "smem_overflow", aot_lib.ERROR: "aot_error"}


def sweep_backends(op: registry.Op, backend: str) -> tuple[str, ...]:
  """The backends a sweep covers: every one of the family's for "pallas",
  else `backend` (raising ValueError naming the op's backends if it has none)."""
  if backend == backends.PALLAS:
    return op.backends
  return (op.kernel_of(backend).backend,)


def take_candidates(per_backend: dict[str, list], limit: int) -> list[tuple[str, Any]]:
  """(backend, candidate) pairs: `limit` in all (0: every one), taken in turn
  from each backend's list, in the lists' order."""
  turns = [[(name, c) for c in configs] for name, configs in per_backend.items()]
  merged = [pair for turn in itertools.zip_longest(*turns) for pair in turn if pair is not None]
  return merged[:limit] if limit else merged


def failure_log(
  op: registry.Op, backend: str, config: Any, what: str, message: str, kernels: Sequence[str] = ()
) -> str:
  """A candidate's failure, for the log and the results line: the
  definition, the backend's kernel (with its Pallas kernels' names where
  known), the config, what failed, then the first lines of the message."""
  kernel = op.kernel_of(backend).name + (f" ({', '.join(kernels)})" if kernels else "")
  lines = first_lines(message) or "(no message)"
  return f"{op.name}: {backend} kernel {kernel}, {config}: {what}:\n" + textwrap.indent(lines, "    ")


def sweep(
  op: registry.Op,
  axes: dict[str, int],
  *,
  seed: int,
  warmup: int,
  iters: int,
  interpret: bool,
  max_configs: int,
  lower_only: bool,
  compiler: aot_lib.Compiler | None = None,
  backend: str = backends.PALLAS,
) -> list[dict]:
  """One row per (backend, candidate config): `max_configs` in all (0: every
  candidate), taken in turn from each backend's list (`take_candidates`).
  With `compiler` (a `jaxkern.aot.Compiler`), each candidate is compiled for
  sm_90a first; rejected ones are not run."""
  # Lowering needs shapes only: no inputs are synthesized for it.
  inputs: dict[str, Any] = op.input_shapes(axes) if lower_only else op.make_inputs(axes, seed=seed)
  current = op.config_for(inputs)  # what replay and ops use today (tuned or heuristic)
  names = sweep_backends(op, backend)
  heuristics = {name: op.choose_config(inputs, backend=name) for name in names}
  per_backend = {name: op.candidate_configs(inputs, backend=name) for name in names}
  candidates = [(name, c, c == heuristics[name]) for name, c in take_candidates(per_backend, max_configs)]
  ref = None if lower_only else jax.block_until_ready(jax.jit(op.reference)(inputs))
  rows = []
  for i, (name, config, is_heuristic) in enumerate(candidates, 1):
    in_use = name == current.backend and config == current.config
    row = {
      "backend": name,
      "config": tuning.config_to_json(config),
      "heuristic": is_heuristic,
      "current": in_use,
      "current_source": current.source,
      "status": None,
      "latency_ms": None,
      "timer": None,
      "log": "",
    }
    t0 = time.perf_counter()
    launch = lambda x, config=config, name=name, interpret=False: op.kernel(  # noqa: E731
      x, interpret=interpret, config=config, backend=name
    )
    if compiler is not None:
      rep = compiler.compile(launch, op.input_shapes(axes))
      row["aot"] = {
        "status": rep.status,
        "summary": rep.summary(),
        "error": rep.error,
        "kernels": [
          {
            k: getattr(kr, k)
            for k in ("name", "registers", "smem_bytes", "spill_stores", "spill_loads", "matrix_ops", "ctas_per_sm")
          }
          for kr in rep.kernels
        ],
      }
      if not rep.ok:
        row["status"] = AOT_REJECTED.get(rep.status, "aot_error")
        row["log"] = (
          failure_log(op, name, config, "sm_90a compile: " + rep.status, rep.message, [k.name for k in rep.kernels])
          if rep.message
          else rep.summary()  # spills or shared memory: the figures say it
        )
        row["seconds"], row["_config"] = time.perf_counter() - t0, config
        rows.append(row)
        shown = row["log"] if rep.message else f"{name} {config} (sm_90a: {rep.summary()})"
        print(f"[{i}/{len(candidates)}] {row['status']}, skipped: {shown}", flush=True)
        continue
    try:
      if lower_only:
        lower_for_h100(launch, inputs)
        row["status"] = "lowered"
      else:
        fn = jax.jit(functools.partial(launch, interpret=interpret))
        out = jax.block_until_ready(fn(inputs))
        assert ref is not None  # computed above unless lower_only
        cmp = op.compare(out, ref, inputs=inputs)
        row["status"] = cmp.status
        names = () if interpret else bench.pallas_call_names(fn.lower(inputs).as_text())
        t = bench.measure(
          lambda fn=fn: fn(inputs),
          warmup=warmup,
          iters=iters,
          on_gpu=not interpret,
          interpret=interpret,
          cold_l2=not interpret,
          kernel_names=names,
        )
        row["latency_ms"], row["timer"] = t["median_ms"], t["timer"]
        row["kernel_latency_ms"] = t.get("kernel_median_ms")
    except Exception as e:
      what = "lowering for an abstract H100" if lower_only else "compile or run"
      row["status"], row["log"] = "error", failure_log(op, name, config, what, bench.short_error(e))
    row["seconds"] = time.perf_counter() - t0
    row["_config"] = config
    rows.append(row)
    if row["status"] == "error":
      print(f"[{i}/{len(candidates)}] error: {row['log']}", flush=True)
      continue
    print(
      f"[{i}/{len(candidates)}] {name} {config} -> {row['status']}"
      + (f" {row['latency_ms']:.3f} ms" if row["latency_ms"] is not None else ""),
      flush=True,
    )
  return rows


def ranking(rows: list[dict]) -> list[dict]:
  """The correct, timed rows of every backend, fastest first, in one
  timer: the device timer's where any row has it (timers never mix)."""
  timed = [r for r in rows if r["status"] in ("passed", "lowered") and r["latency_ms"] is not None]
  if any(r["timer"] == bench.TIMER_DEVICE for r in timed):
    timed = [r for r in timed if r["timer"] == bench.TIMER_DEVICE]
  return sorted(timed, key=lambda r: r["latency_ms"])


def main(argv: list[str]) -> None:
  import tabulate

  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  command_line.quiet_absl_logging()
  op = registry.get(_DEFINITION.value)
  axes = op.validated_axes(parse_axes(_AXES.value) or selection.largest_recorded_axes(op.definition))
  compiler = None
  use_aot = _AOT.value if _AOT.value is not None else aot_lib.available() is None
  if use_aot:
    if aot_lib.available():
      raise app.UsageError(f"--aot: {aot_lib.available()}")
    aot_lib.skip_cuda_checks()  # before jax initializes its backends
  interpret = resolve_interpret(_INTERPRET.value)
  if use_aot:
    compiler = aot_lib.Compiler(_AOT_TARGET.value)
    print(f"sm_90a compile check on: {compiler.target}", flush=True)
  try:
    sweep_backends(op, _BACKEND.value)
  except ValueError as e:
    raise app.UsageError(f"--backend: {e}") from None
  rows = sweep(
    op,
    axes,
    seed=_SEED.value,
    warmup=_WARMUP.value,
    iters=_ITERS.value,
    interpret=interpret,
    max_configs=_MAX_CONFIGS.value,
    lower_only=_LOWER_ONLY.value,
    compiler=compiler,
    backend=_BACKEND.value,
  )
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w", encoding="utf-8") as f:
      for r in rows:
        f.write(
          json.dumps(
            {
              "definition": op.name,
              "axes": axes,
              "interpret": interpret,
              **{k: v for k, v in r.items() if k != "_config"},
            }
          )
          + "\n"
        )
  table = [
    [
      r["backend"],
      json.dumps(r["config"]),
      "*" if r["heuristic"] else "",
      r["current_source"] if r["current"] else "",
      r["status"],
      "-" if r["latency_ms"] is None else f"{r['latency_ms']:.3f}",
    ]
    + ([r["aot"]["summary"] if "aot" in r else "-"] if compiler else [])
    for r in rows
  ]
  print(
    tabulate.tabulate(
      table, headers=["backend", "config", "heuristic", "in use", "status", "ms"] + (["sm_90a"] if compiler else [])
    )
  )
  rejected = [r for r in rows if r["status"] in AOT_REJECTED.values()]
  if rejected:
    print(f"{len(rejected)} config(s) rejected by the sm_90a compile (not run, never tuned)")
  good = [r for r in rows if r["status"] in ("passed", "lowered")]
  ranked = ranking(rows)
  if ranked:
    best = ranked[0]
    print(
      f"fastest correct: {best['backend']} {best['config']} at {best['latency_ms']:.3f} ms "
      f"({best['timer']} timer)" + (" (interpret mode: not a GPU timing)" if interpret else "")
    )
    if _WRITE_TUNED.value:
      bucket = op.bucket(op.input_shapes(axes))
      kernel = op.kernel_of().name
      for name in dict.fromkeys(r["backend"] for r in ranked):  # each backend's fastest
        r = next(r for r in ranked if r["backend"] == name)
        path = tuning.record(
          kernel, name, bucket, r["_config"], latency_ms=r["latency_ms"], timer=r["timer"], definition=op.name
        )
        print(f"tuned: {kernel} {name} [{bucket}] -> {path}")
  elif _WRITE_TUNED.value:
    print("tuned: nothing written (no correct, timed config)")
  # Configs the sm_90a compile rejected are an answer, not a failure.
  sys.exit(0 if good and len(good) + len(rejected) == len(rows) else 1)


if __name__ == "__main__":
  app.run(main)
