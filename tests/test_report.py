"""`python -m jaxkern.report`: from a small crafted results file and a
baseline, the page and its PNGs are written, the page shows every plot, and
the printed tables count right. With chromium on the machine, the page is
also rendered headless to a screenshot."""

import html
import json
import shutil
import subprocess

import jax.numpy as jnp
import pytest

from jaxkern import report, results
from jaxkern.compare import Status

GEMM = "dense_gemm_bf16_nt_n4096_k4096"  # output C bf16: atol 0.005
ROUTER = "moe_router_gemm_topk_deepseek41_d5120_e384_topk6"  # expert_ids top-k, expert_weights f32: atol 2e-5
ATTN = "noncausal_dense_attention_h32_d64"  # output o bf16
MLA = "sparse_mla_prefill_h64_d512_k128"


def trace(
  uuid, definition, status, errors=None, latency=None, ref=None, sol=None, frac=None, log="", axes=None, bounds=None
):
  """A result line; `errors`: output -> max abs error; `bounds`: output ->
  max_bound_ratio (absent: a result written before that field)."""
  ev = results.Evaluation(
    status=status,
    environment={"hardware": "NVIDIA H200", "backend": "gpu", "libs": {"jax": "0.11.2"}, "interpret": False},
    timestamp="2026-11-30T00:00:00+00:00",
    log=log,
  )
  if errors is not None:
    ev.correctness = {
      "outputs": {
        n: {
          "status": "passed",
          "max_abs_error": e,
          "max_rel_error": 0.0,
          "matched_ratio": 1.0,
          "tie_accepted_rows": 0,
          "message": "",
        }
        for n, e in errors.items()
      }
    }
    for n, b in (bounds or {}).items():
      ev.correctness["outputs"][n]["max_bound_ratio"] = b
  if latency is not None:
    ev.performance = {"latency_ms": latency, "reference_latency_ms": ref, "speed_of_light_ms": sol}
    if frac is not None:
      ev.performance["sol_fraction"] = frac
  return results.Trace(
    definition=definition,
    evaluation=ev,
    workload=results.WorkloadInfo(uuid=uuid, variant=None, axes={"M": 8}, seed=0, source="x", axes_run=axes),
  )


def write(path, traces):
  path.write_text("".join(json.dumps(t.to_json()) + "\n" for t in traces))
  return path


@pytest.fixture
def runs(tmp_path):
  current = write(
    tmp_path / "current.jsonl",
    [
      trace("g1", GEMM, Status.PASSED, {"C": 0.01}, 1.0, 2.0, 0.5, 0.5),
      trace("g2", GEMM, Status.INCORRECT_NUMERICAL, {"C": 0.5}, 1.0, 2.0, 0.5, 0.5, log="C: 3 of 9 elements"),
      trace("g3", GEMM, Status.PASSED, {"C": 0.0}, 2.0, 2.0, 0.5, 0.25),
      trace("r1", ROUTER, Status.PASSED, {"expert_ids": 5.0, "expert_weights": 1e-6}, 0.1, 0.2, 0.01, 0.1),
      trace("a1", ATTN, Status.RUNTIME_ERROR, log="boom"),
      trace("a2", ATTN, Status.INCORRECT_NUMERICAL, {"o": "inf"}, 0.3, 0.1, 0.03, 0.1),
      trace("m1", MLA, Status.SKIPPED, log="no kernel yet"),
    ],
  )
  baseline = write(
    tmp_path / "baseline.jsonl",
    [
      trace("g1", GEMM, Status.INCORRECT_NUMERICAL, {"C": 0.5}, 2.0, 2.0, 0.5, 0.25),  # fixed, 2x faster now
      trace("g2", GEMM, Status.PASSED, {"C": 0.001}, 0.5, 2.0, 0.5, 1.0),  # broke, 2x slower
      trace("g3", GEMM, Status.PASSED, {"C": 0.0}, 2.0, 2.0, 0.5, 0.25),  # same
      trace("a1", ATTN, Status.TIMEOUT, log="slow"),  # other change
      trace("r1", ROUTER, Status.PASSED, {"expert_weights": 0.0}, 0.2, 0.2, axes={"M": 2}),  # shrunk: no ratio
      trace("old", ATTN, Status.PASSED, {"o": 0.0}, 1.0, 1.0, 0.1, 0.1),  # only in the baseline
    ],
  )
  return current, baseline


def cells(text, name):
  """The cells of the first table line of `name` in printed text."""
  return next(l.split() for l in text.splitlines() if l.split() and l.split()[0] == name)


def test_table_counts_and_error_ratios(runs):
  current, _ = runs
  rep = report.build(current, out_dir=current.parent / "rep")
  # Results written before the backend was recorded: "-" in its column.
  assert [r[1] for r in rep.table] == ["-"] * (len(rep.table) - 1) + [""]
  rows = {r[0]: [r[0], *r[2:]] for r in rep.table}
  # Results without a timer field, not in interpret mode: wall clock. The
  # runtime error joins its definition's timer; a definition never timed has none.
  assert [rows[n][1] for n in (GEMM, ROUTER, ATTN, MLA)] == ["wall", "wall", "wall", "-"]
  assert rows[GEMM][2:6] == [3, 2, 1, 0]
  # Results without max_bound_ratio (written before it): no err/bound, err/atol as before.
  assert rows[GEMM][6:8] == ["-", "100 (C)"]  # 0.5 / 0.005
  assert rows[ROUTER][2:6] == [1, 1, 0, 0]
  assert rows[ROUTER][7] == "0.05 (expert_weights)"  # 1e-6 / 2e-5; the top-k ids have no tolerance
  assert rows[ATTN][2:6] == [2, 0, 2, 0] and rows[ATTN][7] == "inf (o)"
  assert rows[MLA][2:6] == [1, 0, 0, 1] and rows[MLA][6:8] == ["-", "-"]
  assert rows["total"][2:6] == [7, 3, 3, 1]
  assert rows[GEMM][8:] == ["1", "2", "0.5", "0.5"]  # medians: kernel, reference, SOL ms, SOL fraction
  assert cells(rep.text, GEMM)[1:7] == ["-", "wall", "3", "2", "1", "0"]
  assert cells(rep.text, "total")[1:5] == ["7", "3", "3", "1"]


def test_page_and_plots_with_a_baseline(runs, capsys):
  current, baseline = runs
  out = current.parent / "page"
  assert report.main([str(current), "--baseline", str(baseline), "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  page = (out / "index.html").read_text()
  for png in (*report.PNGS, report.BASELINE_PNG):
    data = (out / png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    assert f'src="{png}"' in page, png
  assert GEMM in page and "boom" in page and "C: 3 of 9 elements" in page
  changes = printed.split("against baseline")[1]
  # matched, axes differ, fixed, broke, other, failing in both, only here, only in baseline, median latency
  # ratio (0.5, 2, 1).
  assert cells(changes, GEMM)[1:] == ["3", "0", "1", "1", "0", "0", "0", "0", "1"]
  assert cells(changes, ATTN)[1:] == ["1", "0", "0", "0", "1", "0", "1", "1", "-"]
  assert cells(changes, ROUTER)[1:] == ["1", "1", "0", "0", "0", "0", "0", "0", "-"]
  assert "g1: incorrect_numerical -> passed" in printed and "g2: passed -> incorrect_numerical" in printed
  assert f"report: {out / 'index.html'}" in printed


def test_default_folder_and_errors(runs, tmp_path, capsys):
  current, _ = runs
  rep = report.build(current)
  assert rep.html_path == current.parent / "current_report" / "index.html" and rep.html_path.exists()
  assert report.main([str(tmp_path / "missing.jsonl")]) == 2
  (tmp_path / "empty.jsonl").write_text("")
  assert report.main([str(tmp_path / "empty.jsonl")]) == 2
  assert "no result lines" in capsys.readouterr().err


def test_passed_rows_never_look_failed(tmp_path):
  """A passed workload whose max abs error is 10x atol (rtol*|reference|
  allows it) shows err/bound <= 1 beside err/atol 10, the rule is stated
  under the table and on the page, and the error plot draws it left of the
  line at 1; a failing one lands right of it. From real comparisons."""
  from jaxkern import compare, evaluate

  y = jnp.array([2.0, -4.0, 0.001], jnp.float32)
  passing = compare.compare_float("C", y + jnp.array([0.025, -0.05, 0.004]), y, atol=0.005, rtol=0.016)
  failing = compare.compare_float("C", y + jnp.array([0.04, 0.0, 0.0]), y, atol=0.005, rtol=0.016)
  lines = []
  for uuid, cmp in (("p1", passing), ("f1", failing)):
    t = trace(uuid, GEMM, Status(cmp.status), latency=1.0, ref=2.0)
    t.evaluation.correctness = evaluate.correctness_json(compare.Comparison(cmp.status, {"C": cmp}))
    lines.append(t)
  path = write(tmp_path / "bounds.jsonl", lines)
  rep = report.build(path, out_dir=tmp_path / "rep")
  rows = {r.uuid: r for r in report.rows_of(results.read_traces(path))}
  assert rows["p1"].bound_ratio == pytest.approx(0.8, rel=1e-4) and rows["p1"].worst_ratio == pytest.approx(
    10, rel=1e-4
  )
  assert rows["f1"].bound_ratio == pytest.approx(1.25, rel=1e-4)
  only_passed = report.build(write(tmp_path / "p.jsonl", lines[:1]), out_dir=tmp_path / "p")
  [line, _] = only_passed.table
  assert line[7:9] == ["0.8 (C)", "10 (C)"]  # err/bound <= 1 beside err/atol
  rule = "An element fails only beyond both atol and rtol*|reference|"
  assert rule in " ".join(rep.text.split()) and html.escape(rule) in rep.html_path.read_text()
  fig = report.errors_figure(list(rows.values()))
  (ax,) = fig.axes
  xs = {face: x for x, _, face, *_ in _points(ax)}
  assert xs["#2a9d3f"] <= 1.0 < xs["#d62728"]  # passed left of the bound, failed right of it
  assert "max(atol, rtol*|ref|)" in ax.get_xlabel() and "atol and rtol*|reference|" in ax.get_title()
  # A result written before max_bound_ratio is drawn by its error / atol, marked so.
  old = report.rows_of([trace("o1", GEMM, Status.PASSED, {"C": 0.0156})])
  legend = report.errors_figure(old).axes[0].get_legend()
  assert legend is not None
  assert any("error / atol" in t.get_text() and "passes above 1" in t.get_text() for t in legend.get_texts())


@pytest.mark.slow  # a subprocess
@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_page_renders_headless(runs):
  current, baseline = runs
  rep = report.build(current, baseline=baseline, out_dir=current.parent / "shot")
  shot = rep.html_path.parent / "screenshot.png"
  subprocess.run(
    [
      "chromium",
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--hide-scrollbars",
      "--window-size=1300,3000",
      f"--screenshot={shot}",
      rep.html_path.as_uri(),
    ],
    check=True,
    capture_output=True,
    timeout=120,
  )
  assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20000


# -- failures, styles, labels ---------------------------------------


def _points(ax):
  """Every scattered (x, y) point of an axes, with its face colour and the
  collection it belongs to."""
  import matplotlib.colors as mcolors

  out = []
  for coll in ax.collections:
    offsets = coll.get_offsets()
    faces = coll.get_facecolors()
    edges = coll.get_edgecolors()
    for i, (x, y) in enumerate(offsets):
      face = mcolors.to_hex(faces[i % len(faces)]) if len(faces) else "none"
      edge = mcolors.to_hex(edges[i % len(edges)]) if len(edges) else "none"
      out.append((float(x), float(y), face, edge, coll))
  return out


@pytest.fixture
def rows(runs):
  current, _ = runs
  return report.rows_of(results.read_traces(current))


def test_errors_plot_shows_runtime_errors(rows):
  """The runtime error (no error values) is a red cross in the error band,
  right of every measured ratio; every other row with a ratio is there too."""
  fig = report.errors_figure(rows)
  (ax,) = fig.axes
  pts = _points(ax)
  with_ratio = [r for r in rows if r.worst_ratio is not None]
  errored = [r for r in rows if r.worst_ratio is None and r.failed]
  assert [r.uuid for r in errored] == ["a1"]
  assert len(pts) == len(with_ratio) + len(errored)
  lanes = [t.get_text() for t in ax.get_yticklabels()]
  red = [(x, round(y)) for x, y, face, _, _ in pts if face == "#d62728"]
  band_x = max(x for x, *_ in pts)
  assert (band_x, lanes.index(ATTN)) in red  # a1 at the error position, in its definition's lane
  assert band_x > 10 * max(r.worst_ratio for r in with_ratio if r.worst_ratio != float("inf"))
  legend = [t.get_text() for t in ax.get_legend().get_texts()]
  assert any("no error values" in l for l in legend)


def test_latency_and_sol_plots_show_failures(rows):
  lat = report.latency_figure(rows)
  (ax,) = lat.axes
  pts = _points(ax)
  shown = [r for r in rows if (r.latency_ms and r.reference_ms) or r.failed]
  rings = [(x, y) for x, y, face, edge, _ in pts if face == "none" and edge == "#d62728"]
  dots = [(x, y) for x, y, face, *_ in pts if face != "none"]
  assert len(dots) == len(shown) and len(rings) == sum(r.failed for r in shown)
  top = max(x for x, _ in dots)
  assert (top, top) in rings  # a1: no kernel and no reference time
  assert ax.get_xlabel() and ax.get_ylabel()
  sol = report.sol_figure(rows)
  (ax,) = sol.axes
  lanes = [t.get_text() for t in ax.get_yticklabels()]
  crosses = [(x, lanes[round(y)]) for x, y, face, *_ in _points(ax) if face == "#d62728"]
  assert (max(x for x, _ in crosses), ATTN) in crosses


def test_baseline_plot_shows_failures_and_labels_both_panels(runs):
  current, baseline = runs
  now, base = report.rows_of(results.read_traces(current)), report.rows_of(results.read_traces(baseline))
  changes, _, _ = report.compare_runs(now, base)
  fig = report.baseline_figure(changes)
  left, right = fig.axes
  # The runtime error a1 (timeout before) has no ratio: a red cross on the right.
  lanes = [t.get_text() for t in right.get_yticklabels()]
  crosses = [lanes[round(y)] for x, y, face, *_ in _points(right) if face == "#d62728"]
  assert ATTN in crosses
  for ax in (left, right):
    assert ax.get_xlabel() and ax.get_ylabel() == "definition"
    visible = [t.label1.get_text() for t in ax.yaxis.get_major_ticks() if t.label1.get_visible()]
    assert visible and all(visible), ax.get_title()
  # Failing in both runs is its own kind, not "same".
  c = report.Change("u", GEMM, Status.RUNTIME_ERROR, Status.RUNTIME_ERROR, None)
  assert report.change_kind(c) == "failing"


def test_every_plot_labels_its_axes(rows):
  for fig in (report.errors_figure(rows), report.latency_figure(rows), report.sol_figure(rows)):
    for ax in fig.axes:
      assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()


def test_21_definitions_have_distinct_colours_and_markers():
  from jaxkern import registry

  names = registry.names()
  styles = report.definition_styles(names)
  assert len(names) == 21
  assert len({c for c, _ in styles.values()}) == 21 and len(set(styles.values())) == 21
  assert "#d62728" not in {c for c, _ in styles.values()}  # red means failure
  # And in the plot: one colour per definition.
  traces = [trace(f"u{i}", n, Status.PASSED, latency=1.0 + i, ref=2.0) for i, n in enumerate(names)]
  fig = report.latency_figure(report.rows_of(traces))
  colours = {face for *_, face, _, _ in [(p[0], p[1], p[2], p[3], p[4]) for p in _points(fig.axes[0])]}
  assert len(colours) == 21


# -- timers and the markdown summary -------------------------------


def timed(uuid, definition, status, latency, timer=None, interpret=False, frac=None):
  t = trace(uuid, definition, status, latency=latency, ref=2 * latency, sol=0.1, frac=frac)
  t.evaluation.environment["interpret"] = interpret
  if timer is not None:
    t.evaluation.performance["timer"] = timer
  return t


def on(backend, t):
  """`t` run by the kernel backend `backend`."""
  t.evaluation.backend = backend
  return t


def test_tables_never_mix_timers(tmp_path):
  path = write(
    tmp_path / "mixed.jsonl",
    [
      timed("d1", GEMM, Status.PASSED, 1.0, "device (profiler)", frac=0.5),
      timed("d2", GEMM, Status.PASSED, 3.0, "device (profiler)", frac=0.1),
      timed("w1", GEMM, Status.PASSED, 100.0, "wall"),
      timed("i1", GEMM, Status.PASSED, 500.0, interpret=True),  # an old line in interpret mode
      trace("e1", ROUTER, Status.RUNTIME_ERROR, log="boom"),  # not timed: joins the router's one timer
      timed("r1", ROUTER, Status.PASSED, 0.2, "device (profiler)", frac=0.04),
    ],
  )
  rep = report.build(path, out_dir=tmp_path / "rep")
  lines = {(r[0], r[2]): [r[0], *r[2:]] for r in rep.table}
  assert set(lines) == {
    (GEMM, "device (profiler)"),
    (GEMM, "wall"),
    (GEMM, "interpret"),
    (ROUTER, "device (profiler)"),
    ("total", ""),
  }
  assert lines[(GEMM, "device (profiler)")][2:4] == [2, 2] and lines[(GEMM, "device (profiler)")][8] == "2"
  assert lines[(GEMM, "wall")][8] == "100" and lines[(GEMM, "interpret")][8] == "500"
  assert lines[(ROUTER, "device (profiler)")][2:5] == [2, 1, 1]
  # A baseline ratio only between the same timer.
  base = report.rows_of([timed("d1", GEMM, Status.PASSED, 2.0, "wall")])
  [change], _, _ = report.compare_runs(report.rows_of(results.read_traces(path)), base)
  assert change.latency_ratio is None


def test_tables_keep_backends_apart(tmp_path):
  path = write(
    tmp_path / "backends.jsonl",
    [
      on("triton", timed("t1", GEMM, Status.PASSED, 2.0, "device (profiler)")),
      on("mosaic_gpu", timed("m1", GEMM, Status.PASSED, 1.0, "device (profiler)")),
    ],
  )
  rep = report.build(path, out_dir=tmp_path / "rep")
  lines = {(r[0], r[1]): r for r in rep.table}
  assert set(lines) == {(GEMM, "triton"), (GEMM, "mosaic_gpu"), ("total", "")}
  assert lines[(GEMM, "triton")][9] == "2" and lines[(GEMM, "mosaic_gpu")][9] == "1"
  assert [(l.backend, l.kernel_ms) for l in report.summary_lines(report.rows_of(results.read_traces(path)))] == [
    ("mosaic_gpu", 1.0),
    ("triton", 2.0),
  ]
  # A baseline ratio only between the same backend.
  base = report.rows_of([on("triton", timed("m1", GEMM, Status.PASSED, 2.0, "device (profiler)"))])
  [change], _, _ = report.compare_runs(report.rows_of(results.read_traces(path)), base)
  assert change.latency_ratio is None


def test_markdown_summary(tmp_path, capsys):
  path = write(
    tmp_path / "gpu.jsonl",
    [
      timed("d1", GEMM, Status.PASSED, 1.0, "device (profiler)", frac=0.5),
      timed("d2", GEMM, Status.INCORRECT_NUMERICAL, 3.0, "device (profiler)", frac=0.1),
      timed("r1", ROUTER, Status.PASSED, 0.2, "device (profiler)", frac=0.04),
      timed("a1", ATTN, Status.PASSED, 0.5, "device (profiler)", frac=0.8),
      timed("w1", MLA, Status.PASSED, 9.0, "wall"),
    ],
  )
  md = tmp_path / "nvidia_h200.md"
  assert report.main([str(path), "--out", str(tmp_path / "rep"), "--markdown", str(md)]) == 0
  assert f"summary: {md}" in capsys.readouterr().out
  text = md.read_text()
  table = [l for l in text.splitlines() if l.startswith("| `")]
  assert table[0] == f"| `{GEMM}` | - | device (profiler) | 1 / 2 | 2 | 4 | 0.3 |"
  assert f"| `{MLA}` | - | wall | 1 / 1 | 9 | 18 | - |" in table and len(table) == 4
  # Geomean over the three device-timed definitions' medians (0.3, 0.04, 0.8).
  assert f"Geomean SOL fraction (device (profiler)): {(0.3 * 0.04 * 0.8) ** (1 / 3):.3g} over 3 definitions" in text
  furthest = [l for l in text.splitlines() if l[:3] in ("1. ", "2. ", "3. ")]
  assert furthest == [f"1. `{ROUTER}`: 0.04", f"2. `{GEMM}`: 0.3", f"3. `{ATTN}`: 0.8"]
  assert "wall)" not in text.split("Geomean")[1]  # the wall-clock line has no SOL fraction to mix in
  assert report.main([str(path), "--markdown", str(tmp_path / "no" / "such" / "dir.md")]) == 2


# -- peers beside our kernels ---------------------------------------


def peer_line(uuid, definition, peer, latency: float | None, timer: str | None = "device (profiler)", status="passed"):
  return {"definition": definition, "uuid": uuid, "peer": peer, "status": status, "timer": timer, "latency_ms": latency}


def test_peer_columns_ratio_timer_mismatch_and_missing_peer(tmp_path, capsys):
  path = write(
    tmp_path / "gpu.jsonl",
    [
      on("triton", timed("g1", GEMM, Status.PASSED, 1.0, "device (profiler)")),
      on("triton", timed("g2", GEMM, Status.PASSED, 2.0, "device (profiler)")),
      on("mosaic_gpu", timed("g1", GEMM, Status.PASSED, 0.5, "device (profiler)")),
      on("triton", timed("a1", ATTN, Status.PASSED, 1.0, "device (profiler)")),
      on("triton", timed("m1", MLA, Status.PASSED, 1.0, "device (profiler)")),
      on("triton", timed("r1", ROUTER, Status.PASSED, 0.2, "device (profiler)")),
    ],
  )
  peers = tmp_path / "peers.jsonl"
  peers.write_text(
    "".join(
      json.dumps(p) + "\n"
      for p in [
        peer_line("g1", GEMM, "xla dot (cuBLAS)", 1.5),
        peer_line("g2", GEMM, "xla dot (cuBLAS)", 4.0),
        peer_line("g1", GEMM, "slow dot", 3.0),
        peer_line("g2", GEMM, "wrong dot", 0.1, status="incorrect_numerical"),
        peer_line("a1", ATTN, "jax.nn.dot_product_attention[xla]", 0.7, timer="wall"),  # another timer
        peer_line("m1", MLA, "broken", None, timer=None, status="runtime_error"),
      ]
    )
  )
  md = tmp_path / "summary.md"
  assert report.main([str(path), "--peers", str(peers), "--out", str(tmp_path / "rep"), "--markdown", str(md)]) == 0
  printed = capsys.readouterr().out
  rep = report.build(path, out_dir=tmp_path / "rep2", peers=peers)
  lines = {(r[0], r[1]): r[len(report.HEADERS) :] for r in rep.table}
  # Triton GEMM: xla dot's ratios 1.5 / 1 and 4 / 2 (median 1.75) beat the slow dot's 3; the wrong dot failed.
  assert lines[(GEMM, "triton")] == ["xla dot (cuBLAS)", "2.75", "1.75"]
  assert lines[(GEMM, "mosaic_gpu")] == ["xla dot (cuBLAS)", "1.5", "3"]  # the same peer run, against 0.5 ms
  assert lines[(ATTN, "triton")] == ["jax.nn.dot_product_attention[xla]", "n/c", "n/c"]  # wall vs device: n/c
  assert lines[(MLA, "triton")] == ["none passed", "-", "-"]
  assert lines[(ROUTER, "triton")] == ["-", "-", "-"]  # no peer covers it
  assert lines[("total", "")] == ["", "", ""]
  # The peers table: every peer of every row, failures counted, the peer's own timer named.
  ptable = {(r[0], r[1], r[3]): r[4:] for r in rep.peers_table or []}
  assert ptable[(GEMM, "triton", "wrong dot")] == [1, "0 (incorrect_numerical 1)", 0, "-", "-", "-", "-"]
  assert ptable[(GEMM, "triton", "slow dot")] == [1, "1", 1, "device (profiler)", "3", "1", "3"]
  assert ptable[(ATTN, "triton", "jax.nn.dot_product_attention[xla]")] == [1, "1", 0, "wall", "0.7", "-", "n/c"]
  # Markdown: the columns, the direction of the ratio, the geomean over rows with a comparable peer.
  text = md.read_text()
  assert "| best peer | peer ms | peer/ours (>1: ours faster) |" in text
  assert f"| `{GEMM}` | triton | device (profiler) | 2 / 2 | 1.5 | 3 | - | xla dot (cuBLAS) | 2.75 | 1.75 |" in text
  assert f"| `{ROUTER}` | triton | device (profiler) | 1 / 1 | 0.2 | 0.4 | - | - | - | - |" in text
  geomean = (1.75 * 3) ** 0.5
  assert (
    f"Against the best peer (device (profiler)): geomean peer/ours {geomean:.3g} over 2 rows; ours faster in 2" in text
  )
  assert "Peers of 1 rows were timed by another timer" in text
  assert "peer/ours (>1: ours faster)" in printed and "xla dot (cuBLAS)" in printed
  page = (tmp_path / "rep" / "index.html").read_text()
  assert "<h2>Peers</h2>" in page and "wrong dot" in page and "n/c" in page


def test_peer_file_errors(runs, tmp_path, capsys):
  current, _ = runs
  assert report.main([str(current), "--peers", str(tmp_path / "none.jsonl")]) == 2
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps(peer_line("g1", GEMM, "p", 1.0)) + "\n{not json\n")
  assert report.main([str(current), "--peers", str(bad), "--out", str(tmp_path / "r")]) == 2
  assert f"{bad}:2: not a peer result" in capsys.readouterr().err
  # A peers file that matches no workload: the columns say so, nothing is made up.
  other = tmp_path / "other.jsonl"
  other.write_text(json.dumps(peer_line("elsewhere", GEMM, "p", 1.0)) + "\n")
  rep = report.build(current, out_dir=tmp_path / "r2", peers=other)
  assert {tuple(r[len(report.HEADERS) :]) for r in rep.table[:-1]} == {("-", "-", "-")}
  assert "Peers: none ran on these workloads." in rep.summary_markdown


def test_module_entry_point_and_sizes(runs):
  import pathlib
  import sys

  current, _ = runs
  out = subprocess.run(
    [sys.executable, "-m", "jaxkern.report", str(current), "--out", str(current.parent / "m")],
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
    cwd=pathlib.Path(__file__).resolve().parent.parent,
  )
  assert out.returncode == 0 and "report:" in out.stdout, out.stderr[-2000:]
  for path in pathlib.Path(report.__file__).parent.glob("*.py"):
    assert len(path.read_text().splitlines()) <= 450, path.name
