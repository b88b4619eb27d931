"""Reading device time out of a `jax.profiler` trace (`ProfileData`).

A trace holds planes (a GPU: `/device:GPU:<ordinal>`; XLA:CPU's work is on
`/host:CPU`), each with lines (a GPU: one per stream, `Stream #<id>(...)`)
of events (one per kernel launch, named after the kernel; XLA annotates each
with the `hlo_module` and `hlo_op` it runs). `jaxkern.bench` traces N calls
of an op with a separator executable (its module named `SEPARATOR` or
`FLUSH`) enqueued before and after each call, so the op's events of call i
are exactly the XLA events between the i-th and (i+1)-th separator.

Pure functions over the trace: tested on real CPU traces and on synthetic
GPU-like ones (`ProfileData.from_text_proto`).
"""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# Module names (jit of a function of this name: "jit_<name>") of the
# executables bench enqueues between calls; their events are never counted.
SEPARATOR = "jaxkern_timing_separator"
FLUSH = "jaxkern_l2_flush"
GPU_STREAM_LINE = "Stream #"
CPU_PLANE = "/host:CPU"


@dataclasses.dataclass(frozen=True)
class Event:
  name: str
  start_ns: float
  duration_ns: float
  module: str  # the `hlo_module` stat


@dataclasses.dataclass(frozen=True)
class Where:
  """Which events are the device's work: those on the plane named `plane`
  (or the only plane starting with `plane_fallback` when that one is absent),
  on lines whose name starts with `line_prefix`, carrying an `hlo_module`."""

  plane: str
  line_prefix: str = ""
  plane_fallback: str = ""


def gpu_where(ordinal: int) -> Where:
  """A GPU's kernel events: its plane, its streams (not derived lines)."""
  return Where(f"/device:GPU:{ordinal}", GPU_STREAM_LINE, "/device:GPU:")


def _stats(e: Any) -> dict[str, Any]:
  with warnings.catch_warnings():  # nanobind's stats type warns when iterated
    warnings.simplefilter("ignore", DeprecationWarning)
    return dict(e.stats)


def xla_events(profile: Any, where: Where) -> list[Event]:
  """The events of `where` that XLA annotated with a module, by start time.
  ValueError when the plane is not in the trace."""
  planes = {p.name: p for p in profile.planes}
  plane = planes.get(where.plane)
  if plane is None and where.plane_fallback:
    candidates = [p for n, p in planes.items() if n.startswith(where.plane_fallback)]
    plane = candidates[0] if len(candidates) == 1 else None
  if plane is None:
    raise ValueError(f"no plane {where.plane!r} in the trace (planes: {sorted(planes)})")
  out = []
  for line in plane.lines:
    if not line.name.startswith(where.line_prefix):
      continue
    for e in line.events:
      module = _stats(e).get("hlo_module")
      if module is not None:
        out.append(Event(e.name, float(e.start_ns), float(e.duration_ns), str(module)))
  return sorted(out, key=lambda e: e.start_ns)


def is_separator(e: Event) -> bool:
  return SEPARATOR in e.module or FLUSH in e.module


def split_calls(events: Iterable[Event], separator: Callable[[Event], bool] = is_separator) -> list[list[Event]]:
  """The op's events per call: each run of non-separator events that has a
  separator before and after it (events outside the first and last
  separator belong to no complete call and are dropped)."""
  calls: list[list[Event]] = []
  current: list[Event] | None = None  # None until the first separator
  for e in events:
    if separator(e):
      if current:
        calls.append(current)
      current = []
    elif current is not None:
      current.append(e)
  return calls


def name_matcher(names: Sequence[str]) -> Callable[[str], bool]:
  """True for an event named after one of `names` (Pallas call names; XLA
  may add a suffix to a repeated kernel name)."""
  names = tuple(n for n in names if n)
  return lambda event_name: any(event_name == n or event_name.startswith(n) for n in names)


@dataclasses.dataclass(frozen=True)
class CallTime:
  device_ns: float  # every XLA event of the call: kernels plus glue (busy time, gaps excluded)
  kernel_ns: float  # the events `is_kernel` selects


def call_times(calls: Sequence[Sequence[Event]], is_kernel: Callable[[str], bool]) -> list[CallTime]:
  return [CallTime(sum(e.duration_ns for e in c), sum(e.duration_ns for e in c if is_kernel(e.name))) for c in calls]


def spread_ms(values_ns: Sequence[float]) -> dict[str, float]:
  """{"median_ms", "min_ms", "max_ms"} of nanosecond values."""
  ms = [v / 1e6 for v in values_ns]
  return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}
