"""The report's tables: per definition, kernel backend and timer, against a baseline run,
and the summary a device run's page (`docs/perf/<device>.md`) holds."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jaxkern.compare import Status
from jaxkern.report.peer_table import NOTE, PEER_HEADERS, Group, PeerStat, against_peers, peer_cells
from jaxkern.report.rows import Row, by_definition_backend_and_timer, failed, fmt, median

HEADERS = [
  "definition",
  "backend",
  "timer",
  "n",
  "passed",
  "failed",
  "skipped",
  "worst err/bound",
  "worst err/atol",
  "kernel ms",
  "ref ms",
  "SOL ms",
  "SOL frac",
]
FAILED_COLUMN = HEADERS.index("failed")
# What the two error columns mean: printed under the table, on the page and in the plot.
ERROR_RULE = (
  "An element fails only beyond both atol and rtol*|reference|. worst err/bound: the worst element's "
  "|kernel - reference| / max(atol, rtol*|reference|) (GDN prefill state: worst metric / threshold), "
  "<= 1 on every passed workload. worst err/atol: max abs error / atol alone, which a passed workload "
  "can exceed where rtol*|reference| allows more."
)
BASELINE_HEADERS = [
  "definition",
  "matched",
  "axes differ",
  "fixed",
  "broke",
  "other changes",
  "failing in both",
  "only here",
  "only in baseline",
  "latency ratio",
]
SUMMARY_HEADERS = [
  "definition",
  "backend",
  "timer",
  "passed / total",
  "kernel ms (median)",
  "reference ms (median)",
  "SOL fraction (median)",
]
FURTHEST = 5  # definitions listed as furthest from their speed of light


def _counts(rows: Sequence[Row]) -> list[int]:
  return [
    len(rows),
    sum(r.status == Status.PASSED for r in rows),
    sum(r.failed for r in rows),
    sum(r.status == Status.SKIPPED for r in rows),
  ]


def definition_table(rows: list[Row], peers: dict[Group, list[PeerStat]] | None = None) -> list[list[Any]]:
  """One line per definition, backend and timer (HEADERS, and with `peers`
  PEER_HEADERS: `jaxkern.report.peer_table`), then a total line."""
  table = []
  for (name, backend, timer), rs in by_definition_backend_and_timer(rows).items():
    table.append(
      [
        name,
        backend,
        timer,
        *_counts(rs),
        _worst([(r.bound_ratio, r.bound_output) for r in rs]),
        _worst([(r.worst_ratio, r.worst_output) for r in rs]),
        fmt(median(r.latency_ms for r in rs)),
        fmt(median(r.reference_ms for r in rs)),
        fmt(median(r.sol_ms for r in rs)),
        fmt(median(r.sol_fraction for r in rs)),
      ]
    )
    if peers is not None:
      table[-1] += peer_cells(peers.get((name, backend, timer)))
  table.append(
    ["total", "", "", *_counts(rows), "", "", "", "", "", ""] + [""] * len(PEER_HEADERS) * (peers is not None)
  )
  return table


def _worst(ratios: list[tuple[float | None, str | None]]) -> str:
  """The largest ratio and its output, `0.5 (C)`; "-" when there is none."""
  known = [(v, output) for v, output in ratios if v is not None]
  if not known:
    return "-"
  value, output = max(known, key=lambda x: x[0])
  return f"{fmt(value)} ({output})"


# --------------------------------------------------------------------------
# Against a baseline.


@dataclasses.dataclass
class Change:
  uuid: str
  definition: str
  before: Status | None
  after: Status | None
  latency_ratio: float | None  # this run / baseline; None unless both ran at the same axes, backend and timer
  same_axes: bool = True


def compare_runs(rows: list[Row], base: list[Row]) -> tuple[list[Change], list[Row], list[Row]]:
  """Workloads in both runs (by uuid) with their status and latency change
  (only between runs at the same axes, backend and timer: a CPU run shrinks
  them); then the rows only in this run and only in the baseline."""
  base_by = {r.uuid: r for r in base}
  here = {r.uuid for r in rows}
  changes = []
  for r in rows:
    b = base_by.get(r.uuid)
    if b is None:
      continue
    same = r.axes_run == b.axes_run
    comparable = same and r.timer == b.timer and r.backend == b.backend
    ratio = r.latency_ms / b.latency_ms if comparable and r.latency_ms is not None and b.latency_ms else None
    changes.append(Change(r.uuid, r.definition, b.status, r.status, ratio, same))
  return changes, [r for r in rows if r.uuid not in base_by], [b for b in base if b.uuid not in here]


def change_kind(c: Change) -> str:
  """`fixed`, `broke`, `other` (another status change), `failing` (failed
  in both runs) or `same`."""
  if c.before == c.after:
    return "failing" if failed(c.after) else "same"
  if c.after == Status.PASSED and failed(c.before):
    return "fixed"
  if c.before == Status.PASSED and failed(c.after):
    return "broke"
  return "other"


def baseline_table(changes: list[Change], only_here: list[Row], only_base: list[Row]) -> list[list[Any]]:
  names = sorted({c.definition for c in changes} | {r.definition for r in only_here + only_base})
  table = []
  for name in names:
    cs = [c for c in changes if c.definition == name]
    kinds = [change_kind(c) for c in cs]
    table.append(
      [
        name,
        len(cs),
        sum(not c.same_axes for c in cs),
        kinds.count("fixed"),
        kinds.count("broke"),
        kinds.count("other"),
        kinds.count("failing"),
        sum(r.definition == name for r in only_here),
        sum(r.definition == name for r in only_base),
        fmt(median(c.latency_ratio for c in cs)),
      ]
    )
  return table


# --------------------------------------------------------------------------
# The summary of a run (the device page).


@dataclasses.dataclass
class SummaryLine:
  definition: str
  backend: str
  timer: str
  passed: int
  total: int
  kernel_ms: float | None
  reference_ms: float | None
  sol_fraction: float | None


def summary_lines(rows: list[Row]) -> list[SummaryLine]:
  """Per definition, backend and timer: passed / total and the medians."""
  return [
    SummaryLine(
      name,
      backend,
      timer,
      sum(r.status == Status.PASSED for r in rs),
      len(rs),
      median(r.latency_ms for r in rs),
      median(r.reference_ms for r in rs),
      median(r.sol_fraction for r in rs),
    )
    for (name, backend, timer), rs in by_definition_backend_and_timer(rows).items()
  ]


def sol_by_timer(lines: list[SummaryLine]) -> dict[str, tuple[float, int, list[SummaryLine]]]:
  """Per timer with SOL fractions: the geometric mean of the definitions'
  median SOL fractions, how many definitions it covers, and the definitions
  furthest from their speed of light (lowest fraction first)."""
  out = {}
  for timer in sorted({l.timer for l in lines}):
    measured = [
      (l.sol_fraction, l) for l in lines if l.timer == timer and l.sol_fraction is not None and l.sol_fraction > 0
    ]
    if measured:
      geomean = math.exp(sum(math.log(f) for f, _ in measured) / len(measured))
      furthest = sorted(measured, key=lambda fl: fl[0])[:FURTHEST]
      out[timer] = (geomean, len(measured), [l for _, l in furthest])
  return out


def _md_row(cells: Sequence[Any]) -> str:
  return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def summary_markdown(
  rows: list[Row], *, title: str, source: str, environment: str, peers: dict[Group, list[PeerStat]] | None = None
) -> str:
  """The summary table as a markdown page: per definition (and timer)
  passed / total and median kernel, reference and SOL fraction (with
  `peers`: the best peer, its time and peer/ours); then per timer the
  geomean SOL fraction and the definitions furthest from their speed of
  light (and the geomean peer/ours). Different timers are never mixed in one
  figure."""
  lines = summary_lines(rows)
  headers = SUMMARY_HEADERS + (PEER_HEADERS if peers is not None else [])
  out = [
    f"# {title}",
    "",
    f"Results: `{source}` ({len(rows)} workloads). Environment: {environment}.",
    "",
    "Times are medians over each definition's workloads, per timer (`device (profiler)`: kernel time on the "
    "device from jax's profiler; `wall`: wall clock around calls; `interpret`: CPU interpret mode, which "
    "checks plumbing, not speed). SOL fraction: the roofline's speed of light / kernel time.",
    "",
    _md_row(headers),
    "|" + " --- |" * len(headers),
  ]
  for l in lines:
    out.append(
      _md_row(
        [
          f"`{l.definition}`",
          l.backend,
          l.timer,
          f"{l.passed} / {l.total}",
          fmt(l.kernel_ms),
          fmt(l.reference_ms),
          fmt(l.sol_fraction),
          *(peer_cells(peers.get((l.definition, l.backend, l.timer))) if peers is not None else []),
        ]
      )
    )
  passed, total = sum(l.passed for l in lines), sum(l.total for l in lines)
  out += ["", f"Passed: {passed} / {total} workloads in {len({l.definition for l in lines})} definitions.", ""]
  sol = sol_by_timer(lines)
  if not sol:
    out.append("No SOL fraction: no workload was timed on a GPU.")
  for timer, (geomean, n, furthest) in sol.items():
    out += [
      f"Geomean SOL fraction ({timer}): {geomean:.3g} over {n} definitions. Furthest from their speed of light:",
      "",
    ]
    out += [f"{i}. `{l.definition}`: {fmt(l.sol_fraction)}" for i, l in enumerate(furthest, 1)]
    out.append("")
  if peers is not None:
    out += ["", NOTE, "", *against_peers(peers)] if peers else ["", "Peers: none ran on these workloads."]
  return "\n".join(out).rstrip() + "\n"
