"""The peers beside our kernels: `python -m jaxkern.report R.jsonl --peers P.jsonl`,
P from `python -m jaxkern.peers`.

Per row group of the report (definition, kernel backend, timer), each peer
that ran on the group's workloads (matched by uuid) gets a `PeerStat`: how
many it ran and passed, and over the workloads where it passed and both it
and our kernel were timed by the group's timer ("comparable"), its median
time, ours, and the median of the per-workload ratio peer time / our time
(> 1: ours is faster). Times from different timers are never compared: on a
CPU our kernels run in interpret mode and the peers by wall clock, so there
the peer columns say `n/c` (not comparable) and only the peers table shows
the peer's own time, labelled with its timer.

The best peer of a group: the comparable one with the lowest median ratio
(the fastest against us); without a comparable one, the passed one with the
lowest median time of its own; without a passed one, none ("none passed").
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from jaxkern.compare import Status
from jaxkern.report.rows import Row, by_definition_backend_and_timer, fmt, median

if TYPE_CHECKING:
  from jaxkern.peers import PeerResult

Group = tuple[str, str, str]  # definition, kernel backend, timer
NOT_COMPARABLE = "n/c"
RATIO_HEADER = "peer/ours (>1: ours faster)"
PEER_HEADERS = ["best peer", "peer ms", RATIO_HEADER]
PEERS_TABLE_HEADERS = [
  "definition",
  "backend",
  "timer",
  "peer",
  "ran",
  "passed",
  "comparable",
  "peer timer",
  "peer ms",
  "ours ms",
  RATIO_HEADER,
]
NOTE = (
  "Peers (python -m jaxkern.peers): what a user would run instead, on the same workloads, checked against the "
  "same reference. peer ms, ours ms: medians over the workloads the peer passed where both were timed by the same "
  "timer; peer/ours: the median of the per-workload ratio peer time / our time (> 1: ours is faster). n/c: the "
  "peer was timed by another timer than our kernel (on a CPU: wall clock against interpret mode), not comparable; "
  "the peers table then shows the peer's own time under its timer."
)


@dataclasses.dataclass
class PeerStat:
  """One peer on the workloads of one row group."""

  peer: str
  ran: int
  passed: int
  comparable: int  # passed, and both times from the group's timer
  statuses: dict[str, int]  # status -> count
  peer_timer: str | None  # the timer of the peer's passed runs ("wall, interpret": several)
  peer_ms: float | None  # median over the comparable workloads, else over the passed ones (peer_timer)
  ours_ms: float | None  # median over the comparable workloads
  ratio: float | None  # median of peer / ours over the comparable workloads

  @property
  def is_comparable(self) -> bool:
    return self.ratio is not None


def _stat(name: str, group_timer: str, pairs: Sequence[tuple[PeerResult, Row]]) -> PeerStat:
  passed = [(p, r) for p, r in pairs if p.status == Status.PASSED.value and p.latency_ms is not None]
  comparable = [
    (p, r)
    for p, r in passed
    if p.timer == group_timer and r.status == Status.PASSED and r.latency_ms and math.isfinite(r.latency_ms)
  ]
  timers = sorted({p.timer or "-" for p, _ in passed})
  chosen = comparable or passed
  return PeerStat(
    peer=name,
    ran=len(pairs),
    passed=len(passed),
    comparable=len(comparable),
    statuses=dict(collections.Counter(p.status for p, _ in pairs)),
    peer_timer=", ".join(timers) if timers else None,
    peer_ms=median(p.latency_ms for p, _ in chosen),
    ours_ms=median(r.latency_ms for _, r in comparable),
    ratio=median(p.latency_ms / r.latency_ms for p, r in comparable if p.latency_ms and r.latency_ms),
  )


def peer_stats(rows: Iterable[Row], peer_results: Iterable[PeerResult]) -> dict[Group, list[PeerStat]]:
  """Per row group with a peer result on one of its workloads: each peer's
  `PeerStat`, in the order the peers first appear."""
  by_uuid: dict[tuple[str, str], list[PeerResult]] = {}
  for p in peer_results:
    by_uuid.setdefault((p.definition, p.uuid), []).append(p)
  out: dict[Group, list[PeerStat]] = {}
  for group, rs in by_definition_backend_and_timer(rows).items():
    pairs: dict[str, list[tuple[PeerResult, Row]]] = {}
    for r in rs:
      for p in by_uuid.get((r.definition, r.uuid), []):
        pairs.setdefault(p.peer, []).append((p, r))
    if pairs:
      out[group] = [_stat(name, group[2], ps) for name, ps in pairs.items()]
  return out


def best(stats: Sequence[PeerStat]) -> PeerStat | None:
  """The group's best peer (module docstring), or None when none passed."""
  comparable = [s for s in stats if s.is_comparable]
  if comparable:
    return min(comparable, key=lambda s: s.ratio or 0.0)
  passed = [s for s in stats if s.passed and s.peer_ms is not None]
  return min(passed, key=lambda s: s.peer_ms or 0.0) if passed else None


def peer_cells(stats: Sequence[PeerStat] | None) -> list[str]:
  """The PEER_HEADERS cells of a row group: '-' without peers."""
  if not stats:
    return ["-", "-", "-"]
  b = best(stats)
  if b is None:
    return ["none passed", "-", "-"]
  if not b.is_comparable:
    return [b.peer, NOT_COMPARABLE, NOT_COMPARABLE]
  return [b.peer, fmt(b.peer_ms), fmt(b.ratio)]


def peers_table(stats: dict[Group, list[PeerStat]]) -> list[list[Any]]:
  """One line per row group and peer (PEERS_TABLE_HEADERS)."""
  table = []
  for (name, backend, timer), ss in sorted(stats.items()):
    for s in ss:
      failed = ", ".join(f"{k} {v}" for k, v in sorted(s.statuses.items()) if k != Status.PASSED.value)
      table.append(
        [
          name,
          backend,
          timer,
          s.peer,
          s.ran,
          f"{s.passed}" + (f" ({failed})" if failed else ""),
          s.comparable,
          s.peer_timer or "-",
          fmt(s.peer_ms),
          fmt(s.ours_ms),
          fmt(s.ratio) if s.is_comparable else (NOT_COMPARABLE if s.passed else "-"),
        ]
      )
  return table


def against_peers(stats: dict[Group, list[PeerStat]]) -> list[str]:
  """Per timer: the geomean of the best comparable peer's ratio over the row
  groups that have one, and in how many ours is faster; then the groups whose
  peers were timed by another timer."""
  per_timer: dict[str, list[tuple[Group, float]]] = {}
  other = []
  for group, ss in sorted(stats.items()):
    b = best(ss)
    if b is not None and b.ratio is not None and b.ratio > 0:
      per_timer.setdefault(group[2], []).append((group, b.ratio))
    elif b is not None:
      other.append(group)
  lines = []
  for timer, ratios in per_timer.items():
    geomean = math.exp(sum(math.log(r) for _, r in ratios) / len(ratios))
    lines.append(
      f"Against the best peer ({timer}): geomean peer/ours {geomean:.3g} over {len(ratios)} rows; ours faster in "
      f"{sum(r > 1 for _, r in ratios)}, the peer faster in {sum(r < 1 for _, r in ratios)}."
    )
  if other:
    lines.append(
      f"Peers of {len(other)} rows were timed by another timer than our kernels: not compared ({NOT_COMPARABLE})."
    )
  return lines
