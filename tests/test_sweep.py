"""The config sweep tool."""

import json
import pathlib
import subprocess
import sys
from typing import Any, cast

import pytest
from absl import app

from jaxkern import registry, sweep

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_parse_axes():
  assert sweep.parse_axes("B=1, Nq=2352,Nk=51") == {"B": 1, "Nq": 2352, "Nk": 51}
  assert sweep.parse_axes("") == {}
  for bad in ("M", "M=x", "M=-1"):
    with pytest.raises(app.UsageError, match="NAME=INT"):
      sweep.parse_axes(bad)


def test_sweep_runs_checks_and_times_candidates():
  op = registry.get("moe_router_gemm_topk_deepseek41_d5120_e384_topk6")
  rows = sweep.sweep(
    op, op.validated_axes({"M": 3}), seed=0, warmup=0, iters=1, interpret=True, max_configs=2, lower_only=False
  )
  assert len(rows) == 2 and {r["backend"] for r in rows} == {"triton"}
  assert all(r["status"] == "passed" and r["latency_ms"] > 0 for r in rows)
  assert any(r["heuristic"] for r in rows)  # the heuristic's choice is among the first candidates


@pytest.mark.slow  # a subprocess
def test_sweep_command_line_lower_only(tmp_path):
  out = tmp_path / "sweep.jsonl"
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxkern.sweep",
      "--definition=noncausal_dense_attention_h32_d64",
      "--axes=B=1,Nq=2352,Nk=51",
      "--lower_only",
      "--noaot",
      f"--output={out}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=REPO,
  )
  assert p.returncode == 0, p.stderr
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  op = registry.get("noncausal_dense_attention_h32_d64")
  inputs = op.make_inputs({"B": 1, "Nq": 2352, "Nk": 51})
  per_backend = {b: len(op.candidate_configs(inputs, backend=b)) for b in op.backends}
  assert set(per_backend) == {"triton", "mosaic_gpu"}  # one ranking over both backends' candidates
  assert len(rows) == sum(per_backend.values()) and {r["backend"] for r in rows} == set(per_backend)
  assert all(r["status"] == "lowered" for r in rows) and "heuristic" in p.stdout


@pytest.mark.slow  # a subprocess
def test_write_tuned_then_replay_uses_it(tmp_path):
  """`--write_tuned` records the fastest correct (backend, config) for the
  shape bucket; the next replay on this device kind runs it and says it
  came from there."""
  from jaxkern import dataset

  name = "moe_router_gemm_topk_deepseek41_d5120_e384_topk6"
  env = {
    "PYTHONPATH": str(REPO),
    "PATH": "/usr/bin:/bin",
    "JAX_PLATFORMS": "cpu",
    "JAXKERN_TUNED_DIR": str(tmp_path / "tuned"),
  }
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxkern.sweep",
      f"--definition={name}",
      "--axes=M=3",
      "--max_configs=3",
      "--warmup=0",
      "--iters=1",
      "--write_tuned",
      "--noaot",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=tmp_path,
    env=env,
  )
  assert p.returncode == 0, p.stdout + p.stderr
  [table] = (tmp_path / "tuned").glob("*.json")
  op = registry.get(name)
  [(backend, entry)] = json.loads(table.read_text())["entries"]["moe_router"][
    op.bucket(op.input_shapes({"M": 3}))
  ].items()
  assert backend == "triton" and entry["definition"] == name
  record = next(w for w in dataset.load_workloads(name) if w.axes["M"] == 3)
  out = tmp_path / "r.jsonl"
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxkern.replay",
      f"--config={REPO}/configs/smoke.py",
      f"--config.uuids={record.uuid}",
      f"--config.output={out}",
      "--config.progress=False",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=tmp_path,
    env=env,
  )
  assert p.returncode == 0, p.stdout + p.stderr
  [line] = [json.loads(l) for l in out.read_text().splitlines()]
  assert line["evaluation"]["config_source"] == "tuned" and line["evaluation"]["backend"] == "triton"
  assert line["evaluation"]["config"] == entry["config"]
  assert line["evaluation"]["status"] == "passed"


class _FakeCompiler:
  """Stands in for `jaxkern.aot.Compiler`: rejects the first config it sees."""

  def __init__(self):
    self.calls = 0

  def compile(self, fn, shapes):
    from jaxkern import aot

    self.calls += 1
    assert set(shapes) == {"hidden", "weight", "bias", "routed_scaling_factor"}
    k = aot.KernelReport(
      "moe_router_reduce_route",
      registers=255,
      smem_bytes=512,
      spill_stores=200,
      spill_loads=200,
      matrix_ops="none",
      ctas_per_sm=2,
    )
    if self.calls == 1:
      k.status = aot.SPILLS
    else:
      k.spill_stores = k.spill_loads = 0
    return aot.CompileReport([k], 0.1)


def test_sweep_skips_configs_the_sm90a_compile_rejects():
  op = registry.get("moe_router_gemm_topk_deepseek41_d5120_e384_topk6")
  compiler = _FakeCompiler()
  rows = sweep.sweep(
    op,
    op.validated_axes({"M": 3}),
    seed=0,
    warmup=0,
    iters=1,
    interpret=True,
    max_configs=2,
    lower_only=False,
    compiler=compiler,
  )
  assert compiler.calls == 2
  assert rows[0]["status"] == "spills" and rows[0]["latency_ms"] is None and "200/200" in rows[0]["log"]
  assert rows[0]["aot"]["kernels"][0]["spill_stores"] == 200
  assert rows[1]["status"] == "passed" and rows[1]["aot"]["status"] == "ok"


def test_max_configs_caps_the_total_taking_backends_in_turn():
  """`--max_configs=N` is N candidates in all, not per backend: taken in
  turn from each backend's list, so each backend's heuristic comes first."""
  assert sweep.take_candidates({"triton": [1, 2, 3], "mosaic_gpu": [7, 8]}, 3) == [
    ("triton", 1),
    ("mosaic_gpu", 7),
    ("triton", 2),
  ]
  assert sweep.take_candidates({"triton": [1, 2, 3], "mosaic_gpu": [7]}, 0) == [
    ("triton", 1),
    ("mosaic_gpu", 7),
    ("triton", 2),
    ("triton", 3),
  ]
  op = registry.get("dense_gemm_bf16_nt_n4096_k4096")
  rows = sweep.sweep(
    op, op.validated_axes({"M": 16}), seed=0, warmup=0, iters=1, interpret=True, max_configs=3, lower_only=True
  )
  assert [(r["backend"], r["heuristic"]) for r in rows] == [
    ("triton", True),
    ("mosaic_gpu", True),
    ("triton", False),
  ]
  assert all(r["status"] == "lowered" for r in rows)


class _FailingCompiler:
  """Stands in for `jaxkern.aot.Compiler`: every compile fails the way a
  Mosaic GPU lowering does, with a message of several lines."""

  MESSAGE = "ValueError: shared memory exceeded\n  requested 262144 bytes\n  the limit is 232448 bytes\n  fourth line"

  def compile(self, fn, shapes):
    from jaxkern import aot

    k = aot.KernelReport("mosaic_gpu('tensor<16x4096xbf16>') -> ('tensor<16x4096xbf16>',)", error=self.MESSAGE)
    k.status = aot.ERROR
    return aot.CompileReport([k], 0.1, self.MESSAGE)


def test_a_failing_candidate_names_kernel_config_and_message(capsys, monkeypatch):
  """An sm_90a compile failure and a lowering failure each name the
  definition, the backend's kernel, the config and the first lines of the
  compiler's own message, in the row's log and in the printed line."""
  op = registry.get("moe_router_gemm_topk_deepseek41_d5120_e384_topk6")
  axes = op.validated_axes({"M": 3})
  compiler = cast(Any, _FailingCompiler())  # a stand-in for jaxkern.aot.Compiler
  [row] = sweep.sweep(
    op, axes, seed=0, warmup=0, iters=1, interpret=True, max_configs=1, lower_only=True, compiler=compiler
  )
  printed = capsys.readouterr().out
  config = op.choose_config(op.input_shapes(axes), backend="triton")
  assert row["status"] == "aot_error" and row["aot"]["status"] == "error"
  for text in (row["log"], printed):
    assert op.name in text and "triton kernel moe_router" in text and str(config) in text, text
    assert "shared memory exceeded" in text and "the limit is 232448 bytes" in text, text
    assert "fourth line" not in text  # the first lines only

  def fail_to_lower(fn, inputs):
    raise ValueError("Mosaic says no\nbecause of this\nand that\nand more")

  monkeypatch.setattr(sweep, "lower_for_h100", fail_to_lower)
  [row] = sweep.sweep(op, axes, seed=0, warmup=0, iters=1, interpret=True, max_configs=1, lower_only=True)
  printed = capsys.readouterr().out
  for text in (row["log"], printed):
    assert op.name in text and "triton kernel moe_router" in text and str(config) in text, text
    assert "ValueError: Mosaic says no" in text and "and that" in text and "and more" not in text, text


@pytest.mark.slow  # a subprocess
def test_command_line_help_lists_every_flag_with_its_default():
  p = subprocess.run(
    [sys.executable, "-m", "jaxkern.sweep", "--help"], capture_output=True, text=True, timeout=300, cwd=REPO
  )
  text = " ".join(p.stdout.split())
  for flag, default in (
    ("--max_configs", "(default: '0')"),
    ("--warmup", "(default: '2')"),
    ("--iters", "(default: '5')"),
    ("--backend", "(default: 'pallas')"),
    ("--[no]write_tuned", "(default: 'false')"),
  ):
    assert f"{flag}:" in text and default in text.split(f"{flag}:")[1].split(" --")[0], (flag, p.stderr[-2000:])
  assert "in total, over all backends" in text and "--definition:" in text and "--axes:" in text
