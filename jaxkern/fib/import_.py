"""Import: a FlashInfer-Bench TraceSet folder as a dataset of ours.

Every `definitions/**/*.json` is matched to our definitions by its math
(`definitions.match`); a matched one is written as `definitions/<name>.json`
in our form (its name, our family's reference), one that no family
implements is reported with how it differs from our closest definition.
Every workload trace of a matched definition (`workloads/**/*.jsonl`)
becomes a record in `workloads/<name>.jsonl`:
- one we exported (it carries `jaxkern_record`) comes back as it was
  recorded;
- any other is `{uuid, definition, axes, inputs}` with FIB's `inputs` as
  they are: `scalar` values are used by the replay, `safetensors` paths are
  read from `--config.blob_root` (give the TraceSet folder: FIB's paths are
  relative to it) when every tensor input is recorded, `random` inputs are
  synthesized by the family (structurally valid data, docs/replay.md).
Records are validated against the written definitions; a bad one is
reported and left out. `traces/` (FIB's results) is not imported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

from jaxkern import dataset
from jaxkern.fib import definitions as fib_definitions
from jaxkern.fib import export as fib_export


@dataclasses.dataclass
class ImportSummary:
  matched: list[fib_definitions.Match] = dataclasses.field(default_factory=list)
  unmatched: list[fib_definitions.Match] = dataclasses.field(default_factory=list)
  workloads: dict[str, int] = dataclasses.field(default_factory=dict)  # definition -> records written
  problems: list[str] = dataclasses.field(default_factory=list)  # records or constraints left out, and why

  def lines(self) -> list[str]:
    out = [m.message for m in self.matched] + [m.message for m in self.unmatched] + self.problems
    out.append(
      f"{len(self.matched)} definitions imported, {len(self.unmatched)} not implemented; "
      f"{sum(self.workloads.values())} workloads written, {len(self.problems)} problems"
    )
    return out


def _load_json(path: pathlib.Path) -> Any:
  try:
    return json.loads(path.read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise dataset.DatasetError(f"invalid JSON: {e.msg}", file=path, line=e.lineno) from None


def record_of(trace: dict[str, Any]) -> dict[str, Any]:
  """Our record of one FIB workload trace (see the module docstring)."""
  w = dict(trace.get("workload") or {})
  core = {"uuid": w.get("uuid"), "definition": trace.get("definition"), "axes": w.get("axes")}
  if isinstance(w.get(fib_export.RECORD_FIELD), dict):
    return {**core, **w[fib_export.RECORD_FIELD]}
  return {**core, "inputs": w.get("inputs") or {}}


def import_trace_set(
  fib_dir: str | os.PathLike, out_dir: str | os.PathLike, *, ours: dict[str, dataset.Definition] | None = None
) -> ImportSummary:
  """Writes the dataset `out_dir` (which must be absent or empty) from the
  TraceSet folder `fib_dir`, matching against `ours` (default: the shipped
  dataset's definitions)."""
  root, out = pathlib.Path(fib_dir), pathlib.Path(out_dir)
  if not (root / "definitions").is_dir():
    raise FileNotFoundError(f"{root} has no definitions/ folder: not a FlashInfer-Bench TraceSet")
  if out.exists() and any(out.iterdir()):
    raise FileExistsError(f"{out} is not empty; import into a new folder")
  ours = ours if ours is not None else dataset.load_definitions()
  summary = ImportSummary()
  written: dict[str, dataset.Definition] = {}
  for path in sorted((root / "definitions").rglob("*.json")):
    fib = _load_json(path)
    m = fib_definitions.match(fib, ours)
    if m.ours is None:
      summary.unmatched.append(m)
      continue
    raw, unread = fib_definitions.to_ours(fib, m)
    summary.problems += [f"{m.name}: constraint {c!r} is not in our constraint language; left out" for c in unread]
    target = out / "definitions" / f"{raw['name']}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    written[raw["name"]] = dataset.parse_definition(raw, target)
    summary.matched.append(m)

  lines: dict[str, list[str]] = {}
  seen: set[str] = set()
  for path in sorted((root / "workloads").rglob("*.jsonl")) if (root / "workloads").is_dir() else []:
    for lineno, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
      if not text.strip():
        continue
      try:
        trace = json.loads(text)
      except json.JSONDecodeError as e:
        summary.problems.append(f"{path}:{lineno}: invalid JSON: {e.msg}")
        continue
      if not isinstance(trace, dict) or trace.get("definition") not in written:
        continue  # a definition not imported: reported above
      rec = record_of(trace)
      try:
        w = dataset.validate_record(rec, written, file=str(path), line=lineno, expect_definition=rec["definition"])
      except dataset.DatasetError as e:
        summary.problems.append(str(e))
        continue
      if w.uuid in seen:
        summary.problems.append(f"{path}:{lineno}: duplicate uuid {w.uuid}; left out")
        continue
      seen.add(w.uuid)
      lines.setdefault(w.definition, []).append(json.dumps(rec, sort_keys=True))
  for name in written:
    rows = lines.get(name, [])
    target = out / "workloads" / f"{name}.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    summary.workloads[name] = len(rows)
  return summary
