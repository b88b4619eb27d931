"""The report page: reads a results file (and a baseline), writes the
plots and `index.html`, and returns the tables and the printed text."""

from __future__ import annotations

import dataclasses
import html
import os
import pathlib
import textwrap
from collections.abc import Sequence
from typing import Any

from jaxkern import results as results_lib
from jaxkern.report import peer_table, plots
from jaxkern.report.rows import Row, rows_of
from jaxkern.report.tables import (
  BASELINE_HEADERS,
  ERROR_RULE,
  FAILED_COLUMN,
  HEADERS,
  Change,
  baseline_table,
  change_kind,
  compare_runs,
  definition_table,
  sol_by_timer,
  summary_lines,
  summary_markdown,
)

PNGS = ("errors.png", "latency.png", "sol_fraction.png")
BASELINE_PNG = "baseline.png"


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


def environments(traces: list[results_lib.Trace]) -> str:
  """The distinct environments of a run, in one line."""
  seen = sorted(
    {
      (
        str(t.evaluation.environment.get("hardware")),
        str(t.evaluation.environment.get("backend")),
        str((t.evaluation.environment.get("libs") or {}).get("jax")),
        bool(t.evaluation.environment.get("interpret")),
      )
      for t in traces
    }
  )
  return "; ".join(
    f"{hw} ({backend}, jax {jax}{', interpret mode' if interp else ''})" for hw, backend, jax, interp in seen
  )


def _sol_html(rows: list[Row]) -> str:
  items = []
  for timer, (geomean, count, furthest) in sol_by_timer(summary_lines(rows)).items():
    worst = ", ".join(f"<code>{html.escape(l.definition)}</code> {l.sol_fraction:.3g}" for l in furthest)
    items.append(
      f"<li>{html.escape(timer)}: geomean SOL fraction {geomean:.3g} over {count} definitions; "
      f"furthest from their speed of light: {worst}</li>"
    )
  return f"<ul>{''.join(items)}</ul>" if items else ""


def _baseline_html(baseline: Any, base_count: int, changes: list[Change], btable: list[list[Any]]) -> str:
  moved = [c for c in changes if change_kind(c) not in ("same", "failing")]
  items = "".join(
    f"<li><code>{html.escape(c.definition)} {html.escape(c.uuid)}</code>: "
    f"{html.escape(c.before.value if c.before else '-')} &rarr; "
    f"{html.escape(c.after.value if c.after else '-')}</li>"
    for c in moved[:200]
  )
  return (
    f"<h2>Change against the baseline</h2><p class=note>baseline: <code>{html.escape(str(baseline))}"
    f"</code> ({base_count} results; {len(changes)} workloads in both). fixed = failed before, passed now; "
    f"broke = the reverse; failing = failed in both; latency ratio = median of this run / baseline kernel "
    f"time, over workloads run at the same axes with the same timer in both (axes differ: not compared)."
    f"</p>{_html_table(BASELINE_HEADERS, btable)}"
    f"<ul>{items or '<li>no status changed</li>'}</ul>"
    f'<img src="{BASELINE_PNG}" alt="status changes and latency ratio against the baseline">'
  )


def _peers_html(peers: Any, table: list[list[Any]], lines: list[str]) -> str:
  return (
    f"<h2>Peers</h2><p class=note>peers: <code>{html.escape(str(peers))}</code>. {html.escape(peer_table.NOTE)}</p>"
    f"{_html_table(peer_table.PEERS_TABLE_HEADERS, table)}"
    f"<ul>{''.join(f'<li>{html.escape(l)}</li>' for l in lines) or '<li>no peer ran on these workloads</li>'}</ul>"
  )


@dataclasses.dataclass
class Report:
  table: list[list[Any]]
  baseline_table: list[list[Any]] | None
  changes: list[Change]
  html_path: pathlib.Path
  pngs: list[pathlib.Path]
  text: str
  summary_markdown: str = ""
  peers_table: list[list[Any]] | None = None  # with peers: one line per row group and peer


def build(
  results_path: str | os.PathLike | Sequence[str | os.PathLike],
  *,
  baseline: str | os.PathLike | None = None,
  out_dir: str | os.PathLike | None = None,
  dataset_dir: str = "",
  markdown: str | os.PathLike | None = None,
  peers: str | os.PathLike | None = None,
) -> Report:
  """Reads the results (one file or several, e.g. one per kernel backend of
  the same workloads) and the baseline, writes the page and plots (and the
  summary as markdown to `markdown`), and returns the tables and the printed
  text; with `peers` (`python -m jaxkern.peers --out`), the best peer beside
  each row and a peers table (`jaxkern.report.peer_table`). The default
  folder sits beside the first results file. ValueError when there is no
  result or a peers line is not a peer result."""
  import tabulate

  from jaxkern.peers import read_peer_results

  paths = (
    [pathlib.Path(results_path)]
    if isinstance(results_path, (str, os.PathLike))
    else [pathlib.Path(p) for p in results_path]
  )
  traces = [t for path in paths for t in results_lib.read_traces(path)]
  if not traces:
    raise ValueError(f"no result lines in {', '.join(map(str, paths))}")
  results_path = paths[0]
  out = pathlib.Path(out_dir) if out_dir else results_path.with_name(results_path.stem + "_report")
  out.mkdir(parents=True, exist_ok=True)
  rows = rows_of(traces, dataset_dir)
  stats = peer_table.peer_stats(rows, read_peer_results(peers)) if peers is not None else None
  table = definition_table(rows, stats)
  headers = HEADERS + (peer_table.PEER_HEADERS if stats is not None else [])
  text = [tabulate.tabulate(table, headers=headers), textwrap.fill(ERROR_RULE, 120)]
  ptable, peers_html = None, ""
  if stats is not None:
    ptable, against = peer_table.peers_table(stats), peer_table.against_peers(stats)
    text += [f"\npeers ({peers}):", tabulate.tabulate(ptable, headers=peer_table.PEERS_TABLE_HEADERS), *against]
    peers_html = _peers_html(peers, ptable, against)
  plots.plot_errors(rows, out / "errors.png")
  plots.plot_latency(rows, out / "latency.png")
  plots.plot_sol(rows, out / "sol_fraction.png")
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
    text.append(f"\nagainst baseline {baseline}:")
    text.append(tabulate.tabulate(btable, headers=BASELINE_HEADERS))
    for c in [c for c in changes if change_kind(c) not in ("same", "failing")][:30]:
      text.append(
        f"  {c.definition} {c.uuid}: {c.before.value if c.before else None} -> {c.after.value if c.after else None}"
      )
    plots.plot_baseline(changes, out / BASELINE_PNG)
    pngs.append(out / BASELINE_PNG)
    base_html = _baseline_html(baseline, len(base_traces), changes, btable)

  summary = summary_markdown(
    rows,
    title=f"Replay summary: {results_path.name}",
    source=str(results_path),
    environment=environments(traces),
    peers=stats,
  )
  if markdown is not None:
    pathlib.Path(markdown).write_text(summary, encoding="utf-8")
  failed = [r for r in rows if r.failed]
  fail_items = "".join(
    f"<li><code>{html.escape(r.definition)} {html.escape(r.uuid)}</code>: "
    f"{html.escape(str(r.status))}{': ' + html.escape(r.log[:300]) if r.log else ''}</li>"
    for r in failed[:100]
  )
  interp = any(r.interpret for r in rows)
  title = f"jaxkern replay report: {results_path.name}"
  page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{_CSS}</style></head><body>
<h1>{html.escape(title)}</h1>
<p class=note>results: <code>{html.escape(str(results_path))}</code>, {len(rows)} workloads.
Environment: {html.escape(environments(traces))}.
{"Timings from interpret mode check plumbing, not speed. " if interp else ""}Timer: what measured the times
(<code>device (profiler)</code>, <code>wall</code>, <code>interpret</code>; a definition timed by two timers has
a line per timer). SOL ms: the roofline's speed of light for the axes run (<code>jaxkern.roofline</code>,
datasheet peaks; the H200 unless run on a known GPU); SOL frac: SOL ms / kernel ms, only for workloads timed on
a GPU.</p>
<h2>Per definition</h2>
{_html_table(headers, table, fail_col=FAILED_COLUMN)}
<p class=note>{html.escape(ERROR_RULE)}</p>
{_sol_html(rows)}
{peers_html}
<h2>Error vs the pass bound</h2>
<p class=note>Per workload, the worst output's error against the bound the rule allows each element,
max(atol, rtol&middot;|reference|) (bf16: atol 0.005, rtol 0.016; f32: 2e-5, 1e-4; the GDN prefill state: its
worst metric / threshold). An element fails only beyond both atol and rtol&middot;|reference|, so every passed
workload is at or left of the dashed line at 1. Results written before this figure existed are drawn with
their max abs error / atol instead (hollow markers: those can pass above 1). Integer outputs have no
tolerance. Failed workloads without error values (runtime errors, timeouts, wrong shapes) are the red crosses
in the shaded error band.</p>
<img src="errors.png" alt="error vs the pass bound per definition">
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
  if markdown is not None:
    text.append(f"summary: {markdown}")
  return Report(
    table=table,
    baseline_table=btable,
    changes=changes,
    html_path=html_path,
    pngs=pngs,
    text="\n".join(text),
    summary_markdown=summary,
    peers_table=ptable,
  )
