"""A report of a replay's results that people can look at (usage:
`python -m jaxkern.report`, see `jaxkern.report.cli`).

Modules: `rows` (results flattened per workload: error against tolerance,
the timer), `tables` (per definition and timer, against a baseline, the
markdown summary), `peer_table` (the peers beside our kernels, `--peers`),
`plots` (matplotlib PNGs; failures visible in each), `page` (the HTML page
and `build`), `cli`. The public names are re-exported
here.
"""

from jaxkern.report.cli import main
from jaxkern.report.page import BASELINE_PNG, PNGS, Report, build, environments
from jaxkern.report.peer_table import PEER_HEADERS, PEERS_TABLE_HEADERS, PeerStat, best, peer_stats
from jaxkern.report.plots import (
  baseline_figure,
  definition_styles,
  errors_figure,
  latency_figure,
  plot_baseline,
  plot_errors,
  plot_latency,
  plot_sol,
  sol_figure,
)
from jaxkern.report.rows import (
  DEVICE,
  INTERPRET,
  NOT_TIMED,
  TIMERS,
  WALL,
  Row,
  error_ratios,
  output_tolerances,
  recorded_timer,
  rows_of,
)
from jaxkern.report.tables import (
  BASELINE_HEADERS,
  HEADERS,
  SUMMARY_HEADERS,
  Change,
  SummaryLine,
  baseline_table,
  change_kind,
  compare_runs,
  definition_table,
  sol_by_timer,
  summary_lines,
  summary_markdown,
)

__all__ = [
  "BASELINE_HEADERS",
  "BASELINE_PNG",
  "DEVICE",
  "HEADERS",
  "INTERPRET",
  "NOT_TIMED",
  "PEERS_TABLE_HEADERS",
  "PEER_HEADERS",
  "PNGS",
  "SUMMARY_HEADERS",
  "TIMERS",
  "WALL",
  "Change",
  "PeerStat",
  "Report",
  "Row",
  "SummaryLine",
  "baseline_figure",
  "baseline_table",
  "best",
  "build",
  "change_kind",
  "compare_runs",
  "definition_styles",
  "definition_table",
  "environments",
  "error_ratios",
  "errors_figure",
  "latency_figure",
  "main",
  "output_tolerances",
  "peer_stats",
  "plot_baseline",
  "plot_errors",
  "plot_latency",
  "plot_sol",
  "recorded_timer",
  "rows_of",
  "sol_by_timer",
  "sol_figure",
  "summary_lines",
  "summary_markdown",
]
