"""`python -m jaxkern.report`: from a small crafted results file and a
baseline, the page and its PNGs are written, the page shows every plot, and
the printed tables count right. With chromium on the machine, the page is
also rendered headless to a screenshot."""

import json
import shutil
import subprocess

import pytest

from jaxkern import report
from jaxkern import results
from jaxkern.compare import Status

GEMM = "dense_gemm_bf16_nt_n4096_k4096"        # output C bf16: atol 0.005
ROUTER = "moe_router_gemm_topk_deepseek41_d5120_e384_topk6"  # expert_ids top-k, expert_weights f32: atol 2e-5
ATTN = "noncausal_dense_attention_h32_d64"     # output o bf16
MLA = "sparse_mla_prefill_h64_d512_k128"


def trace(uuid, definition, status, errors=None, latency=None, ref=None, sol=None, frac=None, log="", axes=None):
  """A result line; `errors`: output -> max abs error."""
  ev = results.Evaluation(status=status, environment={"hardware": "NVIDIA H200", "backend": "gpu",
                                                      "libs": {"jax": "0.11.2"}, "interpret": False},
                          timestamp="2026-11-30T00:00:00+00:00", log=log)
  if errors is not None:
    ev.correctness = {"outputs": {n: {"status": "passed", "max_abs_error": e, "max_rel_error": 0.0,
                                      "matched_ratio": 1.0, "tie_accepted_rows": 0, "message": ""}
                                  for n, e in errors.items()}}
  if latency is not None:
    ev.performance = {"latency_ms": latency, "reference_latency_ms": ref, "speed_of_light_ms": sol}
    if frac is not None:
      ev.performance["sol_fraction"] = frac
  return results.Trace(definition=definition, evaluation=ev,
                       workload=results.WorkloadInfo(uuid=uuid, variant=None, axes={"M": 8}, seed=0, source="x",
                                                        axes_run=axes))


def write(path, traces):
  path.write_text("".join(json.dumps(t.to_json()) + "\n" for t in traces))
  return path


@pytest.fixture
def runs(tmp_path):
  current = write(tmp_path / "current.jsonl", [
      trace("g1", GEMM, Status.PASSED, {"C": 0.01}, 1.0, 2.0, 0.5, 0.5),
      trace("g2", GEMM, Status.INCORRECT_NUMERICAL, {"C": 0.5}, 1.0, 2.0, 0.5, 0.5, log="C: 3 of 9 elements"),
      trace("g3", GEMM, Status.PASSED, {"C": 0.0}, 2.0, 2.0, 0.5, 0.25),
      trace("r1", ROUTER, Status.PASSED, {"expert_ids": 5.0, "expert_weights": 1e-6}, 0.1, 0.2, 0.01, 0.1),
      trace("a1", ATTN, Status.RUNTIME_ERROR, log="boom"),
      trace("a2", ATTN, Status.INCORRECT_NUMERICAL, {"o": "inf"}, 0.3, 0.1, 0.03, 0.1),
      trace("m1", MLA, Status.SKIPPED, log="no kernel yet"),
  ])
  baseline = write(tmp_path / "baseline.jsonl", [
      trace("g1", GEMM, Status.INCORRECT_NUMERICAL, {"C": 0.5}, 2.0, 2.0, 0.5, 0.25),  # fixed, 2x faster now
      trace("g2", GEMM, Status.PASSED, {"C": 0.001}, 0.5, 2.0, 0.5, 1.0),             # broke, 2x slower
      trace("g3", GEMM, Status.PASSED, {"C": 0.0}, 2.0, 2.0, 0.5, 0.25),              # same
      trace("a1", ATTN, Status.TIMEOUT, log="slow"),                                   # other change
      trace("r1", ROUTER, Status.PASSED, {"expert_weights": 0.0}, 0.2, 0.2, axes={"M": 2}),  # shrunk: no ratio
      trace("old", ATTN, Status.PASSED, {"o": 0.0}, 1.0, 1.0, 0.1, 0.1),              # only in the baseline
  ])
  return current, baseline


def cells(text, name):
  """The cells of the first table line of `name` in printed text."""
  return next(l.split() for l in text.splitlines() if l.split() and l.split()[0] == name)


def test_table_counts_and_error_ratios(runs):
  current, _ = runs
  rep = report.build(current, out_dir=current.parent / "rep")
  rows = {r[0]: r for r in rep.table}
  assert rows[GEMM][1:5] == [3, 2, 1, 0]
  assert rows[GEMM][5] == "100 (C)"                 # 0.5 / 0.005
  assert rows[ROUTER][1:5] == [1, 1, 0, 0]
  assert rows[ROUTER][5] == "0.05 (expert_weights)"  # 1e-6 / 2e-5; the top-k ids have no tolerance
  assert rows[ATTN][1:5] == [2, 0, 2, 0] and rows[ATTN][5] == "inf (o)"
  assert rows[MLA][1:5] == [1, 0, 0, 1] and rows[MLA][5] == "-"
  assert rows["total"][1:5] == [7, 3, 3, 1]
  assert rows[GEMM][6:] == ["1", "2", "0.5", "0.5"]   # medians: kernel, reference, SOL ms, SOL fraction
  assert cells(rep.text, GEMM)[1:5] == ["3", "2", "1", "0"]
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
  # matched, axes differ, fixed, broke, other, only here, only in baseline, median latency ratio (0.5, 2, 1).
  assert cells(changes, GEMM)[1:] == ["3", "0", "1", "1", "0", "0", "0", "1"]
  assert cells(changes, ATTN)[1:] == ["1", "0", "0", "0", "1", "1", "1", "-"]
  assert cells(changes, ROUTER)[1:] == ["1", "1", "0", "0", "0", "0", "0", "-"]
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


@pytest.mark.slow  # a subprocess
@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_page_renders_headless(runs):
  current, baseline = runs
  rep = report.build(current, baseline=baseline, out_dir=current.parent / "shot")
  shot = rep.html_path.parent / "screenshot.png"
  subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                  "--window-size=1300,3000", f"--screenshot={shot}", rep.html_path.as_uri()],
                 check=True, capture_output=True, timeout=120)
  assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20000
