"""Synthetic replay results (our result-line format) for the FlashInfer-Bench
export tests and `make fib-check`: one result of each kind the export
decides on, for real records of the shipped dataset. The numbers are made up
(the log says so); they test the format, they measure nothing.

`EXPORTED` maps each exported result's uuid to its FIB status; the rest
(`LEFT_OUT`) must not become traces.
"""

from __future__ import annotations

import pathlib

from jaxkern import dataset
from jaxkern import results as results_lib
from jaxkern.compare import Status

GEMM = "dense_gemm_bf16_nt_n4096_k4096"
ROUTER = "moe_router_gemm_topk_deepseek41_d5120_e384_topk6"
LOG = "synthetic test result (tests/fib_results.py): not a measurement"
GPU_ENV = {
  "hardware": "NVIDIA H200",
  "backend": "gpu",
  "libs": {"jax": "0.11.2", "jaxlib": "0.11.2"},
  "interpret": False,
}
CPU_ENV = {"hardware": "cpu", "backend": "cpu", "libs": {"jax": "0.12.0.1", "jaxlib": "0.12.0.1"}, "interpret": True}
GEMM_CONFIG = {"block_m": 128, "block_n": 128, "block_k": 64, "group_m": 8, "num_warps": 8, "num_stages": 3}


def _correctness(err: float, matched: float) -> dict:
  return {
    "max_absolute_error": err,
    "max_relative_error": err * 2,
    "matched_ratio": matched,
    "tie_accepted_rows": 0,
    "outputs": {},
  }


def _perf(timer: str, latency: float | None, ref: float | None) -> dict:
  return {
    "timer": timer,
    "latency_ms": latency,
    "reference_latency_ms": ref,
    "speedup_factor": None if latency is None or ref is None else ref / latency,
  }


def traces() -> tuple[list[results_lib.Trace], dict[str, str], dict[str, str]]:
  """(results, exported uuid -> FIB status, left-out uuid -> why)."""
  gemm = dataset.load_workloads(GEMM)
  router = dataset.load_workloads(ROUTER)

  def trace(w, status, env, *, correctness=None, performance=None, scaled=False, config=None):
    return results_lib.Trace(
      definition=w.definition,
      workload=results_lib.WorkloadInfo(
        uuid=w.uuid,
        variant=w.variant,
        axes=dict(w.axes),
        seed=1,
        source="test",
        axes_run={"M": 64} if scaled else None,
        scaled=scaled,
      ),
      evaluation=results_lib.Evaluation(
        status=status,
        environment=env,
        timestamp="2026-12-01T00:00:00+00:00",
        log=LOG,
        correctness=correctness,
        performance=performance,
        config=config,
        config_source="heuristic" if config else None,
      ),
    )

  out = [
    trace(
      gemm[0],
      Status.PASSED,
      GPU_ENV,
      correctness=_correctness(0.004, 1.0),
      performance=_perf("device (profiler)", 0.21, 0.42),
      config=GEMM_CONFIG,
    ),
    trace(
      gemm[1],
      Status.PASSED,
      GPU_ENV,
      correctness=_correctness(0.003, 1.0),
      performance=_perf("wall", 0.25, 0.40),
      config=GEMM_CONFIG,
    ),
    trace(
      gemm[2],
      Status.INCORRECT_NUMERICAL,
      GPU_ENV,
      correctness=_correctness(0.5, 0.97),
      performance=_perf("device (profiler)", 0.2, 0.4),
      config=GEMM_CONFIG,
    ),
    trace(router[0], Status.RUNTIME_ERROR, GPU_ENV, correctness=_correctness(0.0, 0.0)),
    trace(router[1], Status.TIMEOUT, GPU_ENV),
    trace(router[2], Status.INCORRECT_SHAPE, CPU_ENV, correctness=_correctness(0.0, 0.0)),
    # Left out:
    trace(
      gemm[3],
      Status.PASSED,
      CPU_ENV,
      correctness=_correctness(0.004, 1.0),
      performance=_perf("interpret", 900.0, 70.0),
      config=GEMM_CONFIG,
    ),
    trace(
      gemm[4],
      Status.PASSED,
      GPU_ENV,
      correctness=_correctness(0.004, 1.0),
      performance=_perf("device (profiler)", 0.01, 0.02),
      scaled=True,
      config=GEMM_CONFIG,
    ),
    trace(gemm[5], Status.SKIPPED, GPU_ENV),
    trace(
      gemm[6],
      Status.PASSED,
      GPU_ENV,
      correctness=_correctness(0.004, 1.0),
      performance=_perf("device (profiler)", 0.2, None),
      config=GEMM_CONFIG,
    ),
  ]
  exported = {t.workload.uuid: Status(t.status).value.upper() for t in out[:6]}
  left_out = {
    out[6].workload.uuid: "passed without a GPU timing",
    out[7].workload.uuid: "scaled",
    out[8].workload.uuid: "skipped",
    out[9].workload.uuid: "without kernel and reference times",
  }
  return out, exported, left_out


def write(path: str | pathlib.Path) -> tuple[dict[str, str], dict[str, str]]:
  """Writes `traces()` as a results file; returns (exported, left_out)."""
  ts, exported, left_out = traces()
  with results_lib.ResultsWriter(path, resume=False) as w:
    for t in ts:
      w.write(t)
  return exported, left_out
