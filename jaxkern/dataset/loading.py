"""Loading a dataset: definition files, workload JSONL files, and the
validation of every record against its definition."""

from __future__ import annotations

import difflib
import json
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from jaxkern import _data
from jaxkern.dataset import constraints
from jaxkern.dataset.records import (
  CORE_FIELDS,
  DTYPES,
  AxisSpec,
  DatasetError,
  Definition,
  TensorSpec,
  Workload,
  is_count,
)

ErrorSink = Callable[[DatasetError], None]


def default_dataset_dir() -> pathlib.Path:
  """`JAXKERN_DATASET_DIR`, else the dataset shipped with the package (the
  repository's `datasets/` in a checkout; `jaxkern._data.folder`)."""
  env = os.environ.get("JAXKERN_DATASET_DIR")
  if env:
    return pathlib.Path(env)
  return _data.folder("datasets")


def close_matches(name: str, names: Iterable[str]) -> list[str]:
  return difflib.get_close_matches(name, list(names), n=3, cutoff=0.5)


def raise_error(e: DatasetError) -> None:
  """The default error sink: stop at the first bad record."""
  raise e


# --------------------------------------------------------------------------
# Definitions.


def _tensor_specs(
  raw: Mapping[str, Any], path: pathlib.Path, kind: str, axes: Mapping[str, AxisSpec]
) -> dict[str, TensorSpec]:
  specs = {}
  for name, t in raw.items():
    shape = t.get("shape")
    dtype = t.get("dtype")
    if dtype not in DTYPES:
      raise DatasetError(
        "unknown dtype", file=path, field=f"{kind}.{name}.dtype", expected=f"one of {DTYPES}", got=dtype
      )
    if shape is not None:
      for a in shape:
        if a not in axes:
          raise DatasetError(
            "shape names an undeclared axis",
            file=path,
            field=f"{kind}.{name}.shape",
            expected=f"one of {list(axes)}",
            got=a,
          )
      shape = tuple(shape)
    specs[name] = TensorSpec(name=name, shape=shape, dtype=dtype, description=t.get("description", ""))
  return specs


def parse_definition(raw: Mapping[str, Any], path: pathlib.Path | str = "<definition>") -> Definition:
  path = pathlib.Path(path)
  for key in ("name", "op_type", "axes", "inputs", "outputs", "reference"):
    if key not in raw:
      raise DatasetError("missing field", file=path, field=key, expected="present", got=None)
  axes = {}
  for name, a in raw["axes"].items():
    if a.get("type") not in ("var", "const"):
      raise DatasetError(
        "bad axis type", file=path, field=f"axes.{name}.type", expected="'var' or 'const'", got=a.get("type")
      )
    if a["type"] == "const" and not is_count(a.get("value")):
      raise DatasetError(
        "const axis needs a non-negative integer value",
        file=path,
        field=f"axes.{name}.value",
        expected="int >= 0",
        got=a.get("value"),
      )
    axes[name] = AxisSpec(name=name, type=a["type"], value=a.get("value"), description=a.get("description", ""))
  for expr in raw.get("constraints", []):
    try:
      used = constraints.names(expr)
    except ValueError as e:
      raise DatasetError(
        f"bad constraint: {e}",
        file=path,
        field="constraints",
        expected="an arithmetic comparison over axis names",
        got=expr,
      ) from None
    if used - set(axes):
      raise DatasetError(
        "constraint names unknown axes", file=path, field="constraints", expected=f"names among {list(axes)}", got=expr
      )
  return Definition(
    name=raw["name"],
    op_type=raw["op_type"],
    description=raw.get("description", ""),
    tags=tuple(raw.get("tags", ())),
    axes=axes,
    inputs=_tensor_specs(raw["inputs"], path, "inputs", axes),
    outputs=_tensor_specs(raw["outputs"], path, "outputs", axes),
    constraints=tuple(raw.get("constraints", ())),
    reference=raw["reference"],
    raw=dict(raw),
  )


def load_definitions(dataset_dir: str | os.PathLike | None = None) -> dict[str, Definition]:
  """All definitions of a dataset, by name, sorted."""
  ddir = pathlib.Path(dataset_dir or default_dataset_dir()) / "definitions"
  defs = {}
  for path in sorted(ddir.glob("*.json")):
    try:
      raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
      raise DatasetError(f"invalid JSON: {e.msg}", file=path, line=e.lineno) from None
    d = parse_definition(raw, path)
    if d.name != path.stem:
      raise DatasetError(
        "definition name differs from its file name", file=path, field="name", expected=path.stem, got=d.name
      )
    defs[d.name] = d
  return defs


# --------------------------------------------------------------------------
# Workloads.


def validate_record(
  rec: Any,
  definitions: Mapping[str, Definition],
  *,
  file: str = "<record>",
  line: int | None = None,
  expect_definition: str | None = None,
) -> Workload:
  """Checks one decoded record; returns its Workload or raises DatasetError."""
  err = lambda msg, **kw: DatasetError(msg, file=file, line=line, **kw)  # noqa: E731
  if not isinstance(rec, dict):
    raise err("a record must be a JSON object", expected="object", got=type(rec).__name__)
  for key in CORE_FIELDS:
    if key not in rec:
      raise err("missing field", field=key, expected="present", got=None)
  if not isinstance(rec["uuid"], str) or not rec["uuid"]:
    raise err("bad uuid", field="uuid", expected="a non-empty string", got=rec["uuid"])
  name = rec["definition"]
  if name not in definitions:
    hint = close_matches(str(name), definitions)
    raise err(
      "unknown definition" + (f"; did you mean {', '.join(hint)}?" if hint else ""),
      field="definition",
      expected="a known definition",
      got=name,
    )
  if expect_definition is not None and name != expect_definition:
    raise err("record is in another definition's file", field="definition", expected=expect_definition, got=name)
  d = definitions[name]
  axes = rec["axes"]
  if not isinstance(axes, dict):
    raise err("axes must be an object", field="axes", expected="object", got=axes)
  for a in d.var_axes:
    if a not in axes:
      raise err("missing axis", field=f"axes.{a}", expected="a non-negative integer", got=None)
  for a, v in axes.items():
    if a not in d.axes:
      raise err("axis not in the definition", field=f"axes.{a}", expected=f"one of {list(d.axes)}", got=a)
    if not is_count(v):
      raise err("axis must be a non-negative integer", field=f"axes.{a}", expected="int >= 0", got=v)
    if d.axes[a].is_const and v != d.axes[a].value:
      raise err("const axis disagrees with the definition", field=f"axes.{a}", expected=d.axes[a].value, got=v)
  full = d.full_axes(axes)
  for c in d.check_constraints(full):
    raise err("constraint violated", field="axes", expected=c, got={k: full[k] for k in d.var_axes})
  return Workload(
    uuid=rec["uuid"],
    definition=name,
    axes={a: int(v) for a, v in axes.items()},
    record=rec,
    file=str(file),
    line=line or 0,
  )


def read_records(
  path: str | os.PathLike,
  definitions: Mapping[str, Definition],
  *,
  on_error: ErrorSink,
  seen_uuids: set[str],
  expect_definition: str | None = None,
  to_record: Callable[[Any], Any] = lambda obj: obj,
) -> Iterator[tuple[Workload, str, bool]]:
  """Yields (workload, line text, whether `to_record` changed the object) per
  valid line of a JSONL file; each bad line goes to `on_error` and the rest of
  the file still loads."""
  with open(path, encoding="utf-8") as f:
    for lineno, text in enumerate(f, 1):
      if not text.strip():
        continue
      try:
        try:
          obj = json.loads(text)
        except json.JSONDecodeError as e:
          raise DatasetError(f"invalid JSON: {e.msg} (column {e.colno})", file=path, line=lineno) from None
        rec = to_record(obj)
        w = validate_record(rec, definitions, file=str(path), line=lineno, expect_definition=expect_definition)
        if w.uuid in seen_uuids:
          raise DatasetError(
            "duplicate uuid", file=path, line=lineno, field="uuid", expected="unique in the dataset", got=w.uuid
          )
        seen_uuids.add(w.uuid)
      except DatasetError as e:
        on_error(e)
        continue
      yield w, text.rstrip("\r\n"), rec is not obj


def iter_jsonl(
  path: str | os.PathLike,
  definitions: Mapping[str, Definition],
  *,
  on_error: ErrorSink = raise_error,
  seen_uuids: set[str] | None = None,
  expect_definition: str | None = None,
) -> Iterator[Workload]:
  """Yields the valid workloads of a JSONL file; each bad line goes to
  `on_error` (raise by default) and the rest of the file still loads."""
  seen = set() if seen_uuids is None else seen_uuids
  for w, _, _ in read_records(
    path, definitions, on_error=on_error, seen_uuids=seen, expect_definition=expect_definition
  ):
    yield w


def workloads_path(name: str, dataset_dir: str | os.PathLike | None = None) -> pathlib.Path:
  return pathlib.Path(dataset_dir or default_dataset_dir()) / "workloads" / f"{name}.jsonl"


def load_workloads(
  name: str,
  dataset_dir: str | os.PathLike | None = None,
  *,
  on_error: ErrorSink = raise_error,
  definitions: Mapping[str, Definition] | None = None,
) -> list[Workload]:
  """The typed workload records of one definition, in recorded order."""
  defs = definitions if definitions is not None else load_definitions(dataset_dir)
  if name not in defs:
    raise KeyError(f"unknown definition {name!r}; close matches: {close_matches(name, defs)}")
  path = workloads_path(name, dataset_dir)
  if not path.exists():
    return []
  return list(iter_jsonl(path, defs, on_error=on_error, expect_definition=name))


def validate_dataset(
  dataset_dir: str | os.PathLike | None = None, *, on_error: ErrorSink = raise_error
) -> dict[str, list[Workload]]:
  """Every workload of a dataset by definition; errors go to `on_error`."""
  ddir = pathlib.Path(dataset_dir or default_dataset_dir())
  defs = load_definitions(ddir)
  seen: set[str] = set()
  result = {}
  for path in sorted((ddir / "workloads").glob("*.jsonl")):
    if path.stem not in defs:
      on_error(
        DatasetError(
          "workload file of an unknown definition",
          file=path,
          expected=f"a definition file definitions/{path.stem}.json",
          got=path.name,
        )
      )
      continue
    result[path.stem] = list(iter_jsonl(path, defs, on_error=on_error, seen_uuids=seen, expect_definition=path.stem))
  return result
