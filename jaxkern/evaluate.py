"""Evaluating one recorded workload: plan it (`jaxkern.plan`: axes, inputs,
backend and config), run kernel and reference, compare, time, and return its
result (`jaxkern.results.Trace`). Every failure becomes the result's status:
bad inputs or a crashing reference `runtime_error`, a kernel that fails to
lower or compile `compile_error`, a wrong answer `incorrect_*`, a run past
`timeout_s` `timeout`. The replay (`jaxkern.replay`) and its worker
processes (`jaxkern.workers`) call `run_workload`.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jaxlib
from ml_collections import config_dict

from jaxkern import bench, dataset, registry, roofline, tuning
from jaxkern import compare as compare_lib
from jaxkern import plan as plan_lib
from jaxkern import results as results_lib
from jaxkern.compare import Status


def derive_seed(uuid: str, seed: int) -> int:
  """A 31-bit seed from a record's uuid and the run's seed."""
  return int.from_bytes(hashlib.sha256(f"{uuid}:{seed}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def environment(interpret: bool) -> dict[str, Any]:
  dev = jax.devices()[0]
  return {
    "hardware": getattr(dev, "device_kind", str(dev)),
    "backend": jax.default_backend(),
    # jaxlib re-exports its documented __version__ without `as`, which pyright reads as private.
    "libs": {"jax": jax.__version__, "jaxlib": jaxlib.__version__},  # pyright: ignore[reportPrivateImportUsage]
    "interpret": interpret,
  }


def new_trace(w: dataset.Workload, seed: int, interpret: bool, env: dict[str, Any] | None = None) -> results_lib.Trace:
  """A result with nothing evaluated yet (status None)."""
  return results_lib.Trace(
    definition=w.definition,
    workload=results_lib.WorkloadInfo(
      uuid=w.uuid, variant=w.variant, axes=dict(w.axes), seed=derive_seed(w.uuid, seed), source=f"{w.file}:{w.line}"
    ),
    evaluation=results_lib.Evaluation(
      status=None,
      environment=env if env is not None else environment(interpret),
      timestamp=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    ),
  )


class _Failed(Exception):
  def __init__(self, status: Status, log: str):
    super().__init__(log)
    self.status = status


def _step(status: Status, what: str, fn: Callable[[], Any]) -> Any:
  """Runs one step of a workload; any exception becomes `status`."""
  try:
    return fn()
  except Exception as e:
    raise _Failed(status, (what + ": " if what else "") + bench.short_error(e)) from e


def run_workload(
  op: registry.Op,
  w: dataset.Workload,
  cfg: config_dict.ConfigDict,
  cache: bench.CompileCache,
  interpret: bool,
  on_gpu: bool,
) -> results_lib.Trace:
  """One workload, isolated: every failure becomes its status."""
  trace = new_trace(w, cfg.seed, interpret)
  ev = trace.evaluation
  if not op.implemented:
    ev.status, ev.log = Status.SKIPPED, f"no kernel yet: {op.missing}"
    return trace
  deadline = time.monotonic() + float(cfg.timeout_s)
  try:
    plan = _step(
      Status.RUNTIME_ERROR,
      "inputs",
      lambda: plan_lib.plan(
        op,
        w,
        size=cfg.scale,
        seed=trace.workload.seed,
        blob_root=cfg.blob_root,
        on_gpu=on_gpu,
        tuned=cfg.tuned,
        backend=cfg.backend,
      ),
    )
    trace.workload.axes_run, trace.workload.scaled = plan.axes_run, plan.scaled
    config, backend, inputs = plan.choice.config, plan.choice.backend, plan.inputs
    ev.backend, ev.config, ev.config_source = backend, tuning.config_to_json(config), plan.choice.source
    kernel_key = (op.name, "kernel", backend, interpret, config)
    kernel = _step(
      Status.COMPILE_ERROR,
      "",
      lambda: cache.get(
        kernel_key, lambda: lambda x: op.kernel(x, interpret=interpret, config=config, backend=backend), inputs
      ),
    )
    reference = _step(
      Status.RUNTIME_ERROR, "reference", lambda: cache.get((op.name, "reference"), lambda: op.reference, inputs)
    )
    ref = _step(Status.RUNTIME_ERROR, "reference", lambda: jax.block_until_ready(reference(inputs)))
    out = _step(Status.RUNTIME_ERROR, "", lambda: jax.block_until_ready(kernel(inputs)))
    cmp = op.compare(out, ref, inputs=inputs)
    ev.status, ev.correctness = cmp.status, correctness_json(cmp)
    if cmp.status != Status.PASSED:
      ev.log = _messages(cmp)
    if plan.expected is not None:
      exp_cmp = op.compare(out, plan.expected, inputs=inputs)
      ev.expected_output = {"status": exp_cmp.status.value, **correctness_json(exp_cmp)}
      if exp_cmp.status != Status.PASSED and ev.status == Status.PASSED:
        ev.status, ev.log = exp_cmp.status, "recorded expected_output: " + _messages(exp_cmp)
    if time.monotonic() > deadline:
      raise _Failed(Status.TIMEOUT, f"exceeded {cfg.timeout_s}s before timing")
    timing = dict(
      warmup=cfg.warmup,
      iters=cfg.iters,
      on_gpu=on_gpu and not interpret,
      interpret=interpret,
      cold_l2=cfg.cold_l2,
      deadline=deadline,
    )
    k = bench.measure(lambda: kernel(inputs), kernel_names=cache.kernel_names(kernel_key, inputs), **timing)
    r = bench.measure(lambda: reference(inputs), **timing)
    ev.performance = performance_json(k, r, cfg, cold_l2=cfg.cold_l2 and on_gpu and not interpret)
    ev.performance.update(
      roofline.performance_fields(  # speed_of_light_ms; sol_fraction on a GPU
        lambda: op.cost(plan.axes, inputs=plan.inputs, record=w.record, config=config),
        k["median_ms"],
        device_kind=ev.environment.get("hardware"),
        measured_on_gpu=on_gpu and not interpret,
      )
    )
  except _Failed as f:
    ev.status, ev.log = f.status, str(f)
  except Exception as e:
    ev.status, ev.log = Status.RUNTIME_ERROR, bench.short_error(e)
  return trace


def _messages(cmp: compare_lib.Comparison) -> str:
  return "; ".join(f"{n}: {o.message}" for n, o in cmp.outputs.items() if o.message)


def performance_json(
  k: dict[str, Any], r: dict[str, Any], cfg: config_dict.ConfigDict, *, cold_l2: bool
) -> dict[str, Any]:
  """`evaluation.performance` from the kernel's and the reference's
  `bench.measure` results. `latency_ms` is the whole op (on the device
  timer: Pallas kernels plus XLA glue), `kernel_latency_ms` the Pallas
  kernels alone (device timer only); a speedup only between equal timers."""
  comparable = k["median_ms"] > 0 and r["timer"] == k["timer"]
  perf = {
    "timer": k["timer"],
    "latency_ms": k["median_ms"],
    "latency_min_ms": k["min_ms"],
    "latency_max_ms": k["max_ms"],
    "reference_latency_ms": r["median_ms"],
    "speedup_factor": r["median_ms"] / k["median_ms"] if comparable else None,
    "samples": k["samples"],
    "warmup": cfg.warmup,
    "iters": cfg.iters,
    "cold_l2": cold_l2,
    "method": k["method"],
  }
  if k.get("kernel_median_ms") is not None:
    perf.update(
      kernel_latency_ms=k["kernel_median_ms"],
      kernel_latency_min_ms=k["kernel_min_ms"],
      kernel_latency_max_ms=k["kernel_max_ms"],
    )
  if r["timer"] != k["timer"]:
    perf["reference_timer"] = r["timer"]
  notes = [n for n in (k.get("note"), r.get("note") and "reference: " + r["note"]) if n]
  if notes:
    perf["timer_note"] = "; ".join(notes)
  return perf


def correctness_json(cmp: compare_lib.Comparison) -> dict[str, Any]:
  outs = cmp.outputs.values()
  finite = lambda v: v if math.isfinite(v) else compare_lib._json_float(v)  # noqa: E731
  return {
    "max_absolute_error": finite(max((o.max_abs_error for o in outs), default=0.0)),
    "max_relative_error": finite(max((o.max_rel_error for o in outs), default=0.0)),
    "matched_ratio": min((o.matched_ratio for o in outs), default=1.0),
    "tie_accepted_rows": cmp.tie_accepted_rows,
    "outputs": cmp.to_json(),
  }
