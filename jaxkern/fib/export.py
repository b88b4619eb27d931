"""Export: a dataset of ours, and optionally replay results, as a
FlashInfer-Bench 0.1.2 TraceSet folder.

  definitions/<op_type>/<name>.json     `definitions.to_fib`
  workloads/<op_type>/<name>.jsonl      one workload trace per record:
      {definition, workload: {axes, inputs, uuid, jaxkern_record}, solution: null, evaluation: null}
  traces/<op_type>/<name>.jsonl         one trace per exportable result (below)
  solutions/jaxkern/<op_type>/<name>/<solution>.json
                                        one per backend and kernel config that a trace names

Workload `inputs` name every definition input: a record's own recorded
`inputs` entries (`safetensors` paths stay relative to the blob root, which
is where FIB reads them: the TraceSet root), every other input `random`
(the seed's records record no inputs: our replay synthesizes them, FIB draws
random data). `jaxkern_record` keeps the record's other fields verbatim, so
an import restores it exactly; FIB ignores the field.

Which results become traces. FIB's rules: PASSED carries correctness and
performance, INCORRECT_NUMERICAL correctness only, other failures neither,
and a trace's latency is read as measured at `workload.axes`. So:
- scaled results (run at `axes_run`, not the recorded axes) are not
  exported: FIB would read them as the recorded workload's;
- PASSED results not timed on a GPU (interpret mode, a CPU) are not
  exported: FIB's PASSED needs a performance, and an interpret-mode time is
  not one;
- `skipped` results are not exported: no kernel ran (FIB has no such status);
- everything else is, with the status upper-cased, correctness's max errors
  (our per-output detail in `correctness.extra`), performance (latency_ms,
  reference_latency_ms, speedup_factor) for PASSED, `environment.hardware`
  the device kind ("NVIDIA_H200"), and the whole result line of ours in
  `jaxkern`, which FIB ignores.
`ExportSummary.skipped` counts the others by reason.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

from jaxkern import dataset
from jaxkern import results as results_lib
from jaxkern.compare import Status
from jaxkern.fib import definitions as fib_definitions
from jaxkern.fib import formats

RECORD_FIELD = "jaxkern_record"
RESULT_FIELD = "jaxkern"
GPU_TIMERS = ("device (profiler)", "wall")


@dataclasses.dataclass
class ExportSummary:
  definitions: int = 0
  workloads: int = 0
  traces: int = 0
  solutions: int = 0
  skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # reason -> results

  def lines(self) -> list[str]:
    out = [
      f"{self.definitions} definitions, {self.workloads} workloads, {self.traces} traces, {self.solutions} solutions"
    ]
    out += [f"not exported: {n} result(s): {reason}" for reason, n in sorted(self.skipped.items())]
    return out


# -- workloads ------------------------------------------------------------


def workload_inputs(d: dataset.Definition, record: Mapping[str, Any]) -> dict[str, Any]:
  """FIB `inputs` of a record: its recorded entries, `random` for the rest."""
  recorded = record.get("inputs")
  if not isinstance(recorded, dict):
    recorded = {}
  return {name: recorded.get(name, {"type": "random"}) for name in d.inputs}


def workload_trace(d: dataset.Definition, w: dataset.Workload) -> dict[str, Any]:
  rest = {k: v for k, v in w.record.items() if k not in dataset.CORE_FIELDS}
  return {
    "definition": d.name,
    "workload": {
      "axes": dict(w.record["axes"]),
      "inputs": workload_inputs(d, w.record),
      "uuid": w.uuid,
      RECORD_FIELD: rest,
    },
    "solution": None,
    "evaluation": None,
  }


# -- traces ---------------------------------------------------------------


def _error(v: Any) -> float:
  """An error as FIB reads it: a non-negative float or NaN (unmeasured)."""
  return float("nan") if v is None else float(v)


def _skip_reason(t: results_lib.Trace, defs: Mapping[str, dataset.Definition]) -> str | None:
  ev = t.evaluation
  if t.definition not in defs:
    return "definition not in the dataset"
  if ev.status is None or ev.status is Status.SKIPPED:
    return "skipped (no kernel ran)"
  if t.workload.scaled:
    return "scaled (run at axes_run, not the recorded axes)"
  if ev.status is Status.PASSED:
    perf = ev.performance or {}
    on_gpu = ev.environment.get("backend") not in (None, "cpu") and not ev.environment.get("interpret")
    if not on_gpu or perf.get("timer") not in GPU_TIMERS:
      return "passed without a GPU timing (FIB's PASSED needs a performance)"
    if any(perf.get(k) is None for k in ("latency_ms", "reference_latency_ms", "speedup_factor")):
      return "passed without kernel and reference times"
  return None


def result_trace(
  t: results_lib.Trace, raw: Mapping[str, Any], d: dataset.Definition, record: Mapping[str, Any] | None
) -> tuple[dict[str, Any], str, dict[str, Any] | None]:
  """(FIB trace, backend, config) of one exportable result (a result from
  before the backend was recorded ran on Triton); `raw` is its JSON line,
  kept whole in the trace."""
  ev = t.evaluation
  status = formats.FIB_STATUSES[Status(ev.status)]
  evaluation: dict[str, Any] = {
    "status": status,
    "environment": {
      "hardware": formats.hardware_name(str(ev.environment.get("hardware") or "unknown")),
      "libs": {k: str(v) for k, v in (ev.environment.get("libs") or {}).items()},
    },
    "timestamp": ev.timestamp,
    "log": ev.log or "",
    "correctness": None,
    "performance": None,
  }
  if status in ("PASSED", "INCORRECT_NUMERICAL"):
    c = dict(ev.correctness or {})
    evaluation["correctness"] = {
      "max_relative_error": _error(c.pop("max_relative_error", None)),
      "max_absolute_error": _error(c.pop("max_absolute_error", None)),
      "extra": c,
    }
  if status == "PASSED":
    p = ev.performance
    assert p is not None  # _skip_reason exports a PASSED result only with its times
    evaluation["performance"] = {k: float(p[k]) for k in ("latency_ms", "reference_latency_ms", "speedup_factor")}
  backend = ev.backend or formats.DEFAULT_BACKEND
  config = ev.config
  workload = {"axes": dict(t.workload.axes), "inputs": workload_inputs(d, record or {}), "uuid": t.workload.uuid}
  trace = {
    "definition": t.definition,
    "workload": workload,
    "solution": formats.solution_name(t.definition, backend, config),
    "evaluation": evaluation,
    RESULT_FIELD: dict(raw),
  }
  return trace, backend, config


def solution(d: dataset.Definition, backend: str, config: Mapping[str, Any] | None) -> dict[str, Any]:
  """The FIB Solution a trace names: Python source whose `run` calls our
  kernel with that config through `jaxkern.fib.bridge`."""
  params = ", ".join(d.inputs)
  source = (
    f'"""jaxkern\'s {backend} Pallas kernel of {d.name}, config {json.dumps(config, sort_keys=True)}."""\n'
    "import json\n\nfrom jaxkern.fib import bridge\n\n"
    f"BACKEND = {backend!r}\n"
    f"CONFIG = json.loads({json.dumps(json.dumps(config, sort_keys=True))})\n\n\n"
    f"def run({params}):\n"
    f"  return bridge.run_kernel_torch({d.name!r}, CONFIG, {params}, backend=BACKEND)\n"
  )
  return {
    "name": formats.solution_name(d.name, backend, config),
    "definition": d.name,
    "author": formats.AUTHOR,
    "spec": {
      "language": "python",
      "target_hardware": ["cuda"],
      "entry_point": "main.py::run",
      "dependencies": ["jax", "jaxkern"],
      "destination_passing_style": False,
    },
    "sources": [{"path": "main.py", "content": source}],
    "description": f"jaxkern {backend} (Pallas) kernel of {d.name} with config "
    f"{json.dumps(config, sort_keys=True)}; needs jax and jaxkern",
  }


def _read_result_lines(path: str | os.PathLike) -> Iterable[tuple[results_lib.Trace, dict[str, Any]]]:
  """(typed result, its JSON object) per result line; bad lines are warned
  about on stderr (`results.read_traces`) and skipped."""
  typed = results_lib.read_traces(path)
  raws = []
  for line in pathlib.Path(path).read_text(encoding="utf-8").splitlines():
    try:
      raws.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  by_uuid = {(r.get("definition"), (r.get("workload") or {}).get("uuid")): r for r in raws if isinstance(r, dict)}
  for t in typed:
    yield t, by_uuid.get((t.definition, t.workload.uuid), {})


# -- the folder -----------------------------------------------------------


def _write_json(path: pathlib.Path, obj: Any) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _write_jsonl(path: pathlib.Path, objs: list[Any]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")


def export(
  out_dir: str | os.PathLike,
  *,
  dataset_dir: str | os.PathLike | None = None,
  results: Iterable[str | os.PathLike] = (),
  names: Iterable[str] | None = None,
) -> ExportSummary:
  """Writes the TraceSet folder `out_dir` (which must be absent or empty)
  from the dataset (default: the shipped one; `names`: only those
  definitions) and the result files `results`."""
  out = pathlib.Path(out_dir)
  if out.exists() and any(out.iterdir()):
    raise FileExistsError(f"{out} is not empty; export into a new folder")
  defs = dataset.load_definitions(dataset_dir)
  if names is not None:
    wanted = list(names)
    unknown = [n for n in wanted if n not in defs]
    if unknown:
      raise KeyError(f"unknown definitions {unknown}; the dataset has {sorted(defs)}")
    defs = {n: defs[n] for n in sorted(wanted)}
  summary = ExportSummary()
  records: dict[tuple[str, str], Mapping[str, Any]] = {}
  seen: set[str] = set()
  for name, d in defs.items():
    _write_json(formats.definition_path(out, d.op_type, name), fib_definitions.to_fib(d))
    wpath = dataset.workloads_path(name, dataset_dir)
    ws = list(dataset.iter_jsonl(wpath, defs, seen_uuids=seen, expect_definition=name)) if wpath.exists() else []
    _write_jsonl(formats.workloads_path(out, d.op_type, name), [workload_trace(d, w) for w in ws])
    records.update({(name, w.uuid): w.record for w in ws})
    summary.definitions += 1
    summary.workloads += len(ws)

  traces: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
  solutions: dict[str, dict[str, Any]] = {}
  for path in results:
    for t, raw in _read_result_lines(path):
      reason = _skip_reason(t, defs)
      if reason:
        summary.skipped[reason] += 1
        continue
      d = defs[t.definition]
      trace, backend, config = result_trace(t, raw, d, records.get((t.definition, t.workload.uuid)))
      traces[t.definition].append(trace)
      solutions.setdefault(trace["solution"], solution(d, backend, config))
  for name, ts in traces.items():
    _write_jsonl(formats.traces_path(out, defs[name].op_type, name), ts)
    summary.traces += len(ts)
  for sname, s in solutions.items():
    _write_json(formats.solution_path(out, defs[s["definition"]].op_type, s["definition"], sname), s)
  summary.solutions = len(solutions)
  return summary
