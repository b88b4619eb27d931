"""Running kernels for measurement: compile cache, timing, isolation.

Timing is wall clock around calls blocked until ready: `warmup` untimed runs,
then the median of `iters` runs. On a CPU the kernels run in interpret mode,
so those numbers check plumbing, not speed.
"""

from __future__ import annotations

import statistics
import threading
import time
import traceback
from typing import Any, Callable, Mapping

import jax


def median_time_ms(fn: Callable[[], Any], warmup: int, iters: int, deadline: float = float("inf")) -> float:
  """Median wall time of `fn()` (blocked until ready) over `iters` runs after
  `warmup` runs; stops early at `deadline` (time.monotonic) with at least one
  timed run."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
    if time.monotonic() > deadline:
      break
  times = []
  for _ in range(max(iters, 1)):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append((time.perf_counter() - t0) * 1e3)
    if time.monotonic() > deadline:
      break
  return statistics.median(times)


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
