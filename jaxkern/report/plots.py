"""The report's plots (matplotlib, Agg). Every failed or errored workload is
drawn in every plot: one without the plotted value (a runtime error has no
error or time) sits in a shaded "error" band at the edge of the axis, in red.
Each definition has its own colour and marker, and every axis is labelled.

Each `*_figure` function returns the figure (tests read its artists);
`plot_*` saves it as a PNG."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence

from jaxkern.compare import Status
from jaxkern.report.rows import Row, by_definition, failed
from jaxkern.report.tables import Change, change_kind

PASS, FAIL, OTHER = "#2a9d3f", "#d62728", "#888888"
BAND = "#fde8e8"
# 21 colours for the definitions: matplotlib's tab20 without its two reds
# (red means failure here) and three of tab20b's dark tones.
PALETTE = (
  "#1f77b4",
  "#aec7e8",
  "#ff7f0e",
  "#ffbb78",
  "#2ca02c",
  "#98df8a",
  "#9467bd",
  "#c5b0d5",
  "#8c564b",
  "#c49c94",
  "#e377c2",
  "#f7b6d2",
  "#7f7f7f",
  "#c7c7c7",
  "#bcbd22",
  "#dbdb8d",
  "#17becf",
  "#9edae5",
  "#393b79",
  "#637939",
  "#7b4173",
)
# Five markers: with 21 colours (coprime) the pairs stay distinct for 105
# definitions, and a tab20 dark/light pair (neighbours) never shares a marker.
MARKERS = ("o", "s", "D", "^", "v")


def pyplot():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def status_color(s: Status | None) -> str:
  return PASS if s == Status.PASSED else (FAIL if failed(s) else OTHER)


def definition_styles(names: Sequence[str]) -> dict[str, tuple[str, str]]:
  """(colour, marker) per definition, by sorted name."""
  return {n: (PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)]) for i, n in enumerate(sorted(set(names)))}


def _height(n: int) -> float:
  return max(3.0, 0.32 * n + 1.6)


def _strip(ax, names: list[str], points: dict[str, list[tuple[float, str, str]]]) -> None:
  """Points per definition on horizontal lanes (value, colour, marker), one
  scatter per colour and marker."""
  groups: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
  for i, name in enumerate(names):
    pts = points.get(name, [])
    for j, (v, color, marker) in enumerate(pts):
      jitter = ((j % 7) - 3) * 0.05 if len(pts) > 1 else 0.0
      xs, ys = groups.setdefault((color, marker), ([], []))
      xs.append(v)
      ys.append(i + jitter)
  for (color, marker), (xs, ys) in groups.items():
    ax.scatter(xs, ys, s=22, c=color, marker=marker, linewidths=1.0, zorder=3)
  ax.set_yticks(range(len(names)))
  ax.set_yticklabels(names, fontsize=7)
  ax.set_ylim(-0.6, len(names) - 0.4)
  ax.invert_yaxis()
  ax.grid(axis="x", alpha=0.3)
  ax.set_ylabel("definition")


def _error_band(ax, axis: str, start: float, end: float, at: float, text: str) -> None:
  """A shaded band from `start` to `end` on `axis` ("x" or "y"), where values
  that do not exist are drawn (at `at`), named `text`."""
  # Tick labels stop before the band: its position is no value.
  if axis == "x":
    ax.axvspan(start, end, color=BAND, zorder=0)
    ax.text(at, 1.005, text, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=7, color=FAIL)
    lo = ax.get_xlim()[0]
    ax.set_xticks([t for t in ax.get_xticks() if lo <= t < start])
    ax.set_xlim(lo, end)
  else:
    ax.axhspan(start, end, color=BAND, zorder=0)
    ax.text(
      1.005, at, text, transform=ax.get_yaxis_transform(), ha="left", va="center", fontsize=7, color=FAIL, rotation=90
    )
    lo = ax.get_ylim()[0]
    ax.set_yticks([t for t in ax.get_yticks() if lo <= t < start])
    ax.set_ylim(lo, end)


def _no_data(ax, text: str) -> None:
  ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="#555555")
  ax.set_xticks([])
  ax.set_yticks([])


def _legend(ax, entries: list[tuple[str, str, str]], **kw) -> None:
  """A legend of (label, colour, marker) entries."""
  from matplotlib.lines import Line2D

  handles = [Line2D([], [], ls="", marker=m, color=c, markersize=6, label=l) for l, c, m in entries]
  ax.legend(handles=handles, fontsize=7, **kw)


def _value_strip(
  ax,
  names: list[str],
  points: dict[str, list[tuple[float, str, str]]],
  *,
  scale: str,
  lo: float,
  band: float,
  error_x: float,
  xlabel: str,
  legend: list[tuple[str, str, str]],
) -> None:
  """Lanes of values from `lo`, a dashed line at 1, and the error band from
  `band` on (failed workloads without a value are drawn at `error_x`)."""
  _strip(ax, names, points)
  ax.set_xscale(scale)
  end = error_x * error_x / band if scale == "log" else 2 * error_x - band  # `error_x` mid-band
  ax.set_xlim(lo, end)
  _error_band(ax, "x", band, end, error_x, "error")
  ax.axvline(1.0, color="black", lw=1, ls="--")
  ax.set_xlabel(xlabel, fontsize=8)
  _legend(ax, legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def error_value(r: Row) -> tuple[float | None, bool]:
  """What the error plot draws for a row: (its error against the rule's
  bound, True), or for a result without that figure (error / atol, False)."""
  if r.bound_ratio is not None:
    return r.bound_ratio, True
  return r.worst_ratio, False


def errors_figure(rows: list[Row]):
  """Each workload's worst error against the pass bound per definition
  (error / atol, hollow, for results without the bound figure); failed
  workloads without error values in the error band."""
  plt = pyplot()
  by = by_definition(rows)
  names = list(by)
  fig, ax = plt.subplots(figsize=(10, _height(len(names))))
  values = {id(r): error_value(r) for r in rows}
  finite = [v for v, _ in values.values() if v is not None and math.isfinite(v) and v > 0]
  floor = min(min(finite, default=1e-3) / 2, 1e-3)
  ceiling = max(max(finite, default=1.0) * 4, 10.0)
  error_x = ceiling * 6
  points = {}
  for name, rs in by.items():
    points[name] = []
    for r in rs:
      v, bound = values[id(r)]
      if v is None:
        continue
      marker = "x" if math.isinf(v) else ("o" if bound else "$\\circ$")
      points[name].append((min(max(v, floor), ceiling), status_color(r.status), marker))
    points[name] += [(error_x, FAIL, "X") for r in rs if values[id(r)][0] is None and r.failed]
  legend = [
    ("passed", PASS, "o"),
    ("failed", FAIL, "o"),
    ("non-finite error", FAIL, "x"),
    ("failed, no error values (e.g. runtime error)", FAIL, "X"),
  ]
  if any(not bound and v is not None for v, bound in values.values()):
    legend.append(("error / atol (result without the bound: passes above 1 too)", OTHER, "$\\circ$"))
  if any(points.values()):
    _value_strip(
      ax,
      names,
      points,
      scale="log",
      lo=floor / 1.5,
      band=ceiling * 2.5,
      error_x=error_x,
      xlabel="worst output error / its bound max(atol, rtol*|ref|) (1, dashed: the bound; beyond it an element "
      f"fails; x = non-finite; 0 drawn at {floor:.0e}; error band: failed without error values)",
      legend=legend,
    )
  else:
    _no_data(ax, "no floating-point output errors and no failures in these results")
  ax.set_title(
    "Error vs the pass bound per workload (an element fails only beyond both atol and rtol*|reference|)",
    fontsize=10,
    pad=14,
  )
  return fig


def latency_figure(rows: list[Row]):
  """Kernel vs reference time per workload (log-log), by definition; failed
  workloads ringed in red, those without a time in the error bands."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(10, 6.5))
  timed = [r for r in rows if r.latency_ms and r.reference_ms]
  shown = [r for r in rows if (r.latency_ms and r.reference_ms) or r.failed]
  if shown:
    values = [v for r in shown for v in (r.latency_ms, r.reference_ms) if v] or [1.0]
    lo, hi = min(values) / 2, max(values) * 2
    error_at = hi * 6
    styles = definition_styles([r.definition for r in rows])
    for name, rs in by_definition(shown).items():
      color, marker = styles[name]
      # Missing times spread over the band (x1.25 steps) so that coinciding errors stay countable.
      spread = [error_at * 1.25 ** ((j % 5) - 2) for j in range(len(rs))]
      xs = [r.reference_ms or s for r, s in zip(rs, spread)]
      ys = [r.latency_ms or s for r, s in zip(rs, spread)]
      ax.scatter(xs, ys, s=24, color=color, marker=marker, label=name, zorder=3)
      bad = [(x, y) for r, x, y in zip(rs, xs, ys) if r.failed]
      if bad:
        ax.scatter(*zip(*bad), s=90, facecolors="none", edgecolors=FAIL, linewidths=1.4, zorder=4)
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, ls="--", label="kernel = reference")
    ax.scatter([], [], s=90, facecolors="none", edgecolors=FAIL, linewidths=1.4, label="failed (red ring)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, error_at * 2.5)
    ax.set_ylim(lo, error_at * 2.5)
    _error_band(ax, "x", hi * 2.5, error_at * 2.5, error_at, "no ref time")
    _error_band(ax, "y", hi * 2.5, error_at * 2.5, error_at, "no kernel time")
    ax.set_xlabel("reference (jnp) median ms")
    ax.set_ylabel("kernel median ms")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.04, 1.0), borderaxespad=0)
    ax.grid(alpha=0.3)
  else:
    _no_data(ax, "no timed workloads and no failures")
  note = "\n(interpret mode: these times check plumbing, not speed)" if any(r.interpret for r in timed) else ""
  ax.set_title(f"Kernel vs reference time per workload (below the line: kernel faster){note}", fontsize=10, pad=14)
  return fig


def sol_figure(rows: list[Row]):
  """Speed of light / kernel time per workload; failed workloads without a
  fraction in the error band."""
  plt = pyplot()
  measured = [r for r in rows if r.sol_fraction is not None]
  shown = measured + [r for r in rows if r.failed and r.sol_fraction is None]
  by = by_definition(shown)
  fig, ax = plt.subplots(figsize=(10, _height(len(by))))
  if shown:
    top = max([1.05] + [r.sol_fraction * 1.05 for r in rows if r.sol_fraction is not None])
    error_x = top * 1.12
    points = {
      n: [
        (r.sol_fraction, status_color(r.status), "o") if r.sol_fraction is not None else (error_x, FAIL, "X")
        for r in rs
      ]
      for n, rs in by.items()
    }
    _value_strip(
      ax,
      list(by),
      points,
      scale="linear",
      lo=0.0,
      band=top * 1.05,
      error_x=error_x,
      xlabel="speed of light / kernel median time (1 = at the roofline; error band: failed, no fraction)",
      legend=[("passed", PASS, "o"), ("failed", FAIL, "o"), ("failed, no SOL fraction", FAIL, "X")],
    )
    if not measured:
      ax.text(
        0.5,
        0.5,
        "no SOL fraction measured: no workload was timed on a GPU",
        ha="center",
        va="center",
        transform=ax.transAxes,
        fontsize=9,
        color="#555555",
      )
  else:
    _no_data(
      ax,
      "no SOL fraction measured: no workload was timed on a GPU\n"
      "(speed of light ms is in the table; the fraction needs GPU timings)",
    )
  ax.set_title("Speed-of-light fraction per workload", fontsize=10, pad=14)
  return fig


_KIND_COLORS = (("fixed", PASS), ("broke", FAIL), ("other", "#ff9f1c"), ("failing", "#7f1d1d"), ("same", "#dddddd"))


def baseline_figure(changes: list[Change]):
  """Status changes per definition (failing in both runs included) and the
  latency ratio per workload; failed workloads without a ratio in the error
  band."""
  plt = pyplot()
  names = sorted({c.definition for c in changes})
  fig, (left, right) = plt.subplots(
    1, 2, figsize=(13, _height(len(names))), sharey=True, gridspec_kw={"width_ratios": [1, 1.4]}
  )
  if names:
    kinds = {n: [change_kind(c) for c in changes if c.definition == n] for n in names}
    start = [0] * len(names)
    for kind, color in _KIND_COLORS:
      counts = [kinds[n].count(kind) for n in names]
      left.barh(range(len(names)), counts, left=start, color=color, label=kind)
      start = [a + b for a, b in zip(start, counts)]
    left.set_yticks(range(len(names)))
    left.set_yticklabels(names, fontsize=7)
    left.invert_yaxis()
    left.set_xlabel("workloads in both runs")
    left.set_ylabel("definition")
    left.legend(fontsize=7, loc="lower right")
    left.set_title("Status change vs baseline", fontsize=10)
    ratios = [c.latency_ratio for c in changes if c.latency_ratio]
    lo, hi = min(ratios, default=0.5), max(ratios, default=2.0)
    error_x = hi * 4
    points = {
      n: [
        (c.latency_ratio, status_color(c.after), "o") if c.latency_ratio else (error_x, FAIL, "X")
        for c in changes
        if c.definition == n and (c.latency_ratio or failed(c.after))
      ]
      for n in names
    }
    if any(points.values()):
      _value_strip(
        right,
        names,
        points,
        scale="log",
        lo=lo / 2,
        band=hi * 2,
        error_x=error_x,
        xlabel="kernel latency, this run / baseline (< 1 = faster now; error band: failed now, no ratio)",
        legend=[("passed now", PASS, "o"), ("failed now", FAIL, "o"), ("failed now, no ratio", FAIL, "X")],
      )
      right.tick_params(labelleft=True)  # sharey hides them; this panel names its lanes too
    else:
      _no_data(right, "no workload timed in both runs and no failure")
    right.set_title("Latency ratio per workload", fontsize=10, pad=14)
  else:
    _no_data(left, "no workload in both runs")
    _no_data(right, "")
  return fig


def save(fig, path: pathlib.Path) -> None:
  plt = pyplot()
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def plot_errors(rows: list[Row], path: pathlib.Path) -> None:
  save(errors_figure(rows), path)


def plot_latency(rows: list[Row], path: pathlib.Path) -> None:
  save(latency_figure(rows), path)


def plot_sol(rows: list[Row], path: pathlib.Path) -> None:
  save(sol_figure(rows), path)


def plot_baseline(changes: list[Change], path: pathlib.Path) -> None:
  save(baseline_figure(changes), path)
