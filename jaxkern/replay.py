"""Replays recorded workloads: plan each (`jaxkern.plan`: axes, inputs,
config), run kernel and reference, compare, time, and write one result line
per workload as it finishes.

  python -m jaxkern.replay --config smoke|replay|full|PATH.py [--config.FIELD=VALUE ...]

`--config` takes a config file, or the name of one that ships with the
package (`configs/` of the repository). Fields: `jaxkern.replay_config`.
Results: `jaxkern.results` (modelled on FlashInfer-Bench's Trace /
Evaluation; `evaluation.performance.timer` names the timer, see
`jaxkern.bench`); `{time}` in `output` makes each run a new file.
Workloads run in worker processes (`jaxkern.workers`): one stuck past
`timeout_s` is killed, never left behind. The run ends with a summary table
per definition and timer; the exit code is 1 when any workload failed or
any record was malformed (`skipped` workloads are listed, not failures), 2
for a bad or missing config, an output that would overwrite results
(without `resume`) or cannot be written, a missing dataset or an empty
selection, 130 after Ctrl-C.
"""

from __future__ import annotations

import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
from absl import app
from ml_collections import config_dict, config_flags

from jaxkern import _data, backends, command_line, dataset, evaluate, selection, shards
from jaxkern import plan as plan_lib
from jaxkern import results as results_lib
from jaxkern import workers as workers_lib
from jaxkern.compare import Status
from jaxkern.replay_config import default_config, fields_help
from pallas_kernels.shared.common import has_gpu, resolve_interpret

# Defined by `run()`, not at import: worker processes import this module
# (under two names when it is the parent's __main__) and need no flags.
_CONFIG: Any = None

# In `output`, the run's start time: a new results file per run.
TIME_FIELD = "{time}"


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
  if cfg.isolation not in workers_lib.ISOLATIONS:
    return f"--config.isolation must be one of {', '.join(workers_lib.ISOLATIONS)}, got {cfg.isolation!r}"
  if cfg.order not in selection.ORDERS:
    return f"--config.order must be one of {', '.join(selection.ORDERS)}, got {cfg.order!r}"
  kernel_backends = [b for b in backends.NAMES if b != backends.XLA]
  if cfg.backend not in kernel_backends:
    return f"--config.backend must be one of {', '.join(kernel_backends)}, got {cfg.backend!r}"
  if new_file_per_run(cfg) and cfg.resume:
    return (
      f"--config.resume continues one results file: name it with --config.output=PATH "
      f"(this output, {cfg.output}, is a new file per run)"
    )
  if new_file_per_run(cfg) and (cfg.coordinator_address or cfg.num_processes not in (0, 1)):
    return (
      f"the processes of one run share its results file's name: name it with --config.output=PATH "
      f"({cfg.output} names a new file per process)"
    )
  return None


def process_shard(cfg: config_dict.ConfigDict) -> shards.Shard:
  """This process's share of the run: after `jax.distributed.initialize`
  when a coordinator is configured, else the configured (or only) shard."""
  if cfg.coordinator_address:
    jax.distributed.initialize(
      coordinator_address=cfg.coordinator_address,
      num_processes=cfg.num_processes or None,
      process_id=None if cfg.process_id < 0 else cfg.process_id,
    )
    return shards.Shard(jax.process_index(), jax.process_count())
  return shards.Shard(max(cfg.process_id, 0), max(cfg.num_processes, 1))


def new_file_per_run(cfg: config_dict.ConfigDict) -> bool:
  """Whether `output` holds `{time}`: each run writes a file of its own."""
  return TIME_FIELD in str(cfg.output)


def new_results_file(template: str, now: float | None = None) -> pathlib.Path:
  """`template` with `{time}` made the run's start (local time,
  `20261205-143012`; `-2`, `-3`... after it when a run in the same second
  took that name). Creates the file, empty, and its folder."""
  stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
  n = 1
  while True:
    path = pathlib.Path(template.replace(TIME_FIELD, stamp if n == 1 else f"{stamp}-{n}"))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
      with open(path, "x", encoding="utf-8"):
        return path
    except FileExistsError:
      n += 1


def output_problem(path: pathlib.Path, resume: bool) -> str | None:
  """Why the run must not write `path` (results there and no resume; not
  writable), or None. Creates the folder and, if absent, an empty file."""
  if not resume and path.is_file() and path.stat().st_size:
    lines = path.read_bytes().count(b"\n")
    return (
      f"{path} already holds results ({lines} lines) and would be replaced: pass --config.resume=True "
      "to continue it, or another --config.output"
    )
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8"):
      pass
  except OSError as e:
    return f"cannot write --config.output {path}: {e.strerror or e}"
  return None


def replay(cfg: config_dict.ConfigDict, *, log: Callable[[str], None] = print) -> int:
  """Runs a replay; returns the process exit code."""
  import tabulate
  import tqdm

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
  if cfg.isolation == "process":
    # Workers allocate GPU memory as they need it (this process included).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  on_gpu = has_gpu()
  interpret = resolve_interpret(cfg.interpret)
  per_variant = cfg.max_workloads_per_variant
  cap_note = "" if per_variant is not None else f" (auto: {'every record' if on_gpu else 'one per variant'})"
  if per_variant is None:
    per_variant = 0 if on_gpu else 1
  dataset_dir = cfg.dataset_dir or str(dataset.default_dataset_dir())
  sel = selection.Selection(
    definitions=tuple(selection.csv(cfg.definitions)),
    variants=tuple(selection.csv(cfg.variants)),
    uuids=tuple(selection.csv(cfg.uuids)),
    max_per_definition=cfg.max_workloads_per_definition,
    max_per_variant=per_variant,
  )
  try:
    selected = selection.select_workloads(dataset_dir, sel, report)
  except (ValueError, dataset.DatasetError) as e:
    log(f"error: {e}")
    return 2
  if not selected:
    log(
      f"error: the selection matches no workload in {dataset_dir} "
      f"(definitions={cfg.definitions!r}, variants={cfg.variants!r}, uuids={cfg.uuids!r})"
    )
    return 2
  # Shard the whole selection before skipping finished work, so a resumed
  # shard is assigned exactly what it was assigned before.
  assigned = shard.take(selected)
  if new_file_per_run(cfg):
    try:
      out_path = new_results_file(str(cfg.output))
    except OSError as e:
      log(f"error: cannot write --config.output {cfg.output}: {e.strerror or e}")
      return 2
  else:
    out_path = shard.output(cfg.output)
  problem = output_problem(out_path, cfg.resume)
  if problem:
    log(f"error: {problem}")
    return 2
  if shard.count > 1:
    shards.write_manifest(out_path, shard, [w.uuid for w in assigned], len(selected))
  done_traces, bad_lines = results_lib.read_results(out_path)
  for b in bad_lines:
    log(f"resume: {b}: " + ("cut off; its workload runs again" if b.truncated else "ignored"))
  done = {t.workload.uuid for t in done_traces}
  workloads = [w for w in assigned if w.uuid not in done]
  if cfg.order == "interleave":
    workloads = selection.interleave(workloads)
  n_devices = len(workers_lib.local_devices(cfg))
  if done:
    log(f"resume: {len(done)} workloads already in {out_path}, {len(workloads)} to go")
  where = f"shard {shard.index + 1} of {shard.count}, " if shard.count > 1 else ""
  log(
    f"replaying {len(workloads)} workloads from {dataset_dir} on {jax.default_backend()} "
    f"({where}{n_devices} device worker(s) ({cfg.isolation}), scale={cfg.scale}, interpret={interpret}, "
    f"max per variant={per_variant or 'no cap'}{cap_note}) -> {out_path}"
  )
  traces: list[results_lib.Trace] = []
  lock = threading.Lock()
  stop = threading.Event()
  env = evaluate.environment(interpret)

  def make_trace(w: dataset.Workload, status: Status, message: str) -> results_lib.Trace:
    t = evaluate.new_trace(w, cfg.seed, interpret, env)
    t.evaluation.status, t.evaluation.log = status, message
    return t

  with (
    results_lib.ResultsWriter(out_path, resume=True) as writer,
    tqdm.tqdm(total=len(workloads), disable=not cfg.progress, unit="wl", dynamic_ncols=True) as bar,
  ):

    def work(share: list[dataset.Workload], device_index: int) -> None:
      setup = workers_lib.Setup(cfg, dataset_dir, interpret, on_gpu, device_index)
      worker = workers_lib.make_worker(cfg.isolation, setup, make_trace)
      try:
        for w in share:
          if stop.is_set():
            return
          t = worker.run(w, stop)
          if t is None:
            return
          with lock:
            writer.write(t)
            traces.append(t)
            bar.set_description(w.definition[:40])
            bar.update(1)
            bar.set_postfix(passed=sum(x.status == Status.PASSED for x in traces), failed=sum(x.failed for x in traces))
            if not cfg.progress:
              log(progress_line(len(traces), len(workloads), t))
      finally:
        worker.close()

    shares = shards.split_round_robin(workloads, n_devices)
    interrupted = run_workers(work, shares, list(range(n_devices)), stop)
  log(tabulate.tabulate(results_lib.summarize(traces), headers=results_lib.SUMMARY_HEADERS))
  failed = [t for t in traces if t.failed]
  for t in failed[:20]:
    log(f"FAILED {t.definition} {t.workload.uuid}: {t.status}: {t.evaluation.log[:300]}")
  log(
    f"{sum(t.status == Status.PASSED for t in traces)} passed, {len(failed)} failed, "
    f"{sum(t.status == Status.SKIPPED for t in traces)} skipped, {len(errors)} bad records; results in {out_path}"
  )
  if interrupted:
    fixed = out_path if new_file_per_run(cfg) else cfg.output  # a shard resumes under the run's name
    log(f"interrupted: results so far are in {out_path}; --config.output={fixed} --config.resume=True continues it")
    return 130
  return 1 if failed or errors else 0


def progress_line(i: int, n: int, t: results_lib.Trace) -> str:
  """One workload's line in the log (when there is no progress bar)."""
  perf = t.evaluation.performance or {}
  timed = f" {perf['latency_ms']:.4g} ms ({perf.get('timer')})" if perf.get("latency_ms") is not None else ""
  return f"[{i}/{n}] {t.definition} {t.workload.uuid}: {t.status}{timed}"


def run_workers(
  work: Callable[[list, Any], None], shares: list[list], devices: list[Any], stop: threading.Event
) -> bool:
  """Runs `work(share, device)` per local device (in this thread when there
  is one); returns True after Ctrl-C, having asked the workers to stop (and
  waited for them: a worker process is killed, a worker thread finishes its
  workload)."""
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
    for t in threads if len(devices) > 1 else ():
      t.join()
    return True


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  command_line.quiet_absl_logging()
  try:
    cfg = _CONFIG.value if _CONFIG.value is not None else default_config()
  except Exception as e:  # ml_collections raises OSError, or the file's own error
    print(f"error: cannot load --config: {str(e).strip()}", file=sys.stderr)
    sys.exit(2)
  sys.exit(replay(cfg))


def unknown_config_fields(argv: list[str]) -> list[str]:
  """The `--config.FIELD=...` overrides naming no field of the schema."""
  known = set(default_config().keys())
  fields = [a.split("=", 1)[0][len("--config.") :].split(".")[0] for a in argv if a.startswith("--config.")]
  return [f for f in fields if f not in known]


def _config_value(argv: list[str]) -> tuple[int, str] | None:
  """(index in argv, value) of `--config=VALUE` or `--config VALUE`."""
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      return i, a[len("--config=") :]
    if a == "--config" and i + 1 < len(argv):
      return i + 1, argv[i + 1]
  return None


def with_packaged_config(argv: list[str]) -> list[str]:
  """`argv` with `--config NAME`, the name of a config that ships with the
  package (`smoke`, `replay`, `full`), made that file's path, unless a file
  NAME exists here (ml_collections' `:arg` suffix is kept)."""
  found = _config_value(argv)
  if found is None:
    return argv
  i, value = found
  name, sep, arg = value.partition(":")
  if os.path.isfile(name) or name not in _data.config_names():
    return argv
  path = f"{_data.folder('configs') / name}.py{sep}{arg}"
  return [*argv[:i], "--config=" + path if argv[i].startswith("--config=") else path, *argv[i + 1 :]]


def missing_config_file(argv: list[str]) -> str | None:
  """The `--config` path when it names no file (`--config=PATH` or
  `--config PATH`), else None."""
  found = _config_value(argv)
  if found is None:
    return None
  path = found[1].split(":", 1)[0]  # ml_collections' `file.py:arg` form
  return None if os.path.isfile(path) else path


def usage() -> str:
  """What `--help` prints before the flags: this module's doc, then every
  config field with its default and meaning (`jaxkern.replay_config`)."""
  return (
    f"{__doc__}\nConfig fields, each overridable as --config.FIELD=VALUE (FIELD=DEFAULT, then its meaning):\n"
    f"{fields_help()}\n"
  )


def run() -> None:
  """Entry point: a missing config file or a misspelt `--config.FIELD` is
  one message (exit 2; the latter names the valid fields), not a
  traceback."""
  global _CONFIG
  sys.modules["__main__"].__doc__ = usage()  # absl's --help prints the main module's doc
  if _CONFIG is None:
    _CONFIG = config_flags.DEFINE_config_file(
      "config",
      None,
      f"Replay config: a file, or a packaged config's name ({', '.join(_data.config_names())}); "
      "its fields are listed above, with their defaults.",
    )
  sys.argv[1:] = with_packaged_config(sys.argv[1:])
  missing = missing_config_file(sys.argv[1:])
  if missing:
    print(
      f"error: --config file {missing} does not exist (packaged configs by name: {', '.join(_data.config_names())})",
      file=sys.stderr,
    )
    sys.exit(2)
  unknown = unknown_config_fields(sys.argv[1:])
  if unknown:
    print(
      f"error: unknown config field(s) {', '.join(unknown)}\n"
      f"valid --config fields: {', '.join(sorted(default_config().keys()))}",
      file=sys.stderr,
    )
    sys.exit(2)
  app.run(main)


if __name__ == "__main__":
  run()
