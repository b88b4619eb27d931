"""A results file flattened for tables and plots: one `Row` per workload,
with its worst error against the pass rule and the timer its times came from.

The pass rule (`jaxkern.compare`): an element fails only beyond both atol
and rtol*|reference|. Two figures per output:

- error / bound (`bound_ratio`): the worst element's |error| /
  max(atol, rtol*|reference|) (for the GDN prefill state: the worst of its
  metrics / threshold), the output's `max_bound_ratio`. It is <= 1 exactly
  when the output passed; results written before the field have none.
- error / atol (`worst_ratio`): max abs error / atol of the output's dtype
  (bf16 0.005, f32 2e-5), or for a relatively compared output (GDN prefill
  state) relative max error / its threshold. Above 1 can still pass (where
  rtol*|reference| is larger than atol).

Integer outputs (exact or top-k) have neither.

Timers (`evaluation.performance.timer`): `device (profiler)`, `wall` or
`interpret`. A result written before the field existed reads as `interpret`
when its environment says interpret mode, else `wall`. A workload that was
not timed (an error, a skip) takes the timer of its definition's timed
workloads when they share one, else `-`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from jaxkern import compare, dataset
from jaxkern import results as results_lib
from jaxkern.compare import Status

DEVICE, WALL, INTERPRET, NOT_TIMED = "device (profiler)", "wall", "interpret", "-"
TIMERS = (DEVICE, WALL, INTERPRET)


@functools.cache
def output_tolerances(dataset_dir: str = "") -> dict[str, dict[str, tuple[str, float] | None]]:
  """definition -> output -> (what, threshold) or None (no tolerance: an
  integer output). From the definitions' output dtypes and the families'
  comparison policies (where a family module is importable)."""
  from jaxkern import registry

  try:
    defs = dataset.load_definitions(dataset_dir or None)
  except (OSError, dataset.DatasetError):
    return {}
  tols = compare.DEFAULT_TOLERANCES
  table: dict[str, dict[str, tuple[str, float] | None]] = {}
  for name, d in defs.items():
    try:
      op = registry.get(name, dataset_dir or None)
      policies = op.impl.policies if op.impl is not None else {}
    except Exception:  # a broken family still gets dtype tolerances
      policies = {}
    per: dict[str, tuple[str, float] | None] = {}
    for out, spec in d.outputs.items():
      p = policies.get(out)
      if isinstance(p, compare.StateMetric):
        per[out] = ("relative max", float(tols[p.key]["relative_max"]))
      elif isinstance(p, compare.Float) and p.atol is not None:
        per[out] = ("atol", float(p.atol))
      elif isinstance(p, (compare.TopK, compare.Exact)) or spec.dtype not in tols:
        per[out] = None
      else:
        per[out] = ("atol", float(tols[spec.dtype]["atol"]))
    table[name] = per
  return table


def number(v: Any) -> float | None:
  """A JSON number, or "inf"/"nan" strings as floats; None otherwise."""
  if isinstance(v, bool) or v is None:
    return None
  try:
    return float(v)
  except (TypeError, ValueError):
    return None


def error_ratios(trace: results_lib.Trace, tolerances: Mapping[str, tuple[str, float] | None]) -> dict[str, float]:
  """Per output with a tolerance: its error / tolerance (see the module doc)."""
  outs = ((trace.evaluation.correctness or {}).get("outputs")) or {}
  ratios = {}
  for name, o in outs.items():
    tol = tolerances.get(name)
    if tol is None:
      continue
    err = number(o.get("max_rel_error" if tol[0] == "relative max" else "max_abs_error"))
    if err is not None:
      ratios[name] = err / tol[1] if not math.isnan(err) else math.inf
  return ratios


def bound_ratios(trace: results_lib.Trace) -> dict[str, float]:
  """Per output that records one: its worst error / the rule's bound (see the
  module doc)."""
  outs = ((trace.evaluation.correctness or {}).get("outputs")) or {}
  ratios = {name: number(o.get("max_bound_ratio")) for name, o in outs.items()}
  return {name: (math.inf if math.isnan(r) else r) for name, r in ratios.items() if r is not None}


def recorded_timer(trace: results_lib.Trace) -> str | None:
  """The timer a result names, or the one an older result implies; None
  when the workload was not timed."""
  perf = trace.evaluation.performance or {}
  if perf.get("timer"):
    return str(perf["timer"])
  if number(perf.get("latency_ms")) is None:
    return None
  return INTERPRET if trace.evaluation.environment.get("interpret") else WALL


@dataclasses.dataclass
class Row:
  """One workload, flattened for tables and plots."""

  uuid: str
  definition: str
  status: Status | None
  worst_ratio: float | None  # max over outputs of error / atol (module doc)
  worst_output: str | None
  latency_ms: float | None
  reference_ms: float | None
  sol_ms: float | None
  sol_fraction: float | None
  interpret: bool
  log: str
  axes_run: dict[str, int] | None = None  # the axes the workload ran at
  timer: str = NOT_TIMED
  backend: str = "-"  # the kernel backend that ran ("-": none recorded)
  bound_ratio: float | None = None  # max over outputs of error / the rule's bound: <= 1 when passed
  bound_output: str | None = None

  @property
  def failed(self) -> bool:
    return failed(self.status)


def failed(s: Status | None) -> bool:
  return s is not None and s.failed


def rows_of(traces: Iterable[results_lib.Trace], dataset_dir: str = "") -> list[Row]:
  tol_table = output_tolerances(dataset_dir)
  rows, timers = [], []
  for t in traces:
    ratios = error_ratios(t, tol_table.get(t.definition, {}))
    worst = max(ratios, key=ratios.__getitem__) if ratios else None
    bounds = bound_ratios(t)
    worst_bound = max(bounds, key=lambda n: bounds[n]) if bounds else None
    perf = t.evaluation.performance or {}
    rows.append(
      Row(
        uuid=t.workload.uuid,
        definition=t.definition,
        status=t.status,
        worst_ratio=ratios[worst] if worst else None,
        worst_output=worst,
        latency_ms=number(perf.get("latency_ms")),
        reference_ms=number(perf.get("reference_latency_ms")),
        sol_ms=number(perf.get("speed_of_light_ms")),
        sol_fraction=number(perf.get("sol_fraction")),
        interpret=bool(t.evaluation.environment.get("interpret")),
        log=t.evaluation.log or "",
        axes_run=t.workload.axes_run or t.workload.axes,
        backend=t.evaluation.backend or "-",
        bound_ratio=bounds[worst_bound] if worst_bound else None,
        bound_output=worst_bound,
      )
    )
    timers.append(recorded_timer(t))
  per_definition: dict[str, set[str]] = {}
  for r, timer in zip(rows, timers):
    if timer is not None:
      per_definition.setdefault(r.definition, set()).add(timer)
  for r, timer in zip(rows, timers):
    shared = per_definition.get(r.definition, set())
    r.timer = timer or (next(iter(shared)) if len(shared) == 1 else NOT_TIMED)
  return rows


def by_definition(rows: Iterable[Row]) -> dict[str, list[Row]]:
  out: dict[str, list[Row]] = {}
  for r in rows:
    out.setdefault(r.definition, []).append(r)
  return dict(sorted(out.items()))


def by_definition_backend_and_timer(rows: Iterable[Row]) -> dict[tuple[str, str, str], list[Row]]:
  """Rows per (definition, kernel backend, timer): times of different
  backends or timers never meet."""
  out: dict[tuple[str, str, str], list[Row]] = {}
  for r in rows:
    out.setdefault((r.definition, r.backend, r.timer), []).append(r)
  return dict(sorted(out.items()))


def median(values: Iterable[float | None]) -> float | None:
  vs = [v for v in values if v is not None and math.isfinite(v)]
  return statistics.median(vs) if vs else None


def fmt(v: float | None, spec: str = ".3g") -> str:
  if v is None:
    return "-"
  return "inf" if math.isinf(v) else format(v, spec)
