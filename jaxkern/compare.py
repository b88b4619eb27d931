"""The comparison policy (docs/replay.md, Comparison), implemented once.

* Floating outputs: an element fails only if |x-y| > atol AND |x-y| > rtol*|y|
  (the FlashInfer-Bench rule); a NaN/Inf where the reference is finite fails; a
  non-finite reference element matches only the same non-finite value (lonely
  rows report lse = +inf). Pass needs every element to match.
* Integer and bool outputs: exact.
* Top-k selections (outputs with a `TopK` policy): a row whose ids differ
  from the reference still passes ("tie-accepted") when the kernel's ids are
  valid and unique, carry the same number of -1 pads, and their reference
  scores, sorted descending, match the reference selection's sorted scores
  within the float32 tolerance. Outputs permuted with a selection
  (`PairedWith`) are compared on the ids both selected. For these outputs
  matched_ratio counts rows.
* `StateMetric` ("gdn_prefill_state"): relative RMS, relative max and worst per-(sequence,
  head) relative RMS error against thresholds.
* A shape or dtype mismatch fails outright.

Each floating output also reports `max_bound_ratio`: the worst element's
error against what the rule allows it, `|x-y| / max(atol, rtol*|y|)` (for the
state metric: the worst metric / its threshold), so an output passes exactly
when it is <= 1 (a non-finite mismatch is inf). Integer and top-k outputs
have none.

Error statistics are reduced on device so that full-size outputs never copy to
the host; top-k rows (small) are checked on the host.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_TOLERANCES: dict[str, Any] = {
  "bfloat16": {"atol": 0.005, "rtol": 0.016},
  "float32": {"atol": 2e-5, "rtol": 1e-4},
  "gdn_prefill_state": {"relative_rms": 0.01, "relative_max": 0.015, "max_head_relative_rms": 0.02},
}


class Status(str, enum.Enum):  # noqa: UP042  (StrEnum would change str(status), which logs print)
  """Every workload outcome; the first four come from comparison.
  A `str` enum: it compares equal to, and serializes as, its value."""

  PASSED = "passed"
  INCORRECT_NUMERICAL = "incorrect_numerical"
  INCORRECT_SHAPE = "incorrect_shape"
  INCORRECT_DTYPE = "incorrect_dtype"
  RUNTIME_ERROR = "runtime_error"
  COMPILE_ERROR = "compile_error"
  TIMEOUT = "timeout"
  SKIPPED = "skipped"

  def __str__(self) -> str:
    return self.value

  @property
  def failed(self) -> bool:
    return self not in (Status.PASSED, Status.SKIPPED)


PASSED = Status.PASSED
INCORRECT_NUMERICAL = Status.INCORRECT_NUMERICAL
INCORRECT_SHAPE = Status.INCORRECT_SHAPE
INCORRECT_DTYPE = Status.INCORRECT_DTYPE


@dataclasses.dataclass
class OutputComparison:
  name: str
  status: Status
  max_abs_error: float = 0.0
  max_rel_error: float = 0.0
  matched_ratio: float = 1.0
  tie_accepted_rows: int = 0
  message: str = ""
  max_bound_ratio: float | None = None  # worst |x-y| / max(atol, rtol*|y|): <= 1 when passed (module doc)

  def to_json(self) -> dict[str, Any]:
    return {k: _json_float(v) for k, v in dataclasses.asdict(self).items() if k != "name" and v is not None}


@dataclasses.dataclass
class Comparison:
  status: Status
  outputs: dict[str, OutputComparison]

  @property
  def passed(self) -> bool:
    return self.status == PASSED

  @property
  def tie_accepted_rows(self) -> int:
    return sum(o.tie_accepted_rows for o in self.outputs.values())

  def to_json(self) -> dict[str, Any]:
    return {name: o.to_json() for name, o in self.outputs.items()}


def _json_float(v: Any) -> Any:
  if isinstance(v, float) and not np.isfinite(v):
    return "inf" if v > 0 else ("-inf" if v < 0 else "nan")
  return v


def _bound_ratio(xp, diff, y, atol, rtol):
  """`diff / max(atol, rtol*|y|)` elementwise (`xp`: jnp or np): <= 1 exactly
  where the rule passes a finite pair (a zero bound: 0 or inf)."""
  bound = xp.maximum(atol, rtol * xp.abs(y))
  return xp.where(bound > 0, diff / xp.where(bound > 0, bound, 1.0), xp.where(diff > 0, xp.inf, 0.0))


@jax.jit
def _float_stats(x, y, atol, rtol):
  """(max_abs, max_rel, max_bound_ratio, matched) under the FIB rule with
  non-finite handling."""
  x = x.astype(jnp.float32)
  y = y.astype(jnp.float32)
  both_finite = jnp.isfinite(x) & jnp.isfinite(y)
  diff = jnp.where(both_finite, jnp.abs(x - y), 0.0)
  same_nonfinite = ~jnp.isfinite(y) & ((x == y) | (jnp.isnan(x) & jnp.isnan(y)))
  within = (diff <= atol) | (diff <= rtol * jnp.abs(y))
  ok = (both_finite & within) | same_nonfinite
  # A finite/non-finite disagreement is an infinite error.
  err = jnp.where(ok | both_finite, diff, jnp.inf)
  rel = jnp.where(both_finite & (y != 0), diff / jnp.abs(jnp.where(y == 0, 1.0, y)), 0.0)
  rel = jnp.where(ok | both_finite, rel, jnp.inf)
  bound = jnp.where(both_finite, _bound_ratio(jnp, diff, y, atol, rtol), jnp.where(ok, 0.0, jnp.inf))
  return jnp.max(err, initial=0.0), jnp.max(rel, initial=0.0), jnp.max(bound, initial=0.0), jnp.sum(ok)


def compare_float(name: str, x: jax.Array, y: jax.Array, atol: float, rtol: float) -> OutputComparison:
  size = int(np.prod(np.shape(y)))
  if size == 0:
    return OutputComparison(name, PASSED, max_bound_ratio=0.0)
  max_abs, max_rel, max_bound, matched = jax.device_get(_float_stats(x, y, atol, rtol))
  ratio = float(matched) / size
  status = PASSED if int(matched) == size else INCORRECT_NUMERICAL
  msg = "" if status == PASSED else f"{size - int(matched)} of {size} elements outside atol={atol}, rtol={rtol}"
  return OutputComparison(
    name, status, float(max_abs), float(max_rel), ratio, message=msg, max_bound_ratio=float(max_bound)
  )


def compare_exact(name: str, x: jax.Array, y: jax.Array) -> OutputComparison:
  size = int(np.prod(np.shape(y)))
  if size == 0:
    return OutputComparison(name, PASSED)
  matched = int(jnp.sum(jnp.asarray(x) == jnp.asarray(y)))
  diff = jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))
  status = PASSED if matched == size else INCORRECT_NUMERICAL
  return OutputComparison(
    name,
    status,
    float(jnp.max(diff)),
    0.0,
    matched / size,
    message="" if status == PASSED else f"{size - matched} of {size} elements differ",
  )


def _close(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> np.ndarray:
  """FIB rule, elementwise; a non-finite value matches only the same one
  (-inf pads on both sides; NaN and NaN, as in `_float_stats`)."""
  both = np.isfinite(a) & np.isfinite(b)
  d = np.abs(np.where(both, a, 0.0) - np.where(both, b, 0.0))
  return np.where(both, (d <= atol) | (d <= rtol * np.abs(b)), (a == b) | (np.isnan(a) & np.isnan(b)))


def check_topk_rows(x: np.ndarray, y: np.ndarray, scores: np.ndarray, atol: float, rtol: float):
  """Per row of a top-k selection: (exact, tie_accepted) boolean vectors."""
  x = x.reshape(-1, x.shape[-1]).astype(np.int64)
  y = y.reshape(-1, y.shape[-1]).astype(np.int64)
  scores = scores.reshape(x.shape[0], scores.shape[-1]).astype(np.float32)  # zero rows too
  n = scores.shape[-1]
  exact = (x == y).all(-1)
  valid = (x >= 0) & (x < n)
  well_formed = ((x == -1) | valid).all(-1)
  xs = np.sort(np.where(valid, x, -1), axis=-1)
  unique = ~((xs[:, 1:] == xs[:, :-1]) & (xs[:, 1:] >= 0)).any(-1)
  same_pads = (x == -1).sum(-1) == (y == -1).sum(-1)

  def sorted_scores(ids):
    ok = (ids >= 0) & (ids < n)
    s = np.take_along_axis(scores, np.where(ok, ids, 0), axis=-1)
    return -np.sort(-np.where(ok, s, -np.inf), axis=-1)

  scores_match = _close(sorted_scores(x), sorted_scores(y), atol, rtol).all(-1)
  # Only a different set can be a tie; the same set in another order is wrong.
  same_set = (np.sort(x, axis=-1) == np.sort(y, axis=-1)).all(-1)
  tie = ~exact & ~same_set & well_formed & unique & same_pads & scores_match
  return exact, tie


def compare_topk(name: str, x: jax.Array, y: jax.Array, scores: jax.Array, atol: float, rtol: float):
  xn, yn = np.asarray(x), np.asarray(y)
  exact, tie = check_topk_rows(xn, yn, np.asarray(scores), atol, rtol)
  rows = exact.size
  ok = exact | tie
  status = PASSED if ok.all() else INCORRECT_NUMERICAL
  out = OutputComparison(
    name,
    status,
    0.0,
    0.0,
    float(ok.mean()) if rows else 1.0,
    tie_accepted_rows=int(tie.sum()),
    message="" if ok.all() else f"{int((~ok).sum())} of {rows} rows select other ids",
  )
  return out, ok


def compare_paired(
  name: str,
  x: jax.Array,
  y: jax.Array,
  x_ids: jax.Array,
  y_ids: jax.Array,
  atol: float,
  rtol: float,
  ids_ok: np.ndarray,
) -> OutputComparison:
  """Values permuted with a selection, compared on the ids both selected."""
  k = np.shape(x)[-1]
  xv = np.asarray(x, np.float32).reshape(-1, k)
  yv = np.asarray(y, np.float32).reshape(-1, k)
  xi = np.asarray(x_ids).reshape(-1, k)
  yi = np.asarray(y_ids).reshape(-1, k)
  eq = (xi[:, :, None] == yi[:, None, :]) & (xi[:, :, None] >= 0)
  common = eq.any(-1)
  y_aligned = np.take_along_axis(yv, np.where(common, eq.argmax(-1), np.arange(k)), axis=-1)
  # Positions the kernel padded (-1) compare in place; ids only the kernel
  # selected count only in rows whose selection failed.
  positional = xi < 0
  counted = common | positional | ~ids_ok[:, None]
  ok_elem = _close(xv, y_aligned, atol, rtol) & (common | positional)
  row_ok = (ok_elem | ~counted).all(-1)
  both_finite = np.isfinite(xv) & np.isfinite(y_aligned)
  diff = np.where(counted & both_finite, np.abs(xv - y_aligned), 0.0)
  rel = np.where(y_aligned != 0, diff / np.abs(np.where(y_aligned == 0, 1, y_aligned)), 0.0)
  # Against the rule's bound, over the counted elements: a failing one that
  # has no finite pair to measure (a non-finite mismatch, an id only the
  # kernel selected) is inf.
  measured = both_finite & (common | positional)
  bound = np.where(measured, _bound_ratio(np, diff, y_aligned, atol, rtol), np.where(ok_elem, 0.0, np.inf))
  bound = np.where(counted, bound, 0.0)
  status = PASSED if row_ok.all() else INCORRECT_NUMERICAL
  return OutputComparison(
    name,
    status,
    float(diff.max(initial=0.0)),
    float(rel.max(initial=0.0)),
    float(row_ok.mean()) if row_ok.size else 1.0,
    message="" if status == PASSED else f"{int((~row_ok).sum())} rows differ",
    max_bound_ratio=float(bound.max(initial=0.0)),
  )


def compare_state(name: str, x: jax.Array, y: jax.Array, tol: Mapping[str, float]) -> OutputComparison:
  """GDN prefill final state [N, H, ...]: relative errors, per (sequence, head) too."""
  x = jnp.asarray(x, jnp.float32)
  y = jnp.asarray(y, jnp.float32)
  if x.size == 0:
    return OutputComparison(name, PASSED, max_bound_ratio=0.0)
  if not bool(jnp.all(jnp.isfinite(x))):
    inf = float("inf")
    return OutputComparison(name, INCORRECT_NUMERICAL, inf, inf, 0.0, message="non-finite state", max_bound_ratio=inf)
  d = x - y
  tiny = jnp.finfo(jnp.float32).tiny
  rel_rms = float(jnp.linalg.norm(d) / jnp.maximum(jnp.linalg.norm(y), tiny))
  max_abs = float(jnp.max(jnp.abs(d)))
  rel_max = max_abs / max(float(jnp.max(jnp.abs(y))), float(tiny))
  red = tuple(range(2, x.ndim))
  head_err = jnp.sqrt(jnp.sum(d * d, axis=red))
  head_ref = jnp.sqrt(jnp.sum(y * y, axis=red))
  head_rel = jnp.where(head_ref > 0, head_err / jnp.maximum(head_ref, tiny), jnp.where(head_err > 0, jnp.inf, 0.0))
  worst_head = float(jnp.max(head_rel))
  ok = rel_rms <= tol["relative_rms"] and rel_max <= tol["relative_max"] and worst_head <= tol["max_head_relative_rms"]
  ratio = float(jnp.mean(head_rel <= tol["max_head_relative_rms"]))
  msg = f"relative_rms={rel_rms:.3g} relative_max={rel_max:.3g} max_head_relative_rms={worst_head:.3g}"
  worst = max(rel_rms / tol["relative_rms"], rel_max / tol["relative_max"], worst_head / tol["max_head_relative_rms"])
  status = PASSED if ok else INCORRECT_NUMERICAL
  return OutputComparison(name, status, max_abs, rel_max, ratio, message=msg, max_bound_ratio=worst)


# ---------------------------------------------------------------------------
# Policies: a family declares one per output that is not compared by its dtype.


@dataclasses.dataclass(frozen=True)
class Context:
  """What a policy may look at besides its own output pair."""

  out: Mapping[str, jax.Array]
  ref: Mapping[str, jax.Array]
  inputs: Mapping[str, jax.Array] | None
  tolerances: Mapping[str, Any]
  # Per-row verdicts of selections compared so far (output name -> bool rows).
  rows_ok: dict[str, np.ndarray]

  def tolerance(self, dtype: str) -> tuple[float, float]:
    t = self.tolerances.get(dtype, self.tolerances["float32"])
    return t["atol"], t["rtol"]


class Policy:
  """How one output is compared. `after` names an output whose comparison
  must run first (its per-row verdicts land in `Context.rows_ok`)."""

  after: str | None = None

  def compare(self, name: str, x: jax.Array, y: jax.Array, spec: Any, ctx: Context) -> OutputComparison:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Float(Policy):
  """The FIB rule with the dtype's tolerances, or explicit ones."""

  atol: float | None = None
  rtol: float | None = None

  def compare(self, name, x, y, spec, ctx):
    atol, rtol = ctx.tolerance(spec.dtype if spec.dtype in ctx.tolerances else "bfloat16")
    return compare_float(
      name, x, y, self.atol if self.atol is not None else atol, self.rtol if self.rtol is not None else rtol
    )


@dataclasses.dataclass(frozen=True)
class Exact(Policy):
  def compare(self, name, x, y, spec, ctx):
    return compare_exact(name, x, y)


@dataclasses.dataclass(frozen=True)
class TopK(Policy):
  """A top-k selection of candidate ids (-1 = padding). `scores(inputs)` gives
  what the selection ranks, `[rows, candidates]` f32. Tie-aware (module docstring) when
  the inputs are known, exact otherwise."""

  scores: Callable[[Mapping[str, jax.Array]], jax.Array]

  def compare(self, name, x, y, spec, ctx):
    if ctx.inputs is None:
      return compare_exact(name, x, y)
    atol, rtol = ctx.tolerance("float32")
    result, ctx.rows_ok[name] = compare_topk(name, x, y, self.scores(ctx.inputs), atol, rtol)
    return result


@dataclasses.dataclass(frozen=True)
class PairedWith(Policy):
  """Values permuted with the selection `ids`: compared on the ids both sides
  selected (falls back to the dtype rule when the selection was exact-only)."""

  ids: str

  @property
  def after(self) -> str:
    return self.ids

  def compare(self, name, x, y, spec, ctx):
    atol, rtol = ctx.tolerance(spec.dtype)
    if self.ids not in ctx.rows_ok:
      return compare_float(name, x, y, atol, rtol)
    return compare_paired(name, x, y, ctx.out[self.ids], ctx.ref[self.ids], atol, rtol, ctx.rows_ok[self.ids])


@dataclasses.dataclass(frozen=True)
class StateMetric(Policy):
  """The `gdn_prefill_state` metric: relative RMS, relative max and worst
  per-(sequence, head) relative RMS against thresholds."""

  key: str = "gdn_prefill_state"

  def compare(self, name, x, y, spec, ctx):
    return compare_state(name, x, y, ctx.tolerances[self.key])


def default_policy(dtype: str) -> Policy:
  return Float() if dtype in ("bfloat16", "float32", "float8_e4m3fn") else Exact()


def compare(
  specs: Mapping[str, Any],
  out: Mapping[str, jax.Array],
  ref: Mapping[str, jax.Array],
  *,
  inputs: Mapping[str, jax.Array] | None = None,
  policies: Mapping[str, Policy] | None = None,
  tolerances: Mapping[str, Any] | None = None,
) -> Comparison:
  """Compares kernel outputs `out` with reference outputs `ref`, per output
  spec (`Definition.outputs`), each by its policy (default: by dtype). The
  first failing output in definition order sets the status."""
  policies = policies or {}
  ctx = Context(out=out, ref=ref, inputs=inputs, tolerances={**DEFAULT_TOLERANCES, **(tolerances or {})}, rows_ok={})
  results: dict[str, OutputComparison] = {}
  order = sorted(specs, key=lambda n: getattr(policies.get(n), "after", None) is not None)
  for name in order:
    spec = specs[name]
    if name not in out:
      results[name] = OutputComparison(name, INCORRECT_SHAPE, message="output missing")
      continue
    x, y = out[name], ref[name]
    if tuple(np.shape(x)) != tuple(np.shape(y)):
      results[name] = OutputComparison(
        name, INCORRECT_SHAPE, message=f"shape {tuple(np.shape(x))}, expected {tuple(np.shape(y))}"
      )
      continue
    if np.dtype(x.dtype) != spec.np_dtype:
      results[name] = OutputComparison(name, INCORRECT_DTYPE, message=f"dtype {x.dtype}, expected {spec.dtype}")
      continue
    results[name] = policies.get(name, default_policy(spec.dtype)).compare(name, x, y, spec, ctx)
  results = {name: results[name] for name in specs}
  status = next((r.status for r in results.values() if r.status != PASSED), PASSED)
  return Comparison(status, results)
