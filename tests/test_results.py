"""Result files (`jaxkern.results`): bad and truncated lines are reported,
never silently dropped; the writer never destroys results; the summary
never mixes timers."""

import json
import pathlib
import subprocess
import sys

import pytest

from jaxkern import results
from jaxkern.compare import Status

REPO = pathlib.Path(__file__).resolve().parent.parent


def trace(uuid, definition="d", status=Status.PASSED, timer="device (profiler)", latency=1.0):
  perf = None if timer is None else {"timer": timer, "latency_ms": latency, "reference_latency_ms": 2 * latency}
  return results.Trace(
    definition=definition,
    workload=results.WorkloadInfo(uuid=uuid, variant=None, axes={"M": 1}, seed=0, source="x:1"),
    evaluation=results.Evaluation(status=status, environment={}, timestamp="t", performance=perf),
  )


def line(t):
  return json.dumps(t.to_json()) + "\n"


def test_bad_and_truncated_lines_are_reported(tmp_path, capsys):
  path = tmp_path / "r.jsonl"
  path.write_text(line(trace("a")) + "not json\n" + line(trace("b")) + '{"definition": "d", "work')
  traces, bad = results.read_results(path)
  assert [t.workload.uuid for t in traces] == ["a", "b"]
  assert [(b.line, b.truncated) for b in bad] == [(2, False), (4, True)]
  assert "truncated last line" in str(bad[1]) and str(bad[1]).startswith(f"{path}:4:")
  assert [t.workload.uuid for t in results.read_traces(path)] == ["a", "b"]
  err = capsys.readouterr().err
  assert f"{path}:2: not a result line" in err and f"{path}:4: truncated last line" in err
  seen = []
  results.read_traces(path, on_bad_line=seen.append)
  assert len(seen) == 2 and not capsys.readouterr().err
  assert results.read_done_uuids(path) == {"a", "b"}
  assert results.read_results(tmp_path / "absent.jsonl") == ([], [])


def test_the_report_says_a_line_is_truncated(tmp_path):
  path = tmp_path / "r.jsonl"
  path.write_text(line(trace("a")) + '{"definition": "d", "work')
  p = subprocess.run(
    [sys.executable, "-m", "jaxkern.report", str(path), "--out", str(tmp_path / "rep")],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=REPO,
  )
  assert f"{path}:2: truncated last line" in p.stderr, p.stdout + p.stderr


def test_writer_never_destroys_results(tmp_path):
  path = tmp_path / "r.jsonl"
  with results.ResultsWriter(path, resume=False) as w:  # absent file
    w.write(trace("a"))
  with pytest.raises(FileExistsError, match="already holds results"):
    results.ResultsWriter(path, resume=False)
  with open(path, "a") as f:
    f.write('{"definition": "d", "wo')  # a run cut off mid-write
  with results.ResultsWriter(path, resume=True) as w:
    w.write(trace("b"))
  assert [t.workload.uuid for t in results.read_results(path)[0]] == ["a", "b"]
  assert results.read_results(path)[1] == []  # the truncated tail was cut off, the rest kept
  empty = tmp_path / "e.jsonl"
  empty.write_text("")
  results.ResultsWriter(empty, resume=False).close()  # nothing to lose


def test_summary_rows_never_mix_timers():
  traces = [
    trace("a", timer="device (profiler)", latency=1.0),
    trace("b", timer="device (profiler)", latency=3.0),
    trace("c", timer="wall", latency=100.0),
    trace("d", status=Status.COMPILE_ERROR, timer=None),
    trace("e", definition="other", timer="interpret", latency=7.0),
  ]
  rows = [dict(zip(results.SUMMARY_HEADERS, r)) for r in results.summarize(traces)]
  assert [(r["definition"], r["timer"], r["n"], r["failed"], r["kernel ms"]) for r in rows] == [
    ("d", "device (profiler)", 3, 1, "2"),
    ("d", "wall", 1, 0, "100"),
    ("other", "interpret", 1, 0, "7"),
  ]
  assert results.timer_of(traces[3]) is None
  only_failed = [dict(zip(results.SUMMARY_HEADERS, r)) for r in results.summarize([traces[3]])]
  assert [(r["timer"], r["n"], r["kernel ms"]) for r in only_failed] == [("-", 1, "-")]
