"""Replay results: one JSON line per workload, in a shape modelled on
FlashInfer-Bench's Trace / Evaluation (`jaxkern.fib.export` writes
them as FIB traces), typed here with a JSON round trip.

  {"definition", "workload": {"uuid", "variant", "axes", "axes_run", "scaled",
   "seed", "source"}, "solution",
   "evaluation": {"status", "log", "environment", "timestamp", "correctness",
                  "performance", "backend", "config", "config_source", "expected_output"}}

`evaluation.performance.timer` names the timer of every timed result
(`jaxkern.bench`); `summarize` keeps one row per definition, backend and timer.
Readers report lines that are not results (a truncated last line among
them) instead of dropping them silently; `ResultsWriter` never replaces a
file that holds results. `Status` is the one status enum (shared with
`jaxkern.compare`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import sys
from collections.abc import Callable, Iterable
from typing import Any

from jaxkern.compare import Status


@dataclasses.dataclass
class WorkloadInfo:
  uuid: str
  variant: str | None
  axes: dict[str, int]
  seed: int
  source: str
  axes_run: dict[str, int] | None = None
  scaled: bool = False


@dataclasses.dataclass
class Evaluation:
  status: Status | None
  environment: dict[str, Any]
  timestamp: str
  log: str = ""
  correctness: dict[str, Any] | None = None
  performance: dict[str, Any] | None = None
  backend: str | None = None  # the kernel backend that ran ("triton", "mosaic_gpu")
  config: dict[str, Any] | None = None
  config_source: str | None = None
  expected_output: dict[str, Any] | None = None


@dataclasses.dataclass
class Trace:
  definition: str
  workload: WorkloadInfo
  evaluation: Evaluation
  solution: str = ""

  def __post_init__(self):
    if not self.solution:
      self.solution = f"jaxkern.pallas:{self.definition}"

  @property
  def status(self) -> Status | None:
    return self.evaluation.status

  @property
  def failed(self) -> bool:
    """Evaluated, and not passed or skipped."""
    return self.status is not None and self.status.failed

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["evaluation"]["status"] = None if self.status is None else Status(self.status).value
    return out

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> Trace:
    ev = dict(data["evaluation"])
    ev["status"] = None if ev.get("status") is None else Status(ev["status"])
    known = {f.name for f in dataclasses.fields(Evaluation)}
    return cls(
      definition=data["definition"],
      solution=data.get("solution", ""),
      workload=WorkloadInfo(**data["workload"]),
      evaluation=Evaluation(**{k: v for k, v in ev.items() if k in known}),
    )


class ResultsWriter:
  """Appends result lines, each flushed and fsynced as it is written, so a
  crash or Ctrl-C loses nothing. Never destroys results: without `resume` a
  non-empty file is refused (FileExistsError); with it, a truncated last
  line (a run cut off mid-write; `read_results` reports it) is cut off
  before appending."""

  def __init__(self, path: str | os.PathLike, *, resume: bool):
    self.path = pathlib.Path(path)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    size = self.path.stat().st_size if self.path.exists() else 0
    if size and not resume:
      raise FileExistsError(f"{self.path} already holds results; append with resume, or write elsewhere")
    self._f = open(self.path, "a", encoding="utf-8")
    if size:
      self._f.truncate(_complete_size(self.path))

  def write(self, trace: Trace) -> None:
    self._f.write(json.dumps(trace.to_json()) + "\n")
    self._f.flush()
    os.fsync(self._f.fileno())

  def close(self) -> None:
    self._f.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _complete_size(path: pathlib.Path) -> int:
  """Bytes up to and including the last newline."""
  data = path.read_bytes()
  return data.rfind(b"\n") + 1


@dataclasses.dataclass(frozen=True)
class BadLine:
  path: str
  line: int
  reason: str
  truncated: bool  # the last line, without its newline: a write that was cut off

  def __str__(self) -> str:
    return f"{self.path}:{self.line}: {self.reason}"


def read_results(path: str | os.PathLike) -> tuple[list[Trace], list[BadLine]]:
  """The result lines of a file, and the lines that are not results (a
  truncated last line among them); an absent file has neither."""
  traces, bad = [], []
  path = pathlib.Path(path)
  if not path.exists():
    return traces, bad
  text = path.read_text(encoding="utf-8", errors="replace")
  lines = text.split("\n")
  complete = text.endswith("\n") or not text
  for i, line in enumerate(lines[:-1] if complete else lines, 1):
    truncated = not complete and i == len(lines)
    try:
      traces.append(Trace.from_json(json.loads(line)))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
      reason = (
        "truncated last line (a run was cut off while writing it)"
        if truncated
        else f"not a result line ({type(e).__name__}: {str(e)[:80]})"
      )
      bad.append(BadLine(str(path), i, reason, truncated))
  return traces, bad


def read_traces(path: str | os.PathLike, *, on_bad_line: Callable[[BadLine], None] | None = None) -> list[Trace]:
  """The result lines of a file; each line that is not one is reported to
  `on_bad_line` (default: a warning on stderr) and skipped."""
  traces, bad = read_results(path)
  for b in bad:
    if on_bad_line is None:
      print(f"warning: {b}; skipped", file=sys.stderr)
    else:
      on_bad_line(b)
  return traces


def read_done_uuids(path: str | os.PathLike) -> set[str]:
  return {t.workload.uuid for t in read_results(path)[0]}


SUMMARY_HEADERS = [
  "definition",
  "backend",
  "timer",
  "n",
  "passed",
  "failed",
  "skipped",
  "kernel ms",
  "ref ms",
  "speedup",
  "SOL ms",
  "SOL frac",
  "worst status",
]


def timer_of(t: Trace) -> str | None:
  """The timer that measured a result (`jaxkern.bench`: "device (profiler)",
  "wall" or "interpret"); None when it was not timed."""
  return (t.evaluation.performance or {}).get("timer")


def summarize(traces: Iterable[Trace]) -> list[list[Any]]:
  """One row per definition, kernel backend and timer (see SUMMARY_HEADERS):
  numbers made by different backends or timers are never mixed. Untimed
  results (failures) count in the row of their definition and backend's
  most used timer. Times and ratios are
  medians over the row's timed workloads; `SOL ms` is the roofline's speed
  of light (`jaxkern.roofline`) and `SOL frac` speed of light / kernel time,
  only where measured on a GPU ("-" otherwise)."""
  by_def: dict[tuple[str, str], list[Trace]] = {}
  for t in traces:
    by_def.setdefault((t.definition, t.evaluation.backend or "-"), []).append(t)
  rows = []
  for (name, backend), ts in sorted(by_def.items()):
    timers = [timer_of(t) for t in ts if timer_of(t)]
    main_timer = max(set(timers), key=timers.count) if timers else None
    groups: dict[str | None, list[Trace]] = {}
    for t in ts:
      groups.setdefault(timer_of(t) or main_timer, []).append(t)
    for timer, group in sorted(groups.items(), key=lambda kv: (kv[0] != main_timer, kv[0] or "")):
      rows.append(_summary_row(name, backend, timer, group))
  return rows


def _summary_row(name: str, backend: str, timer: str | None, ts: list[Trace]) -> list[Any]:
  st = [t.status for t in ts]
  perf = [t.evaluation.performance for t in ts if t.evaluation.performance]

  def med(key):
    values = [p[key] for p in perf if p.get(key) is not None]
    return f"{statistics.median(values):.3g}" if values else "-"

  worst = next((s for s in Status if s in st and s != Status.PASSED), Status.PASSED)
  return [
    name,
    backend,
    timer or "-",
    len(ts),
    st.count(Status.PASSED),
    sum(s is not None and s.failed for s in st),
    st.count(Status.SKIPPED),
    med("latency_ms"),
    med("reference_latency_ms"),
    med("speedup_factor"),
    med("speed_of_light_ms"),
    med("sol_fraction"),
    worst.value,
  ]
