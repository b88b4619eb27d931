"""Running kernels for measurement: compile cache, timing, isolation.

Timing (`measure`): `warmup` untimed runs, then `iters` samples, reported as
median and spread. On a CPU (interpret mode) a sample is one call blocked
until ready: those numbers check plumbing, not speed. On a GPU a single
blocked call of a microsecond kernel measures dispatch, so a sample keeps
`calls` calls in flight and blocks once at the end (`calls` chosen so a
sample lasts about `_SAMPLE_TARGET_MS`), and reports the time per call. With
`cold_l2`, each sample is one call after a write of twice the L2's size, so
the kernel starts from HBM (dispatch is then included: use it for kernels of
tens of microseconds or more).
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
import traceback
from typing import Any, Callable, Mapping

import jax


# A GPU sample should last this long so that dispatch is amortized.
_SAMPLE_TARGET_MS = 2.0
_MAX_CALLS_PER_SAMPLE = 200
# Twice the 50-60 MB L2 of an H100/H200.
_L2_FLUSH_BYTES = 128 * 2**20


@functools.cache
def _l2_flusher():
  buf = jax.numpy.zeros((_L2_FLUSH_BYTES // 4,), jax.numpy.float32)
  bump = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  state = {"buf": buf}

  def flush():
    state["buf"] = bump(state["buf"])
    jax.block_until_ready(state["buf"])
  return flush


def measure(fn: Callable[[], Any], *, warmup: int, iters: int, on_gpu: bool, cold_l2: bool = False,
            deadline: float = float("inf")) -> dict[str, Any]:
  """Times `fn()`; returns {"median_ms", "min_ms", "max_ms", "samples",
  "calls_per_sample", "method"} (see the module docstring)."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
    if time.monotonic() > deadline:
      break
  calls, method = 1, "wall clock, one blocked call per sample"
  flush = None
  if on_gpu and cold_l2:
    flush, method = _l2_flusher(), "one call per sample after an L2 flush"
  elif on_gpu:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    one_ms = (time.perf_counter() - t0) * 1e3
    calls = max(1, min(_MAX_CALLS_PER_SAMPLE, int(_SAMPLE_TARGET_MS / max(one_ms, 1e-3))))
    method = f"{calls} calls in flight per sample, one block at the end"
  times = []
  for _ in range(max(iters, 1)):
    if flush is not None:
      flush()
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) * 1e3 / calls)
    if time.monotonic() > deadline:
      break
  return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
          "samples": len(times), "calls_per_sample": calls, "method": method}


class CompileCache:
  """Compiled executables keyed by (key, input shapes): a kernel with one
  config, or a reference, compiles once for all workloads of equal shapes."""

  def __init__(self):
    self._jitted: dict[Any, Any] = {}
    self._compiled: dict[Any, Any] = {}

  def get(self, key: Any, make: Callable[[], Callable[..., Any]], inputs: Mapping[str, jax.Array]):
    sig = tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(inputs.items()))
    if (key, sig) not in self._compiled:
      if key not in self._jitted:
        self._jitted[key] = jax.jit(make())
      self._compiled[(key, sig)] = self._jitted[key].lower(dict(inputs)).compile()
    return self._compiled[(key, sig)]


def short_error(e: BaseException) -> str:
  text = "".join(traceback.format_exception_only(type(e), e)).strip()
  return text[:4000]


# Worker threads of `run_isolated`; one left running (a timeout or Ctrl-C
# mid-call) means the process must exit without finalizing the runtime.
WORKERS: list[threading.Thread] = []


def run_isolated(fn: Callable[[], Any], timeout_s: float, timed_out: Callable[[], Any], *,
                 grace_s: float | None = None) -> Any:
  """Runs `fn` in a worker thread; past `timeout_s` + grace returns
  `timed_out()` and leaves the stuck call behind (XLA calls cannot be
  interrupted; the thread is a daemon). The default grace (10% + 5 s) lets a
  workload that checks its own deadline report itself first."""
  box: dict[str, Any] = {}

  def target():
    try:
      box["result"] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      box["error"] = e

  t = threading.Thread(target=target, daemon=True)
  WORKERS[:] = [w for w in WORKERS if w.is_alive()] + [t]
  t.start()
  t.join(timeout_s * 1.1 + 5 if grace_s is None else timeout_s + grace_s)
  if t.is_alive():
    return timed_out()
  if "error" in box:
    raise box["error"]
  return box["result"]
