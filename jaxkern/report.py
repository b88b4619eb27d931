"""A report of a replay's results that people can look at.

  python -m jaxkern.report RESULTS.jsonl [--baseline OTHER.jsonl] [--out DIR] [--dataset_dir DIR]

Prints a table per definition (status counts, worst error against tolerance,
median kernel / reference / speed-of-light time, median SOL fraction where
timed on a GPU) and writes `DIR/index.html` (default: `<results>_report/`
beside the results file) with matplotlib PNGs:

- `errors.png`: each workload's worst error / tolerance, per definition;
- `latency.png`: kernel vs reference time per workload (log-log);
- `sol_fraction.png`: speed of light / kernel time per workload (GPU runs);
- `baseline.png` (with `--baseline`): status changes per definition and the
  latency ratio (this run / baseline) of each workload present in both.

Error against tolerance, per output: max abs error / atol of the output's
dtype (bf16 0.005, f32 2e-5; SPEC 5), or for an output compared by a
relative metric (GDN prefill state) its relative max error / that metric's
threshold. Integer outputs (exact or top-k) have none. A ratio above 1 can
still pass: an element fails only beyond both atol and rtol*|reference|.
Exit code 0, or 2 when the results file is missing or holds no result.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import html
import math
import os
import pathlib
import statistics
import sys
from typing import Any, Iterable, Mapping

from jaxkern import compare
from jaxkern import dataset
from jaxkern import results as results_lib
from jaxkern.compare import Status

HEADERS = ["definition", "n", "passed", "failed", "skipped", "worst err/tol", "kernel ms", "ref ms", "SOL ms",
           "SOL frac"]
BASELINE_HEADERS = ["definition", "matched", "axes differ", "fixed", "broke", "other changes", "only here",
                    "only in baseline", "latency ratio"]
PNGS = ("errors.png", "latency.png", "sol_fraction.png")
BASELINE_PNG = "baseline.png"

# --------------------------------------------------------------------------
# Tolerances per output.


@functools.cache
def output_tolerances(dataset_dir: str = "") -> dict[str, dict[str, tuple[str, float] | None]]:
  """definition -> output -> (what, threshold) or None (no tolerance: an
  integer output). From the definitions' output dtypes and the families'
  comparison policies (where a family module is importable)."""
  from jaxkern import registry  # pylint: disable=g-import-not-at-top

  try:
    defs = dataset.load_definitions(dataset_dir or None)
  except (OSError, dataset.DatasetError):
    return {}
  tols = compare.DEFAULT_TOLERANCES
  table: dict[str, dict[str, tuple[str, float] | None]] = {}
  for name, d in defs.items():
    try:
      op = registry.get(name, dataset_dir or None)
      policies = op.impl.policies if op.impl is not None else {}
    except Exception:  # pylint: disable=broad-except  # a broken family still gets dtype tolerances
      policies = {}
    per: dict[str, tuple[str, float] | None] = {}
    for out, spec in d.outputs.items():
      p = policies.get(out)
      if isinstance(p, compare.StateMetric):
        per[out] = ("relative max", float(tols[p.key]["relative_max"]))
      elif isinstance(p, compare.Float) and p.atol is not None:
        per[out] = ("atol", float(p.atol))
      elif isinstance(p, (compare.TopK, compare.Exact)) or spec.dtype not in tols:
        per[out] = None
      else:
        per[out] = ("atol", float(tols[spec.dtype]["atol"]))
    table[name] = per
  return table


def _num(v: Any) -> float | None:
  """A JSON number, or "inf"/"nan" strings as floats; None otherwise."""
  if isinstance(v, bool) or v is None:
    return None
  try:
    return float(v)
  except (TypeError, ValueError):
    return None


def error_ratios(trace: results_lib.Trace, tolerances: Mapping[str, tuple[str, float] | None]) -> dict[str, float]:
  """Per output with a tolerance: its error / tolerance (see the module doc)."""
  outs = ((trace.evaluation.correctness or {}).get("outputs")) or {}
  ratios = {}
  for name, o in outs.items():
    tol = tolerances.get(name)
    if tol is None:
      continue
    err = _num(o.get("max_rel_error" if tol[0] == "relative max" else "max_abs_error"))
    if err is not None:
      ratios[name] = err / tol[1] if not math.isnan(err) else math.inf
  return ratios


# --------------------------------------------------------------------------
# Per workload and per definition.


@dataclasses.dataclass
class Row:
  """One workload, flattened for tables and plots."""
  uuid: str
  definition: str
  status: Status | None
  worst_ratio: float | None      # max over outputs of error / tolerance
  worst_output: str | None
  latency_ms: float | None
  reference_ms: float | None
  sol_ms: float | None
  sol_fraction: float | None
  interpret: bool
  log: str
  axes_run: dict[str, int] | None = None  # the axes the workload ran at


def rows_of(traces: Iterable[results_lib.Trace], dataset_dir: str = "") -> list[Row]:
  tol_table = output_tolerances(dataset_dir)
  rows = []
  for t in traces:
    ratios = error_ratios(t, tol_table.get(t.definition, {}))
    worst = max(ratios, key=ratios.get) if ratios else None
    perf = t.evaluation.performance or {}
    rows.append(Row(uuid=t.workload.uuid, definition=t.definition, status=t.status,
                    worst_ratio=ratios[worst] if worst else None, worst_output=worst,
                    latency_ms=_num(perf.get("latency_ms")), reference_ms=_num(perf.get("reference_latency_ms")),
                    sol_ms=_num(perf.get("speed_of_light_ms")), sol_fraction=_num(perf.get("sol_fraction")),
                    interpret=bool(t.evaluation.environment.get("interpret")), log=t.evaluation.log or "",
                    axes_run=t.workload.axes_run or t.workload.axes))
  return rows


def _by_definition(rows: Iterable[Row]) -> dict[str, list[Row]]:
  out: dict[str, list[Row]] = {}
  for r in rows:
    out.setdefault(r.definition, []).append(r)
  return dict(sorted(out.items()))


def _median(values: Iterable[float | None]) -> float | None:
  vs = [v for v in values if v is not None and math.isfinite(v)]
  return statistics.median(vs) if vs else None


def _fmt(v: float | None, spec: str = ".3g") -> str:
  if v is None:
    return "-"
  return "inf" if math.isinf(v) else format(v, spec)


def _failed(s: Status | None) -> bool:
  return s is not None and s.failed


def definition_table(rows: list[Row]) -> list[list[Any]]:
  """One line per definition (HEADERS), then a total line."""
  table = []
  for name, rs in _by_definition(rows).items():
    ratios = [(r.worst_ratio, r.worst_output) for r in rs if r.worst_ratio is not None]
    worst = max(ratios, key=lambda x: x[0]) if ratios else None
    table.append([name, len(rs), sum(r.status == Status.PASSED for r in rs), sum(_failed(r.status) for r in rs),
                  sum(r.status == Status.SKIPPED for r in rs),
                  f"{_fmt(worst[0])} ({worst[1]})" if worst else "-",
                  _fmt(_median(r.latency_ms for r in rs)), _fmt(_median(r.reference_ms for r in rs)),
                  _fmt(_median(r.sol_ms for r in rs)), _fmt(_median(r.sol_fraction for r in rs))])
  table.append(["total", len(rows), sum(r.status == Status.PASSED for r in rows),
                sum(_failed(r.status) for r in rows), sum(r.status == Status.SKIPPED for r in rows),
                "", "", "", "", ""])
  return table


@dataclasses.dataclass
class Change:
  uuid: str
  definition: str
  before: Status | None
  after: Status | None
  latency_ratio: float | None  # this run / baseline; None unless both ran at the same axes
  same_axes: bool = True


def compare_runs(rows: list[Row], base: list[Row]) -> tuple[list[Change], list[Row], list[Row]]:
  """Workloads in both runs (by uuid) with their status and latency change
  (only between runs at the same axes: a CPU run shrinks them); then the
  rows only in this run and only in the baseline."""
  base_by = {r.uuid: r for r in base}
  here = {r.uuid for r in rows}
  changes = []
  for r in rows:
    b = base_by.get(r.uuid)
    if b is None:
      continue
    same = r.axes_run == b.axes_run
    ratio = r.latency_ms / b.latency_ms if same and r.latency_ms is not None and b.latency_ms else None
    changes.append(Change(r.uuid, r.definition, b.status, r.status, ratio, same))
  return changes, [r for r in rows if r.uuid not in base_by], [b for b in base if b.uuid not in here]


def _kind(c: Change) -> str:
  if c.before == c.after:
    return "same"
  if c.after == Status.PASSED and _failed(c.before):
    return "fixed"
  if c.before == Status.PASSED and _failed(c.after):
    return "broke"
  return "other"


def baseline_table(changes: list[Change], only_here: list[Row], only_base: list[Row]) -> list[list[Any]]:
  names = sorted({c.definition for c in changes} | {r.definition for r in only_here + only_base})
  table = []
  for name in names:
    cs = [c for c in changes if c.definition == name]
    kinds = [_kind(c) for c in cs]
    table.append([name, len(cs), sum(not c.same_axes for c in cs), kinds.count("fixed"), kinds.count("broke"),
                  kinds.count("other"),
                  sum(r.definition == name for r in only_here), sum(r.definition == name for r in only_base),
                  _fmt(_median(c.latency_ratio for c in cs))])
  return table


# --------------------------------------------------------------------------
# Plots.


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


_PASS, _FAIL, _OTHER = "#2a9d3f", "#d62728", "#888888"


def _color(s: Status | None) -> str:
  return _PASS if s == Status.PASSED else (_FAIL if _failed(s) else _OTHER)


def _height(n: int) -> float:
  return max(3.0, 0.32 * n + 1.6)


def _strip(ax, names: list[str], points: dict[str, list[tuple[float, str, str]]]) -> None:
  """Points per definition on horizontal lanes (value, color, marker)."""
  for i, name in enumerate(names):
    pts = points.get(name, [])
    for j, (v, color, marker) in enumerate(pts):
      jitter = ((j % 7) - 3) * 0.05 if len(pts) > 1 else 0.0
      ax.scatter([v], [i + jitter], s=22, c=color, marker=marker, linewidths=1.0, zorder=3)
  ax.set_yticks(range(len(names)))
  ax.set_yticklabels(names, fontsize=7)
  ax.set_ylim(-0.6, len(names) - 0.4)
  ax.invert_yaxis()
  ax.grid(axis="x", alpha=0.3)


def _no_data(ax, text: str) -> None:
  ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="#555555")
  ax.set_xticks([])
  ax.set_yticks([])


def plot_errors(rows: list[Row], path: pathlib.Path) -> None:
  plt = _pyplot()
  by = _by_definition(rows)
  names = list(by)
  fig, ax = plt.subplots(figsize=(10, _height(len(names))))
  finite = [r.worst_ratio for r in rows if r.worst_ratio is not None and math.isfinite(r.worst_ratio)
            and r.worst_ratio > 0]
  floor = min(min(finite, default=1e-3) / 2, 1e-3)
  ceiling = max(max(finite, default=1.0) * 4, 10.0)
  points = {}
  for name, rs in by.items():
    points[name] = [(min(max(r.worst_ratio, floor), ceiling), _color(r.status),
                     "x" if math.isinf(r.worst_ratio) else "o") for r in rs if r.worst_ratio is not None]
  if any(points.values()):
    _strip(ax, names, points)
    ax.set_xscale("log")
    ax.set_xlim(floor / 1.5, ceiling * 1.5)
    ax.axvline(1.0, color="black", lw=1, ls="--")
    ax.set_xlabel("worst output error / tolerance (max abs err / atol; 1 = at atol; x = non-finite; "
                  f"0 drawn at {floor:.0e})", fontsize=8)
  else:
    _no_data(ax, "no floating-point output errors in these results")
  _save(plt, fig, ax, "Error vs tolerance per workload (green passed, red failed)", path)


def _save(plt, fig, ax, title: str, path: pathlib.Path) -> None:
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def plot_latency(rows: list[Row], path: pathlib.Path) -> None:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(10, 6.5))
  timed = [r for r in rows if r.latency_ms and r.reference_ms]
  if timed:
    cmap = plt.get_cmap("tab20")
    for i, (name, rs) in enumerate(_by_definition(timed).items()):
      ax.scatter([r.reference_ms for r in rs], [r.latency_ms for r in rs], s=24, color=cmap(i % 20),
                 marker="osD^v"[(i // 20) % 5], label=name, zorder=3)
    lo = min(min(r.latency_ms, r.reference_ms) for r in timed) / 2
    hi = max(max(r.latency_ms, r.reference_ms) for r in timed) * 2
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, ls="--", label="kernel = reference")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("reference (jnp) median ms")
    ax.set_ylabel("kernel median ms")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(alpha=0.3)
  else:
    _no_data(ax, "no timed workloads")
  note = "\n(interpret mode: these times check plumbing, not speed)" if any(r.interpret for r in timed) else ""
  _save(plt, fig, ax, f"Kernel vs reference time per workload (below the line: kernel faster){note}", path)


def plot_sol(rows: list[Row], path: pathlib.Path) -> None:
  plt = _pyplot()
  measured = [r for r in rows if r.sol_fraction is not None]
  by = _by_definition(measured)
  fig, ax = plt.subplots(figsize=(10, _height(len(by))))
  if measured:
    names = list(by)
    _strip(ax, names, {n: [(r.sol_fraction, _color(r.status), "o") for r in rs] for n, rs in by.items()})
    ax.axvline(1.0, color="black", lw=1, ls="--")
    ax.set_xlim(0, max(1.05, max(r.sol_fraction for r in measured) * 1.05))
    ax.set_xlabel("speed of light / kernel median time (1 = at the roofline)", fontsize=8)
  else:
    _no_data(ax, "no SOL fraction measured: no workload was timed on a GPU\n"
             "(speed of light ms is in the table; the fraction needs GPU timings)")
  _save(plt, fig, ax, "Speed-of-light fraction per workload", path)


def plot_baseline(changes: list[Change], path: pathlib.Path) -> None:
  plt = _pyplot()
  names = sorted({c.definition for c in changes})
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, _height(len(names))), sharey=True,
                                    gridspec_kw={"width_ratios": [1, 1.4]})
  if names:
    kinds = {n: [_kind(c) for c in changes if c.definition == n] for n in names}
    start = [0] * len(names)
    for kind, color in (("fixed", _PASS), ("broke", _FAIL), ("other", "#ff9f1c"), ("same", "#dddddd")):
      counts = [kinds[n].count(kind) for n in names]
      left.barh(range(len(names)), counts, left=start, color=color, label=kind)
      start = [a + b for a, b in zip(start, counts)]
    left.set_yticks(range(len(names)))
    left.set_yticklabels(names, fontsize=7)
    left.invert_yaxis()
    left.set_xlabel("workloads in both runs")
    left.legend(fontsize=7, loc="lower right")
    left.set_title("Status change vs baseline", fontsize=10)
    ratios = {n: [(c.latency_ratio, _color(c.after), "o") for c in changes
                  if c.definition == n and c.latency_ratio] for n in names}
    if any(ratios.values()):
      _strip(right, names, ratios)
      right.set_xscale("log")
      right.axvline(1.0, color="black", lw=1, ls="--")
      right.set_xlabel("kernel latency, this run / baseline (< 1 = faster now)", fontsize=8)
    else:
      _no_data(right, "no workload timed in both runs")
    right.set_title("Latency ratio per workload", fontsize=10)
  else:
    _no_data(left, "no workload in both runs")
    _no_data(right, "")
  fig.tight_layout()
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


# --------------------------------------------------------------------------
# The page.


def _html_table(headers: list[str], table: list[list[Any]], fail_col: int | None = None) -> str:
  head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
  body = []
  for line in table:
    cls = ' class="fail"' if fail_col is not None and isinstance(line[fail_col], int) and line[fail_col] else ""
    body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in line) + "</tr>")
  return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


_CSS = """body{font-family:system-ui,sans-serif;max-width:1280px;margin:1em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:13px;margin:0.5em 0}td,th{border:1px solid #ccc;padding:2px 7px;
text-align:right}td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}tr.fail td{background:#fde8e8}
img{max-width:100%;border:1px solid #eee}p.note{color:#555;font-size:13px}code{font-size:12px}"""


def _environments(traces: list[results_lib.Trace]) -> str:
  seen = sorted({(str(t.evaluation.environment.get("hardware")), str(t.evaluation.environment.get("backend")),
                  str((t.evaluation.environment.get("libs") or {}).get("jax")),
                  bool(t.evaluation.environment.get("interpret"))) for t in traces})
  return "; ".join(f"{hw} ({backend}, jax {jax}{', interpret mode' if interp else ''})"
                   for hw, backend, jax, interp in seen)


@dataclasses.dataclass
class Report:
  table: list[list[Any]]
  baseline_table: list[list[Any]] | None
  changes: list[Change]
  html_path: pathlib.Path
  pngs: list[pathlib.Path]
  text: str


def build(results_path: str | os.PathLike, *, baseline: str | os.PathLike | None = None,
          out_dir: str | os.PathLike | None = None, dataset_dir: str = "") -> Report:
  """Reads the results (and baseline), writes the page and plots, and returns
  the tables and the printed text. ValueError when there is no result."""
  import tabulate  # pylint: disable=g-import-not-at-top

  results_path = pathlib.Path(results_path)
  traces = results_lib.read_traces(results_path)
  if not traces:
    raise ValueError(f"no result lines in {results_path}")
  out = pathlib.Path(out_dir) if out_dir else results_path.with_name(results_path.stem + "_report")
  out.mkdir(parents=True, exist_ok=True)
  rows = rows_of(traces, dataset_dir)
  table = definition_table(rows)
  text = [tabulate.tabulate(table, headers=HEADERS)]
  plot_errors(rows, out / "errors.png")
  plot_latency(rows, out / "latency.png")
  plot_sol(rows, out / "sol_fraction.png")
  pngs = [out / p for p in PNGS]

  changes: list[Change] = []
  btable = None
  base_html = ""
  if baseline is not None:
    base_traces = results_lib.read_traces(baseline)
    if not base_traces:
      raise ValueError(f"no result lines in baseline {baseline}")
    changes, only_here, only_base = compare_runs(rows, rows_of(base_traces, dataset_dir))
    btable = baseline_table(changes, only_here, only_base)
    moved = [c for c in changes if _kind(c) != "same"]
    text.append(f"\nagainst baseline {baseline}:")
    text.append(tabulate.tabulate(btable, headers=BASELINE_HEADERS))
    for c in moved[:30]:
      text.append(f"  {c.definition} {c.uuid}: {c.before.value if c.before else None} -> "
                  f"{c.after.value if c.after else None}")
    plot_baseline(changes, out / BASELINE_PNG)
    pngs.append(out / BASELINE_PNG)
    items = "".join(f"<li><code>{html.escape(c.definition)} {html.escape(c.uuid)}</code>: "
                    f"{html.escape(c.before.value if c.before else '-')} &rarr; "
                    f"{html.escape(c.after.value if c.after else '-')}</li>" for c in moved[:200])
    base_html = (f"<h2>Change against the baseline</h2><p class=note>baseline: <code>{html.escape(str(baseline))}"
                 f"</code> ({len(base_traces)} results; {len(changes)} workloads in both). fixed = failed before, "
                 f"passed now; broke = the reverse; latency ratio = median of this run / baseline kernel time, over "
                 f"workloads run at the same axes in both (axes differ: not compared)."
                 f"</p>{_html_table(BASELINE_HEADERS, btable)}"
                 f"<ul>{items or '<li>no status changed</li>'}</ul>"
                 f'<img src="{BASELINE_PNG}" alt="status changes and latency ratio against the baseline">')

  failed = [r for r in rows if _failed(r.status)]
  fail_items = "".join(f"<li><code>{html.escape(r.definition)} {html.escape(r.uuid)}</code>: "
                       f"{html.escape(r.status.value)}{': ' + html.escape(r.log[:300]) if r.log else ''}</li>" for r in failed[:100])
  interp = any(r.interpret for r in rows)
  title = f"jaxkern replay report: {results_path.name}"
  page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{_CSS}</style></head><body>
<h1>{html.escape(title)}</h1>
<p class=note>results: <code>{html.escape(str(results_path))}</code>, {len(rows)} workloads.
Environment: {html.escape(_environments(traces))}.
{"Timings from interpret mode check plumbing, not speed. " if interp else ""}SOL ms: the roofline's speed
of light for the axes run (<code>jaxkern.roofline</code>, datasheet peaks; the H200 unless run on a known GPU);
SOL frac: SOL ms / kernel ms, only for workloads timed on a GPU.</p>
<h2>Per definition</h2>
{_html_table(HEADERS, table, fail_col=3)}
<h2>Error vs tolerance</h2>
<p class=note>Per workload, the worst output's max abs error / atol of its dtype (bf16 0.005, f32 2e-5), or for
a relatively compared output (GDN prefill state) relative max error / 0.015. Integer outputs have no
tolerance. Above 1 can still pass: an element fails only beyond both atol and rtol&middot;|reference|.</p>
<img src="errors.png" alt="error vs tolerance per definition">
<h2>Kernel vs reference time</h2>
<img src="latency.png" alt="kernel vs reference time per workload">
<h2>Speed-of-light fraction</h2>
<img src="sol_fraction.png" alt="speed-of-light fraction per workload">
{base_html}
<h2>Failures ({len(failed)})</h2>
<ul>{fail_items or "<li>none</li>"}</ul>
</body></html>
"""
  html_path = out / "index.html"
  html_path.write_text(page, encoding="utf-8")
  text.append(f"\nreport: {html_path} ({', '.join(p.name for p in pngs)})")
  return Report(table=table, baseline_table=btable, changes=changes, html_path=html_path, pngs=pngs,
                text="\n".join(text))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxkern.report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("results", help="replay results JSONL")
  parser.add_argument("--baseline", default=None, help="another run's results JSONL to compare with")
  parser.add_argument("--out", default=None, help="output folder (default: <results>_report beside the results)")
  parser.add_argument("--dataset_dir", default="", help="dataset with the definitions (default: the package's)")
  args = parser.parse_args(argv)
  for path in (args.results, args.baseline):
    if path is not None and not pathlib.Path(path).is_file():
      print(f"error: no results file {path}", file=sys.stderr)
      return 2
  try:
    report = build(args.results, baseline=args.baseline, out_dir=args.out, dataset_dir=args.dataset_dir)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(report.text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
