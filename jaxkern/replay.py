"""Replays recorded workloads: plan each (`jaxkern.plan`: axes, inputs,
config), run kernel and reference, compare, time, and write one result line
per workload as it finishes.

  python -m jaxkern.replay --config configs/replay.py [--config.FIELD=VALUE ...]

Fields: `jaxkern.replay_config`. Results: `jaxkern.results` (FlashInfer-Bench
Trace / Evaluation shape). The run ends with a summary table per definition;
the exit code is 1 when any workload failed or any record was malformed
(`skipped` workloads are listed, not failures), 2 for a bad config, a missing
dataset or an empty selection, 130 after Ctrl-C.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
import sys
import threading
import time
from typing import Any, Callable

from absl import app
from absl import flags
from absl import logging
import jax
import jaxlib
from ml_collections import config_dict
from ml_collections import config_flags

from jaxkern import bench
from jaxkern import compare as compare_lib
from jaxkern import dataset
from jaxkern import plan as plan_lib
from jaxkern import registry
from jaxkern import results as results_lib
from jaxkern import roofline
from jaxkern import selection
from jaxkern import shards
from jaxkern import tuning
from jaxkern.compare import Status
from jaxkern.replay_config import default_config
from pallas_kernels.common import has_gpu, resolve_interpret

_CONFIG = config_flags.DEFINE_config_file("config", None, "Replay config file (configs/replay.py).")


def derive_seed(uuid: str, seed: int) -> int:
  """A 31-bit seed from a record's uuid and the run's seed."""
  return int.from_bytes(hashlib.sha256(f"{uuid}:{seed}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def environment(interpret: bool) -> dict[str, Any]:
  dev = jax.devices()[0]
  return {"hardware": getattr(dev, "device_kind", str(dev)), "backend": jax.default_backend(),
          "libs": {"jax": jax.__version__, "jaxlib": jaxlib.__version__}, "interpret": interpret}


def new_trace(w: dataset.Workload, seed: int, interpret: bool) -> results_lib.Trace:
  """A result with nothing evaluated yet (status None)."""
  return results_lib.Trace(
      definition=w.definition,
      workload=results_lib.WorkloadInfo(uuid=w.uuid, variant=w.variant, axes=dict(w.axes),
                                        seed=derive_seed(w.uuid, seed), source=f"{w.file}:{w.line}"),
      evaluation=results_lib.Evaluation(
          status=None, environment=environment(interpret),
          timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")))


class _Failed(Exception):
  def __init__(self, status: Status, log: str):
    super().__init__(log)
    self.status = status


def _step(status: Status, what: str, fn: Callable[[], Any]) -> Any:
  """Runs one step of a workload; any exception becomes `status`."""
  try:
    return fn()
  except Exception as e:  # pylint: disable=broad-except
    raise _Failed(status, (what + ": " if what else "") + bench.short_error(e)) from e


def run_workload(op: registry.Op, w: dataset.Workload, cfg: config_dict.ConfigDict, cache: bench.CompileCache,
                 interpret: bool, on_gpu: bool) -> results_lib.Trace:
  """One workload, isolated: every failure becomes its status."""
  trace = new_trace(w, cfg.seed, interpret)
  ev = trace.evaluation
  if not op.implemented:
    ev.status, ev.log = Status.SKIPPED, f"no kernel yet: {op.missing}"
    return trace
  deadline = time.monotonic() + float(cfg.timeout_s)
  try:
    plan = _step(Status.RUNTIME_ERROR, "input synthesis", lambda: plan_lib.plan(
        op, w, size=cfg.scale, seed=trace.workload.seed, blob_root=cfg.blob_root, on_gpu=on_gpu, tuned=cfg.tuned))
    trace.workload.axes_run, trace.workload.scaled = plan.axes_run, plan.scaled
    config, inputs = plan.choice.config, plan.inputs
    ev.config, ev.config_source = tuning.config_to_json(config), plan.choice.source
    kernel = _step(Status.COMPILE_ERROR, "", lambda: cache.get(
        (op.name, "kernel", interpret, config),
        lambda: lambda x: op.kernel(x, interpret=interpret, config=config), inputs))
    reference = _step(Status.RUNTIME_ERROR, "reference", lambda: cache.get((op.name, "reference"),
                                                                           lambda: op.reference, inputs))
    ref = _step(Status.RUNTIME_ERROR, "reference", lambda: jax.block_until_ready(reference(inputs)))
    out = _step(Status.RUNTIME_ERROR, "", lambda: jax.block_until_ready(kernel(inputs)))
    cmp = op.compare(out, ref, inputs=inputs)
    ev.status, ev.correctness = cmp.status, correctness_json(cmp)
    if cmp.status != Status.PASSED:
      ev.log = "; ".join(f"{n}: {o.message}" for n, o in cmp.outputs.items() if o.message)
    if plan.expected is not None:
      exp_cmp = op.compare(out, plan.expected, inputs=inputs)
      ev.expected_output = {"status": exp_cmp.status.value, **correctness_json(exp_cmp)}
    if time.monotonic() > deadline:
      raise _Failed(Status.TIMEOUT, f"exceeded {cfg.timeout_s}s before timing")
    timing = dict(warmup=cfg.warmup, iters=cfg.iters, on_gpu=on_gpu and not interpret, cold_l2=cfg.cold_l2,
                  deadline=deadline)
    k = bench.measure(lambda: kernel(inputs), **timing)
    r = bench.measure(lambda: reference(inputs), **timing)
    ev.performance = {"latency_ms": k["median_ms"], "reference_latency_ms": r["median_ms"],
                      "speedup_factor": r["median_ms"] / k["median_ms"] if k["median_ms"] > 0 else None,
                      "latency_min_ms": k["min_ms"], "latency_max_ms": k["max_ms"], "samples": k["samples"],
                      "warmup": cfg.warmup, "iters": cfg.iters,
                      "timing": ("interpret mode: checks plumbing, not speed" if interpret else k["method"])}
    ev.performance.update(roofline.performance_fields(  # speed_of_light_ms; sol_fraction on a GPU
        lambda: op.cost(plan.axes, inputs=plan.inputs, record=w.record), k["median_ms"],
        device_kind=ev.environment.get("hardware"), measured_on_gpu=on_gpu and not interpret))
  except _Failed as f:
    ev.status, ev.log = f.status, str(f)
  except Exception as e:  # pylint: disable=broad-except
    ev.status, ev.log = Status.RUNTIME_ERROR, bench.short_error(e)
  return trace


def correctness_json(cmp: compare_lib.Comparison) -> dict[str, Any]:
  outs = cmp.outputs.values()
  finite = lambda v: v if math.isfinite(v) else compare_lib._json_float(v)  # pylint: disable=protected-access  # noqa: E731
  return {"max_absolute_error": finite(max((o.max_abs_error for o in outs), default=0.0)),
          "max_relative_error": finite(max((o.max_rel_error for o in outs), default=0.0)),
          "matched_ratio": min((o.matched_ratio for o in outs), default=1.0),
          "tie_accepted_rows": cmp.tie_accepted_rows,
          "outputs": cmp.to_json()}


def check_config(cfg: config_dict.ConfigDict) -> str | None:
  """The first thing wrong with a config, or None."""
  if cfg.scale not in plan_lib.RUN_SIZES:  # the run size; the SPEC names the field `scale`
    return f"--config.scale must be one of {', '.join(plan_lib.RUN_SIZES)}, got {cfg.scale!r}"
  for name in ("warmup", "iters", "max_workloads_per_definition", "seed"):
    if int(cfg[name]) < 0:
      return f"--config.{name} must be >= 0, got {cfg[name]}"
  if cfg.devices not in ("all", "first"):
    return f"--config.devices must be all or first, got {cfg.devices!r}"
  if cfg.num_processes and not (cfg.coordinator_address or 0 <= cfg.process_id < cfg.num_processes):
    return f"--config.process_id must be in [0, {cfg.num_processes}) without a coordinator, got {cfg.process_id}"
  if cfg.max_workloads_per_variant is not None and cfg.max_workloads_per_variant < 0:
    return f"--config.max_workloads_per_variant must be >= 0 or None, got {cfg.max_workloads_per_variant}"
  return None


def process_shard(cfg: config_dict.ConfigDict) -> shards.Shard:
  """This process's share of the run: after `jax.distributed.initialize`
  when a coordinator is configured, else the configured (or only) shard."""
  if cfg.coordinator_address:
    jax.distributed.initialize(coordinator_address=cfg.coordinator_address,
                               num_processes=cfg.num_processes or None,
                               process_id=None if cfg.process_id < 0 else cfg.process_id)
    return shards.Shard(jax.process_index(), jax.process_count())
  return shards.Shard(max(cfg.process_id, 0), max(cfg.num_processes, 1))


def replay(cfg: config_dict.ConfigDict, *, log: Callable[[str], None] = print) -> int:
  """Runs a replay; returns the process exit code."""
  import tabulate  # pylint: disable=g-import-not-at-top
  import tqdm  # pylint: disable=g-import-not-at-top

  problem = check_config(cfg)
  if problem:
    log(f"error: {problem}")
    return 2
  errors: list[dataset.DatasetError] = []

  def report(e: dataset.DatasetError) -> None:
    errors.append(e)
    log(f"skipped record: {e}")

  try:
    shard = process_shard(cfg)  # before anything initializes a JAX backend
  except (ValueError, RuntimeError) as e:
    log(f"error: {e}")
    return 2
  on_gpu = has_gpu()
  interpret = resolve_interpret(cfg.interpret)
  per_variant = cfg.max_workloads_per_variant
  cap_note = "" if per_variant is not None else f" (auto: {'every record' if on_gpu else 'one per variant'})"
  if per_variant is None:
    per_variant = 0 if on_gpu else 1
  dataset_dir = cfg.dataset_dir or str(dataset.default_dataset_dir())
  sel = selection.Selection(
      definitions=tuple(selection.csv(cfg.definitions)), variants=tuple(selection.csv(cfg.variants)),
      uuids=tuple(selection.csv(cfg.uuids)), max_per_definition=cfg.max_workloads_per_definition,
      max_per_variant=per_variant)
  try:
    selected = selection.select_workloads(dataset_dir, sel, report)
  except (ValueError, dataset.DatasetError) as e:
    log(f"error: {e}")
    return 2
  if not selected:
    log(f"error: the selection matches no workload in {dataset_dir} "
        f"(definitions={cfg.definitions!r}, variants={cfg.variants!r}, uuids={cfg.uuids!r})")
    return 2
  # Shard the whole selection before skipping finished work, so a resumed
  # shard is assigned exactly what it was assigned before.
  assigned = shard.take(selected)
  out_path = shard.output(cfg.output)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  if shard.count > 1:
    shards.write_manifest(out_path, shard, [w.uuid for w in assigned], len(selected))
  done = results_lib.read_done_uuids(out_path) if cfg.resume else set()
  workloads = [w for w in assigned if w.uuid not in done]
  devices = jax.local_devices() if cfg.devices == "all" else jax.local_devices()[:1]
  if done:
    log(f"resume: {len(done)} workloads already in {out_path}, {len(workloads)} to go")
  where = f"shard {shard.index + 1} of {shard.count}, " if shard.count > 1 else ""
  log(f"replaying {len(workloads)} workloads from {dataset_dir} on {jax.default_backend()} "
      f"({where}{len(devices)} device worker(s), scale={cfg.scale}, interpret={interpret}, "
      f"max per variant={per_variant or 'no cap'}{cap_note}) -> {out_path}")
  traces: list[results_lib.Trace] = []
  lock = threading.Lock()
  stop = threading.Event()
  with results_lib.ResultsWriter(out_path, resume=cfg.resume) as writer, \
      tqdm.tqdm(total=len(workloads), disable=not cfg.progress, unit="wl", dynamic_ncols=True) as bar:

    def work(share: list[dataset.Workload], device: Any) -> None:
      cache = bench.CompileCache()
      for w in share:
        if stop.is_set():
          return
        op = registry.get(w.definition, dataset_dir)

        def timed_out(w=w):
          t = new_trace(w, cfg.seed, interpret)
          t.evaluation.status, t.evaluation.log = Status.TIMEOUT, f"no result within {cfg.timeout_s}s"
          return t

        def one(w=w, op=op):
          with jax.default_device(device):
            return run_workload(op, w, cfg, cache, interpret, on_gpu)

        t = bench.run_isolated(one, cfg.timeout_s, timed_out)
        with lock:
          writer.write(t)
          traces.append(t)
          bar.set_description(w.definition[:40])
          bar.update(1)
          bar.set_postfix(passed=sum(x.status == Status.PASSED for x in traces),
                          failed=sum(x.status.failed for x in traces))

    interrupted = run_workers(work, shards.split_round_robin(workloads, len(devices)), devices, stop)
  log(tabulate.tabulate(results_lib.summarize(traces), headers=results_lib.SUMMARY_HEADERS))
  failed = [t for t in traces if t.status.failed]
  for t in failed[:20]:
    log(f"FAILED {t.definition} {t.workload.uuid}: {t.status.value}: {t.evaluation.log[:300]}")
  log(f"{sum(t.status == Status.PASSED for t in traces)} passed, {len(failed)} failed, "
      f"{sum(t.status == Status.SKIPPED for t in traces)} skipped, {len(errors)} bad records; results in {out_path}")
  if interrupted:
    log("interrupted: results so far are on disk; rerun with --config.resume=True to continue")
    return 130
  return 1 if failed or errors else 0


def run_workers(work: Callable[[list, Any], None], shares: list[list], devices: list[Any],
                stop: threading.Event) -> bool:
  """Runs `work(share, device)` per local device (in this thread when there
  is one); returns True after Ctrl-C, having asked the workers to stop."""
  try:
    if len(devices) == 1:
      work(shares[0], devices[0])
      return False
    threads = [threading.Thread(target=work, args=(share, dev), daemon=True) for share, dev in zip(shares, devices)]
    for t in threads:
      t.start()
    for t in threads:
      while t.is_alive():
        t.join(0.2)
    return False
  except KeyboardInterrupt:
    stop.set()
    return True


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # jax's backend probing is noise here
  cfg = _CONFIG.value if _CONFIG.value is not None else default_config()
  code = replay(cfg)
  if code == 130 or any(t.is_alive() for t in bench.WORKERS):
    # After Ctrl-C or a timeout, XLA's runtime can abort during interpreter
    # shutdown (an abandoned or interrupted call); results are already on
    # disk, so leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)


def unknown_config_fields(argv: list[str]) -> list[str]:
  """The `--config.FIELD=...` overrides naming no field of the schema."""
  known = set(default_config().keys())
  fields = [a.split("=", 1)[0][len("--config."):].split(".")[0] for a in argv if a.startswith("--config.")]
  return [f for f in fields if f not in known]


def run() -> None:
  """Entry point: a misspelt `--config.FIELD` is a usage error naming the
  valid fields (exit 2), not a traceback."""
  unknown = unknown_config_fields(sys.argv[1:])
  if unknown:
    print(f"error: unknown config field(s) {', '.join(unknown)}\n"
          f"valid --config fields: {', '.join(sorted(default_config().keys()))}", file=sys.stderr)
    sys.exit(2)
  app.run(main)


if __name__ == "__main__":
  run()
