"""Replays recorded workloads: synthesize inputs, run kernel and reference,
compare, time, and write one JSON line per workload as it finishes.

  python -m jaxkern.replay --config configs/replay.py [--config.FIELD=VALUE ...]

Result lines follow FlashInfer-Bench's Trace/Evaluation naming (SPEC section 7):
`{"definition", "workload": {"uuid", "axes", "axes_run", ...}, "solution",
"evaluation": {"status", "log", "environment", "timestamp", "correctness",
"performance", "config"}}`. The run ends with a summary table per definition;
the exit code is 1 when any workload failed or any record was malformed
(`skipped` workloads, e.g. of definitions without a kernel yet, are not
failures but are listed).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import pathlib
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Mapping

from absl import app
from absl import flags
from absl import logging
import jax
import jaxlib
from ml_collections import config_dict
from ml_collections import config_flags
import numpy as np

from jaxkern import compare as compare_lib
from jaxkern import dataset
from jaxkern import registry
from jaxkern.replay_config import default_config
from pallas_kernels.common import has_gpu

STATUSES = ("passed", "incorrect_numerical", "incorrect_shape", "incorrect_dtype", "runtime_error",
            "compile_error", "timeout", "skipped")
FAILURES = frozenset(STATUSES) - {"passed", "skipped"}


_CONFIG = config_flags.DEFINE_config_file("config", None, "Replay config file (configs/replay.py).")


def _csv(s: str) -> list[str]:
  return [x.strip() for x in str(s or "").split(",") if x.strip()]


def derive_seed(uuid: str, seed: int) -> int:
  """A 31-bit seed from a record's uuid and the run's seed."""
  return int.from_bytes(hashlib.sha256(f"{uuid}:{seed}".encode()).digest()[:4], "little") & 0x7FFFFFFF


# --------------------------------------------------------------------------
# Selection.


def select_workloads(cfg: config_dict.ConfigDict, on_error: dataset.ErrorSink,
                     skip_uuids: Iterable[str] = ()) -> tuple[list[dataset.Workload], dict[str, dataset.Definition]]:
  """The workloads a config asks for, in dataset order. Malformed records and
  files of unknown definitions go to `on_error`; the rest still load."""
  ddir = pathlib.Path(cfg.dataset_dir)
  defs = dataset.load_definitions(ddir)
  wanted = _csv(cfg.definitions)
  for w in wanted:
    if not any(n.startswith(w) for n in defs):
      raise ValueError(f"--config.definitions: no definition matches {w!r}; "
                       f"close matches: {dataset.close_matches(w, defs)}")
  keep_def = lambda n: not wanted or any(n.startswith(w) for w in wanted)  # noqa: E731
  variants = set(_csv(cfg.variants))
  uuids = set(_csv(cfg.uuids))
  skip = set(skip_uuids)
  seen: set[str] = set()
  selected = []
  for path in sorted((ddir / "workloads").glob("*.jsonl")):
    if not keep_def(path.stem):
      continue
    if path.stem not in defs:
      on_error(dataset.DatasetError("workload file of an unknown definition", file=path,
                                    expected=f"definitions/{path.stem}.json", got=path.name))
      continue
    per_variant: dict[str, int] = {}
    n_def = 0
    for w in dataset.iter_jsonl(path, defs, on_error=on_error, seen_uuids=seen, expect_definition=path.stem):
      variant = str(w.variant).lower() if w.variant is not None else "none"
      if variants and variant not in variants and str(w.variant) not in variants:
        continue
      if uuids and w.uuid not in uuids:
        continue
      if cfg.max_workloads_per_definition and n_def >= cfg.max_workloads_per_definition:
        continue
      if cfg.max_workloads_per_variant and per_variant.get(variant, 0) >= cfg.max_workloads_per_variant:
        continue
      per_variant[variant] = per_variant.get(variant, 0) + 1
      n_def += 1
      if w.uuid not in skip:
        selected.append(w)
  return selected, defs


def read_done_uuids(path: pathlib.Path) -> set[str]:
  """uuids already written to a results file; a torn last line is ignored."""
  done = set()
  if path.exists():
    for line in path.read_text(encoding="utf-8").splitlines():
      try:
        done.add(json.loads(line)["workload"]["uuid"])
      except (json.JSONDecodeError, KeyError, TypeError):
        continue
  return done


# --------------------------------------------------------------------------
# Inputs.


def run_axes(op: registry.Op, w: dataset.Workload, scale: str, on_gpu: bool) -> dict[str, int]:
  full = op.full_axes(w.axes)
  if scale == "full" or (scale == "auto" and on_gpu):
    return full
  if scale in ("auto", "smoke"):
    return op.cpu_axes(full)
  raise ValueError(f"--config.scale must be auto, full or smoke, got {scale!r}")


def _blob(blob_root: str, ref: Any, what: str) -> dict | None:
  """The tensors a record's `{type: safetensors, path, tensor_key}` names, or None if absent."""
  if not blob_root or not isinstance(ref, dict) or ref.get("type") != "safetensors":
    return None
  path = pathlib.Path(blob_root) / ref["path"]
  if not path.exists():
    return None
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  tensors = load_file(str(path))
  key = ref.get("tensor_key", "tensor")
  if key not in tensors:
    raise dataset.DatasetError("tensor key missing from blob", file=path, field=what,
                               expected=key, got=sorted(tensors))
  return tensors[key]


def load_recorded(op: registry.Op, w: dataset.Workload, blob_root: str):
  """(inputs, expected outputs) from the blob root, each None when not present.

  Inputs must be complete and match the definition's shapes and dtypes at the
  recorded axes; a FIB `scalar` input carries its value inline."""
  if not blob_root:
    return None, None
  axes = op.full_axes(w.axes)
  inputs = None
  recorded = w.record.get("inputs")
  if isinstance(recorded, dict):
    loaded = {}
    for name, ref in recorded.items():
      if isinstance(ref, dict) and ref.get("type") == "scalar":
        loaded[name] = np.asarray(ref["value"], np.float32)
      else:
        loaded[name] = _blob(blob_root, ref, f"inputs.{name}")
    if all(v is not None for v in loaded.values()) and loaded:
      for name, spec in op.definition.inputs.items():
        if name in loaded and spec.dtype == "int32" and loaded[name].dtype == np.int64:
          loaded[name] = _checked_int32(loaded[name], w, name)
      registry.check_tensors(op.definition, loaded, axes, kind="inputs", source=f"{w.file}:{w.line}")
      inputs = {k: jax.numpy.asarray(v) for k, v in loaded.items()}
  expected = None
  exp = w.record.get("expected_output")
  outs = list(op.definition.outputs)
  if isinstance(exp, dict):
    refs = {outs[0]: exp} if "path" in exp else exp
    got = {name: _blob(blob_root, refs.get(name), f"expected_output.{name}") for name in outs}
    if all(v is not None for v in got.values()):
      registry.check_tensors(op.definition, got, axes, kind="outputs", source=f"{w.file}:{w.line}")
      expected = {k: jax.numpy.asarray(v) for k, v in got.items()}
  return inputs, expected


def _checked_int32(x: np.ndarray, w: dataset.Workload, name: str) -> np.ndarray:
  """FIB stores some index tensors as int64: accept them when they fit."""
  if x.size and (x.min() < np.iinfo(np.int32).min or x.max() > np.iinfo(np.int32).max):
    raise dataset.DatasetError("int64 tensor out of int32 range", file=w.file, line=w.line,
                               field=f"inputs.{name}", expected="values within int32", got=(x.min(), x.max()))
  return x.astype(np.int32)


# --------------------------------------------------------------------------
# Execution.


def median_time_ms(fn: Callable[[], Any], warmup: int, iters: int, deadline: float) -> float:
  """Median wall time of `fn()` (blocked until ready) over `iters` runs after
  `warmup` runs; stops early at `deadline` with at least one timed run."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
    if time.monotonic() > deadline:
      break
  times = []
  for _ in range(max(iters, 1)):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append((time.perf_counter() - t0) * 1e3)
    if time.monotonic() > deadline:
      break
  return statistics.median(times)


class CompileCache:
  """Compiled kernel and reference executables, reused across workloads of one
  definition with equal shapes and config."""

  def __init__(self):
    self._jitted: dict[Any, Any] = {}
    self._compiled: dict[Any, Any] = {}

  def get(self, key: Any, make: Callable[[], Callable[..., Any]], inputs: Mapping[str, jax.Array]):
    sig = tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(inputs.items()))
    if (key, sig) not in self._compiled:
      if key not in self._jitted:
        self._jitted[key] = jax.jit(make())
      self._compiled[(key, sig)] = self._jitted[key].lower(dict(inputs)).compile()
    return self._compiled[(key, sig)]


class _Failed(Exception):
  def __init__(self, status: str, log: str):
    super().__init__(log)
    self.status = status


def _short_error(e: BaseException) -> str:
  text = "".join(traceback.format_exception_only(type(e), e)).strip()
  return text[:4000]


def environment(interpret: bool) -> dict[str, Any]:
  dev = jax.devices()[0]
  return {"hardware": getattr(dev, "device_kind", str(dev)), "backend": jax.default_backend(),
          "libs": {"jax": jax.__version__, "jaxlib": jaxlib.__version__},
          "interpret": interpret}


def new_result(w: dataset.Workload, cfg: config_dict.ConfigDict, interpret: bool) -> dict[str, Any]:
  """A result line with nothing evaluated yet (status None)."""
  return {
      "definition": w.definition,
      "workload": {"uuid": w.uuid, "variant": w.variant, "axes": dict(w.axes), "axes_run": None, "scaled": False,
                   "seed": derive_seed(w.uuid, cfg.seed), "source": f"{w.file}:{w.line}"},
      "solution": f"jaxkern.pallas:{w.definition}",
      "evaluation": {"status": None, "log": "", "environment": environment(interpret),
                     "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "correctness": None, "performance": None, "config": None, "expected_output": None},
  }


def run_workload(op: registry.Op, w: dataset.Workload, cfg: config_dict.ConfigDict, cache: CompileCache,
                 interpret: bool, on_gpu: bool) -> dict[str, Any]:
  """One workload, isolated: every failure becomes its status."""
  result = new_result(w, cfg, interpret)
  ev = result["evaluation"]
  if not op.implemented:
    ev["status"], ev["log"] = "skipped", f"no kernel yet: {op.missing}"
    return result
  deadline = time.monotonic() + float(cfg.timeout_s)
  try:
    try:
      recorded_inputs, expected = load_recorded(op, w, cfg.blob_root)
      axes = op.full_axes(w.axes) if recorded_inputs is not None else run_axes(op, w, cfg.scale, on_gpu)
      result["workload"]["axes_run"] = {k: v for k, v in axes.items() if k in w.axes or axes[k] !=
                                        op.definition.axes[k].value}
      result["workload"]["scaled"] = axes != op.full_axes(w.axes)
      if result["workload"]["scaled"]:
        expected = None  # recorded outputs only compare at recorded sizes
      inputs = recorded_inputs if recorded_inputs is not None else op.make_inputs(
          axes, seed=result["workload"]["seed"], record=w.record, scaled=True)
      inputs = jax.block_until_ready(inputs)
    except Exception as e:  # pylint: disable=broad-except
      raise _Failed("runtime_error", "input synthesis: " + _short_error(e)) from e
    config = op.choose_config(inputs)
    ev["config"] = _config_json(config)
    try:
      kernel = cache.get((op.name, "kernel", interpret, config),
                         lambda: lambda x: op.kernel(x, interpret=interpret, config=config), inputs)
    except Exception as e:  # pylint: disable=broad-except
      raise _Failed("compile_error", _short_error(e)) from e
    try:
      reference = cache.get((op.name, "reference"), lambda: op.reference, inputs)
      ref = jax.block_until_ready(reference(inputs))
    except Exception as e:  # pylint: disable=broad-except
      raise _Failed("runtime_error", "reference: " + _short_error(e)) from e
    try:
      out = jax.block_until_ready(kernel(inputs))
    except Exception as e:  # pylint: disable=broad-except
      raise _Failed("runtime_error", _short_error(e)) from e
    cmp = op.compare(out, ref, inputs=inputs)
    ev["status"] = cmp.status
    ev["correctness"] = _correctness(cmp)
    if cmp.status != "passed":
      ev["log"] = "; ".join(f"{n}: {o.message}" for n, o in cmp.outputs.items() if o.message)
    if expected is not None:
      exp_cmp = op.compare(out, expected, inputs=inputs)
      ev["expected_output"] = {"status": exp_cmp.status, **_correctness(exp_cmp)}
    if time.monotonic() > deadline:
      raise _Failed("timeout", f"exceeded {cfg.timeout_s}s before timing")
    kernel_ms = median_time_ms(lambda: kernel(inputs), cfg.warmup, cfg.iters, deadline)
    ref_ms = median_time_ms(lambda: reference(inputs), cfg.warmup, cfg.iters, deadline)
    ev["performance"] = {"latency_ms": kernel_ms, "reference_latency_ms": ref_ms,
                         "speedup_factor": ref_ms / kernel_ms if kernel_ms > 0 else None,
                         "warmup": cfg.warmup, "iters": cfg.iters}
  except _Failed as f:
    ev["status"], ev["log"] = f.status, str(f)
  except Exception as e:  # pylint: disable=broad-except
    ev["status"], ev["log"] = "runtime_error", _short_error(e)
  return result


def _config_json(config: Any) -> Any:
  if dataclasses.is_dataclass(config):
    return {"name": type(config).__name__, **dataclasses.asdict(config)}
  return None if config is None else repr(config)


def _correctness(cmp: compare_lib.Comparison) -> dict[str, Any]:
  outs = cmp.outputs.values()
  finite = lambda v: v if math.isfinite(v) else compare_lib._json_float(v)  # pylint: disable=protected-access  # noqa: E731
  return {"max_absolute_error": finite(max((o.max_abs_error for o in outs), default=0.0)),
          "max_relative_error": finite(max((o.max_rel_error for o in outs), default=0.0)),
          "matched_ratio": min((o.matched_ratio for o in outs), default=1.0),
          "tie_accepted_rows": cmp.tie_accepted_rows,
          "outputs": cmp.to_json()}


# Worker threads of `run_isolated`; one left running (a timeout or Ctrl-C
# mid-call) means the process must exit without finalizing the runtime.
_WORKERS: list[threading.Thread] = []


def run_isolated(fn: Callable[[], dict], timeout_s: float, timed_out: Callable[[], dict]) -> dict:
  """Runs `fn` in a worker thread; past `timeout_s` (+ grace) returns
  `timed_out()` and leaves the stuck call behind (XLA calls cannot be
  interrupted; the thread is a daemon)."""
  box: dict[str, Any] = {}

  def target():
    try:
      box["result"] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      box["error"] = e

  t = threading.Thread(target=target, daemon=True)
  _WORKERS[:] = [w for w in _WORKERS if w.is_alive()] + [t]
  t.start()
  t.join(timeout_s * 1.1 + 5)
  if t.is_alive():
    return timed_out()
  if "error" in box:
    raise box["error"]
  return box["result"]


# --------------------------------------------------------------------------
# Summary.


def summarize(results: list[dict]) -> tuple[list[str], list[list[Any]]]:
  by_def: dict[str, list[dict]] = {}
  for r in results:
    by_def.setdefault(r["definition"], []).append(r)
  headers = ["definition", "n", "passed", "failed", "skipped", "kernel ms", "ref ms", "speedup", "worst status"]
  rows = []
  for name, rs in sorted(by_def.items()):
    st = [r["evaluation"]["status"] for r in rs]
    perf = [r["evaluation"]["performance"] for r in rs if r["evaluation"]["performance"]]
    med = lambda k: f"{statistics.median(p[k] for p in perf):.3g}" if perf else "-"  # noqa: E731
    worst = next((s for s in STATUSES if s in st and s != "passed"), "passed")
    rows.append([name, len(rs), st.count("passed"), sum(s in FAILURES for s in st), st.count("skipped"),
                 med("latency_ms"), med("reference_latency_ms"), med("speedup_factor"), worst])
  return headers, rows


def replay(cfg: config_dict.ConfigDict, *, log: Callable[[str], None] = print) -> int:
  """Runs a replay; returns the process exit code."""
  import tabulate  # pylint: disable=g-import-not-at-top
  import tqdm  # pylint: disable=g-import-not-at-top

  if cfg.scale not in ("auto", "full", "smoke"):
    log(f"error: --config.scale must be auto, full or smoke, got {cfg.scale!r}")
    return 2
  errors: list[dataset.DatasetError] = []

  def report(e: dataset.DatasetError) -> None:
    errors.append(e)
    log(f"skipped record: {e}")

  out_path = pathlib.Path(cfg.output)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  done = read_done_uuids(out_path) if cfg.resume else set()
  try:
    workloads, _ = select_workloads(cfg, report, skip_uuids=done)
  except (ValueError, dataset.DatasetError) as e:
    log(f"error: {e}")
    return 2
  on_gpu = has_gpu()
  interpret = (not on_gpu) if cfg.interpret is None else bool(cfg.interpret)
  if done:
    log(f"resume: {len(done)} workloads already in {out_path}, {len(workloads)} to go")
  log(f"replaying {len(workloads)} workloads on {jax.default_backend()} "
      f"(scale={cfg.scale}, interpret={interpret}) -> {out_path}")
  cache = CompileCache()
  results: list[dict] = []
  mode = "a" if cfg.resume else "w"
  interrupted = False
  with open(out_path, mode, encoding="utf-8") as f, \
      tqdm.tqdm(total=len(workloads), disable=not cfg.progress, unit="wl", dynamic_ncols=True) as bar:
    if cfg.resume and out_path.stat().st_size and not _ends_with_newline(out_path):
      f.write("\n")  # a torn last line from an interrupted run stays on its own line
    try:
      for w in workloads:
        op = registry.get(w.definition, cfg.dataset_dir)
        bar.set_description(w.definition[:40])

        def timed_out(w=w):
          r = new_result(w, cfg, interpret)
          r["evaluation"].update(status="timeout", log=f"no result within {cfg.timeout_s}s")
          return r

        r = run_isolated(lambda w=w, op=op: run_workload(op, w, cfg, cache, interpret, on_gpu),
                         cfg.timeout_s, timed_out)
        f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
        results.append(r)
        bar.update(1)
        bar.set_postfix(passed=sum(x["evaluation"]["status"] == "passed" for x in results),
                        failed=sum(x["evaluation"]["status"] in FAILURES for x in results))
    except KeyboardInterrupt:
      interrupted = True
  headers, rows = summarize(results)
  log(tabulate.tabulate(rows, headers=headers))
  failed = [r for r in results if r["evaluation"]["status"] in FAILURES]
  for r in failed[:20]:
    log(f"FAILED {r['definition']} {r['workload']['uuid']}: {r['evaluation']['status']}: "
        f"{r['evaluation']['log'][:300]}")
  log(f"{sum(r['evaluation']['status'] == 'passed' for r in results)} passed, {len(failed)} failed, "
      f"{sum(r['evaluation']['status'] == 'skipped' for r in results)} skipped, {len(errors)} bad records; "
      f"results in {out_path}")
  if interrupted:
    log("interrupted: results so far are on disk; rerun with --config.resume=True to continue")
    return 130
  return 1 if failed or errors else 0


def _ends_with_newline(path: pathlib.Path) -> bool:
  with open(path, "rb") as f:
    f.seek(-1, os.SEEK_END)
    return f.read(1) == b"\n"


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # jax's backend probing is noise here
  cfg = _CONFIG.value if _CONFIG.value is not None else default_config()
  code = replay(cfg)
  if code == 130 or any(t.is_alive() for t in _WORKERS):
    # After Ctrl-C or a timeout, XLA's runtime can abort during interpreter
    # shutdown (an abandoned or interrupted call); results are already on
    # disk, so leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)


if __name__ == "__main__":
  app.run(main)
