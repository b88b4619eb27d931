"""Replay results: one JSON line per workload, in FlashInfer-Bench's
Trace / Evaluation shape (SPEC 7), typed here with a JSON round trip.

  {"definition", "workload": {"uuid", "variant", "axes", "axes_run", "scaled",
   "seed", "source"}, "solution",
   "evaluation": {"status", "log", "environment", "timestamp", "correctness",
                  "performance", "config", "config_source", "expected_output"}}

`Status` is the one status enum (shared with `jaxkern.compare`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import sys
from typing import Any, Iterable

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

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["evaluation"]["status"] = None if self.status is None else Status(self.status).value
    return out

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "Trace":
    ev = dict(data["evaluation"])
    ev["status"] = None if ev.get("status") is None else Status(ev["status"])
    known = {f.name for f in dataclasses.fields(Evaluation)}
    return cls(definition=data["definition"], solution=data.get("solution", ""),
               workload=WorkloadInfo(**data["workload"]),
               evaluation=Evaluation(**{k: v for k, v in ev.items() if k in known}))


class ResultsWriter:
  """Appends result lines, each flushed and fsynced as it is written, so a
  crash or Ctrl-C loses nothing; a torn last line of an earlier run is kept on
  its own line."""

  def __init__(self, path: str | os.PathLike, *, resume: bool):
    self.path = pathlib.Path(path)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    torn = resume and self.path.exists() and self.path.stat().st_size and not _ends_with_newline(self.path)
    self._f = open(self.path, "a" if resume else "w", encoding="utf-8")  # pylint: disable=consider-using-with
    if torn:
      self._f.write("\n")

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


def _ends_with_newline(path: pathlib.Path) -> bool:
  with open(path, "rb") as f:
    f.seek(-1, os.SEEK_END)
    return f.read(1) == b"\n"


def read_traces(path: str | os.PathLike) -> list[Trace]:
  """The complete lines of a results file (a torn last line is skipped)."""
  traces = []
  path = pathlib.Path(path)
  if path.exists():
    for line in path.read_text(encoding="utf-8").splitlines():
      try:
        traces.append(Trace.from_json(json.loads(line)))
      except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        continue
  return traces


def read_done_uuids(path: str | os.PathLike) -> set[str]:
  return {t.workload.uuid for t in read_traces(path)}


SUMMARY_HEADERS = ["definition", "n", "passed", "failed", "skipped", "kernel ms", "ref ms", "speedup",
                   "SOL ms", "SOL frac", "worst status"]


def summarize(traces: Iterable[Trace]) -> list[list[Any]]:
  """One row per definition (see SUMMARY_HEADERS). Times and ratios are
  medians over the definition's timed workloads; `SOL ms` is the roofline's
  speed of light (`jaxkern.roofline`) and `SOL frac` speed of light / kernel
  time, only where measured on a GPU ("-" otherwise)."""
  by_def: dict[str, list[Trace]] = {}
  for t in traces:
    by_def.setdefault(t.definition, []).append(t)
  rows = []
  for name, ts in sorted(by_def.items()):
    st = [t.status for t in ts]
    perf = [t.evaluation.performance for t in ts if t.evaluation.performance]

    def med(key):
      values = [p[key] for p in perf if p.get(key) is not None]
      return f"{statistics.median(values):.3g}" if values else "-"

    worst = next((s for s in Status if s in st and s != Status.PASSED), Status.PASSED)
    rows.append([name, len(ts), st.count(Status.PASSED), sum(s is not None and s.failed for s in st),
                 st.count(Status.SKIPPED), med("latency_ms"), med("reference_latency_ms"), med("speedup_factor"),
                 med("speed_of_light_ms"), med("sol_fraction"), worst.value])
  return rows


def main(argv: list[str] | None = None) -> int:
  """`python -m jaxkern.results merge --output OUT SHARD.jsonl ...`"""
  import argparse  # pylint: disable=g-import-not-at-top
  from jaxkern import shards  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(prog="python -m jaxkern.results")
  sub = parser.add_subparsers(dest="command", required=True)
  merge = sub.add_parser("merge", help="join the result files of a sharded replay (checks every uuid once)")
  merge.add_argument("--output", required=True)
  merge.add_argument("inputs", nargs="+")
  args = parser.parse_args(argv)
  try:
    n = shards.merge(args.inputs, args.output)
  except shards.MergeError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"merged {n} results from {len(args.inputs)} files into {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
