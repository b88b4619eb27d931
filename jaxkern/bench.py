"""Running kernels for measurement: compile cache and timing.

`measure` times `fn()` after `warmup` untimed calls and names its timer in
every result (`timer`):

- `"device (profiler)"` (a GPU): `iters` calls run under a `jax.profiler`
  trace, each between two separator executables, and the GPU plane's events
  give per call the op's device time (every XLA event of the call: the Pallas
  kernels plus the XLA glue around them, busy time) and the Pallas kernels'
  time (events named after the op's `pallas_call` names), as median / min /
  max. Host dispatch is not in either. With `cold_l2` the separator writes
  twice the L2 (128 MiB) so each call starts from HBM; its events are never
  counted (see `jaxkern.profile_events`).
- `"wall"`: wall clock. On a GPU it is the fallback when the trace gives no
  usable events (the reason is in `note`): a sample keeps several calls in
  flight and blocks once (time per call, so max(GPU time, dispatch)); with
  `cold_l2`, one blocked call after a flush. Without a GPU: one blocked call
  per sample.
- `"interpret"`: Pallas in interpret mode on a CPU, one blocked call per
  sample; checks plumbing, not speed.
"""

from __future__ import annotations

import functools
import pathlib
import statistics
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxkern import profile_events
from pallas_kernels.shared.lowering import triton_calls

TIMER_DEVICE = "device (profiler)"
TIMER_WALL = "wall"
TIMER_INTERPRET = "interpret"
TIMERS = (TIMER_DEVICE, TIMER_WALL, TIMER_INTERPRET)

# A wall-clock GPU sample should last this long so that dispatch is amortized.
_SAMPLE_TARGET_MS = 2.0
_MAX_CALLS_PER_SAMPLE = 200
# Twice the 50-60 MB L2 of an H100/H200.
_L2_FLUSH_BYTES = 128 * 2**20
# One trace at a time per process (device worker threads share it).
_PROFILE_LOCK = threading.Lock()


class ProfileError(Exception):
  """The trace gave no usable per-call device time (the message says why)."""


class _Separator:
  """A jitted `x + 1` on a donated buffer on one device, enqueued between
  timed calls. Its module is named so that its events are recognized and
  excluded; as the L2 flush its buffer is twice the L2."""

  def __init__(self, device: Any, flush: bool):
    name = profile_events.FLUSH if flush else profile_events.SEPARATOR
    size = _L2_FLUSH_BYTES // 4 if flush else 256

    def bump(x):
      return x + 1.0

    bump.__name__ = bump.__qualname__ = name
    self._fn = jax.jit(bump, donate_argnums=0)
    self._buf = jax.device_put(jnp.zeros((size,), jnp.float32), device)
    self()
    self.block()  # compiled and run once before anything is timed

  def __call__(self) -> None:
    self._buf = self._fn(self._buf)

  def block(self) -> None:
    jax.block_until_ready(self._buf)


@functools.cache
def _separator(device: Any, flush: bool) -> _Separator:
  return _Separator(device, flush)


def _device_of(out: Any) -> Any:
  leaves = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
  return next(iter(leaves[0].devices())) if leaves else jax.devices()[0]


def capture(run: Callable[[], None], *, in_memory: bool | None = None) -> Any:
  """`ProfileData` of a trace around `run()`: in memory where jax has
  `jax.profiler.ProfileSession` (0.12), else through the `.xplane.pb` file
  that `stop_trace` writes (0.11)."""
  if in_memory is None:
    in_memory = hasattr(jax.profiler, "ProfileSession")
  with _PROFILE_LOCK, tempfile.TemporaryDirectory(prefix="jaxkern_trace_") as log_dir:
    if in_memory:
      session = jax.profiler.ProfileSession()  # pyright: ignore[reportAttributeAccessIssue] (jax >= 0.12, checked above)
      session.start()
      try:
        run()
      finally:
        data = session.stop()
    else:
      jax.profiler.start_trace(log_dir)
      try:
        run()
      finally:
        jax.profiler.stop_trace()
      files = sorted(pathlib.Path(log_dir).rglob("*.xplane.pb"))
      if not files:
        raise ProfileError(f"the trace wrote no .xplane.pb under {log_dir}")
      data = jax.profiler.ProfileData.from_serialized_xspace(files[-1].read_bytes())
  if data is None:
    raise ProfileError("the profiler returned no data")
  return data


def between_separators(fn: Callable[[], Any], calls: int, sep: _Separator) -> None:
  """Enqueues the separator, then `calls` times `fn()` and the separator,
  and waits for all of it: each call's events lie between two separators'."""
  out = None
  sep()
  for _ in range(calls):
    out = fn()
    sep()
  jax.block_until_ready(out)
  sep.block()


def profile_calls(
  fn: Callable[[], Any],
  calls: int,
  *,
  cold_l2: bool,
  kernel_names: Sequence[str] = (),
  where: profile_events.Where | None = None,
  in_memory: bool | None = None,
) -> dict[str, Any]:
  """Device time per call of `fn` (warmed up already) from a trace of
  `calls` calls; raises ProfileError when the trace has no usable events."""
  device = _device_of(fn())
  sep = _separator(device, cold_l2)
  if where is None:
    ordinal = getattr(device, "local_hardware_id", None)
    where = profile_events.gpu_where(device.id if ordinal is None else ordinal)

  try:
    events = profile_events.xla_events(capture(lambda: between_separators(fn, calls, sep), in_memory=in_memory), where)
  except (ValueError, RuntimeError) as e:  # no such plane; a trace already running
    raise ProfileError(str(e)) from e
  per_call = profile_events.split_calls(events)
  if len(per_call) != calls:
    raise ProfileError(
      f"the trace holds the events of {len(per_call)} calls on {where.plane}, expected {calls} "
      f"({len(events)} XLA events)"
    )
  times = profile_events.call_times(per_call, profile_events.name_matcher(kernel_names))
  result = {
    "timer": TIMER_DEVICE,
    **profile_events.spread_ms([t.device_ns for t in times]),
    "samples": calls,
    "calls_per_sample": 1,
    "kernel_median_ms": None,
    "kernel_min_ms": None,
    "kernel_max_ms": None,
    "method": f"{calls} calls traced, device busy time per call" + (", L2 flushed before each" if cold_l2 else ""),
  }
  if any(t.kernel_ns for t in times):
    result.update({f"kernel_{k}": v for k, v in profile_events.spread_ms([t.kernel_ns for t in times]).items()})
  elif kernel_names:
    result["note"] = f"no device event named after the Pallas kernels {list(kernel_names)}"
  return result


def _wall(
  fn: Callable[[], Any], iters: int, *, on_gpu: bool, cold_l2: bool, deadline: float, timer: str
) -> dict[str, Any]:
  calls, method = 1, "one blocked call per sample"
  sep = None
  if on_gpu and cold_l2:
    sep, method = _separator(_device_of(fn()), True), "one blocked call per sample after an L2 flush"
  elif on_gpu:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    one_ms = (time.perf_counter() - t0) * 1e3
    calls = max(1, min(_MAX_CALLS_PER_SAMPLE, int(_SAMPLE_TARGET_MS / max(one_ms, 1e-3))))
    method = f"{calls} calls in flight per sample, one block at the end"
  times = []
  for _ in range(max(iters, 1)):
    if sep is not None:
      sep()
      sep.block()
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) * 1e3 / calls)
    if time.monotonic() > deadline:
      break
  return {
    "timer": timer,
    "median_ms": statistics.median(times),
    "min_ms": min(times),
    "max_ms": max(times),
    "samples": len(times),
    "calls_per_sample": calls,
    "method": method,
  }


def measure(
  fn: Callable[[], Any],
  *,
  warmup: int,
  iters: int,
  on_gpu: bool,
  interpret: bool = False,
  cold_l2: bool = False,
  deadline: float = float("inf"),
  kernel_names: Sequence[str] = (),
  where: profile_events.Where | None = None,
) -> dict[str, Any]:
  """Times `fn()` (see the module docstring); returns {"timer", "median_ms",
  "min_ms", "max_ms", "samples", "calls_per_sample", "method"}, plus
  "kernel_{median,min,max}_ms" from the device timer and a "note" when a
  timer fell back. `where` traces another plane than the GPU's (tests trace
  XLA:CPU this way)."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
    if time.monotonic() > deadline:
      break
  if interpret:
    return _wall(fn, iters, on_gpu=False, cold_l2=False, deadline=deadline, timer=TIMER_INTERPRET)
  note = None
  if on_gpu or where is not None:
    try:
      return profile_calls(fn, max(iters, 1), cold_l2=cold_l2, kernel_names=kernel_names, where=where)
    except Exception as e:  # a profiler that fails must not fail the workload
      note = f"device timer unavailable: {e if isinstance(e, ProfileError) else short_error(e)}"
  result = _wall(fn, iters, on_gpu=on_gpu, cold_l2=cold_l2, deadline=deadline, timer=TIMER_WALL)
  if note:
    result["note"] = note
  return result


def pallas_call_names(lowered_text: str) -> tuple[str, ...]:
  """The `pallas_call` names of a lowered module's Triton calls (their GPU
  kernels carry these names)."""
  return tuple(dict.fromkeys(call.name for call in triton_calls(lowered_text)))


class CompileCache:
  """Compiled executables keyed by (key, input shapes): a kernel with one
  config, or a reference, compiles once for all workloads of equal shapes.
  With `kernel_names`, the Pallas call names of each are kept (GPU timing
  selects their events)."""

  def __init__(self, kernel_names: bool = False):
    self._jitted: dict[Any, Any] = {}
    self._compiled: dict[Any, Any] = {}
    self._names: dict[Any, tuple[str, ...]] = {}
    self._record_names = kernel_names

  @staticmethod
  def _sig(inputs: Mapping[str, jax.Array]) -> tuple:
    return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(inputs.items()))

  def get(self, key: Any, make: Callable[[], Callable[..., Any]], inputs: Mapping[str, jax.Array]):
    entry = (key, self._sig(inputs))
    if entry not in self._compiled:
      if key not in self._jitted:
        self._jitted[key] = jax.jit(make())
      lowered = self._jitted[key].lower(dict(inputs))
      self._names[entry] = pallas_call_names(lowered.as_text()) if self._record_names else ()
      self._compiled[entry] = lowered.compile()
    return self._compiled[entry]

  def kernel_names(self, key: Any, inputs: Mapping[str, jax.Array]) -> tuple[str, ...]:
    """The Pallas call names of a compiled entry (empty unless recorded)."""
    return self._names.get((key, self._sig(inputs)), ())


def short_error(e: BaseException) -> str:
  text = "".join(traceback.format_exception_only(type(e), e)).strip()
  return text[:4000]
