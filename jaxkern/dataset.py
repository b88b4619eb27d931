"""Typed definitions and workload records, their validation, and the importer.

Layout of a dataset directory (default: the repository's `datasets/`):
  definitions/<name>.json   one FlashInfer-Bench-compatible definition each
  workloads/<name>.jsonl    the recorded workloads of that definition, one JSON
                            object per line, every recorded field preserved

Command line (`python -m jaxkern.dataset ...`):
  convert --input FILE --output DIR   import seed records or FIB trace JSONL
  validate [--dataset DIR]            check every record; one line per error
  stats [--dataset DIR]               counts per definition, variant, axis range
"""

from __future__ import annotations

import ast
import collections
import difflib
import json
import operator
import os
import pathlib
import sys
from typing import Any, Callable, Iterable, Iterator, Mapping

import chex
import ml_dtypes
import numpy as np

NP_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "uint8": np.dtype(np.uint8),
    "int32": np.dtype(np.int32), "bool": np.dtype(np.bool_),
}
DTYPES = tuple(NP_DTYPES)
# Fields every workload record must carry; everything else is provenance.
CORE_FIELDS = ("uuid", "definition", "axes")


def default_dataset_dir() -> pathlib.Path:
  env = os.environ.get("JAXKERN_DATASET_DIR")
  if env:
    return pathlib.Path(env)
  return pathlib.Path(__file__).resolve().parent.parent / "datasets"


class DatasetError(ValueError):
  """A record or definition that does not satisfy the contract.

  The message names the file, line, field and what was expected."""

  def __init__(self, message: str, *, file: str | os.PathLike | None = None,
               line: int | None = None, field: str | None = None,
               expected: Any = None, got: Any = None):
    self.file = None if file is None else str(file)
    self.line, self.field, self.expected, self.got = line, field, expected, got
    self.detail = message
    where = self.file or "<record>"
    if line is not None:
      where += f":{line}"
    parts = [where + ":"]
    if field:
      parts.append(f"field '{field}':")
    parts.append(message)
    if expected is not None:
      parts.append(f"(expected {expected}, got {got!r})")
    super().__init__(" ".join(parts))


# --------------------------------------------------------------------------
# Typed definitions.


@chex.dataclass(frozen=True, mappable_dataclass=False)
class AxisSpec:
  name: str
  type: str  # "var" or "const"
  value: int | None = None
  description: str = ""

  @property
  def is_const(self) -> bool:
    return self.type == "const"


@chex.dataclass(frozen=True, mappable_dataclass=False)
class TensorSpec:
  name: str
  shape: tuple[str, ...] | None  # None: a Python scalar
  dtype: str
  description: str = ""

  @property
  def np_dtype(self) -> np.dtype:
    return NP_DTYPES[self.dtype]

  def concrete_shape(self, axes: Mapping[str, int]) -> tuple[int, ...]:
    return () if self.shape is None else tuple(int(axes[a]) for a in self.shape)


@chex.dataclass(frozen=True, mappable_dataclass=False)
class Definition:
  name: str
  op_type: str
  description: str
  tags: tuple[str, ...]
  axes: dict[str, AxisSpec]
  inputs: dict[str, TensorSpec]
  outputs: dict[str, TensorSpec]
  constraints: tuple[str, ...]
  reference: str
  raw: dict

  @property
  def const_axes(self) -> dict[str, int]:
    return {n: a.value for n, a in self.axes.items() if a.is_const}

  @property
  def var_axes(self) -> tuple[str, ...]:
    return tuple(n for n, a in self.axes.items() if not a.is_const)

  def full_axes(self, axes: Mapping[str, int]) -> dict[str, int]:
    """`axes` completed with the constant axes, in definition order."""
    merged = {**self.const_axes, **axes}
    return {n: int(merged[n]) for n in self.axes if n in merged}

  def check_constraints(self, axes: Mapping[str, int]) -> list[str]:
    """The constraints that `axes` (all axes) violate."""
    return [c for c in self.constraints if not _eval_constraint(c, axes)]


# Constraints are data from definition files (which users import from
# elsewhere), so they are never `eval`ed: they are parsed into this small
# arithmetic-and-comparison language and interpreted here.
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}


def parse_constraint(expr: Any) -> ast.Expression:
  """`expr` as a syntax tree of integer literals, names, + - * // %,
  comparisons, and/or/not; ValueError naming the first other construct."""
  if not isinstance(expr, str):
    raise ValueError(f"a constraint must be a string, got {type(expr).__name__}")
  try:
    tree = ast.parse(expr, mode="eval")
  except SyntaxError as e:
    raise ValueError(f"does not parse: {e.msg}") from None
  for node in ast.walk(tree):
    ok = (isinstance(node, (ast.Expression, ast.Name, ast.Load, ast.BoolOp, ast.And, ast.Or, ast.Compare,
                            ast.BinOp, ast.UnaryOp))
          or type(node) in _BINARY or type(node) in _COMPARE or type(node) in _UNARY
          or (isinstance(node, ast.Constant) and type(node.value) is int))
    if not ok:
      raise ValueError(f"{type(node).__name__} is not allowed (integers, axis names, + - * // %, "
                       "comparisons, and/or/not only)")
  return tree


def _evaluate(node: ast.AST, axes: Mapping[str, int]) -> Any:
  if isinstance(node, ast.Expression):
    return _evaluate(node.body, axes)
  if isinstance(node, ast.Constant):
    return node.value
  if isinstance(node, ast.Name):
    return axes[node.id]
  if isinstance(node, ast.UnaryOp):
    return _UNARY[type(node.op)](_evaluate(node.operand, axes))
  if isinstance(node, ast.BinOp):
    return _BINARY[type(node.op)](_evaluate(node.left, axes), _evaluate(node.right, axes))
  if isinstance(node, ast.BoolOp):
    values = (_evaluate(v, axes) for v in node.values)
    return all(values) if isinstance(node.op, ast.And) else any(values)
  left = _evaluate(node.left, axes)
  for op, right_node in zip(node.ops, node.comparators):
    right = _evaluate(right_node, axes)
    if not _COMPARE[type(op)](left, right):
      return False
    left = right
  return True


def _eval_constraint(expr: str, axes: Mapping[str, int]) -> bool:
  try:
    return bool(_evaluate(parse_constraint(expr), axes))
  except ZeroDivisionError:
    return False


def _tensor_specs(raw: Mapping[str, Any], path: pathlib.Path, kind: str,
                  axes: Mapping[str, AxisSpec]) -> dict[str, TensorSpec]:
  specs = {}
  for name, t in raw.items():
    shape = t.get("shape")
    dtype = t.get("dtype")
    if dtype not in DTYPES:
      raise DatasetError("unknown dtype", file=path, field=f"{kind}.{name}.dtype",
                         expected=f"one of {DTYPES}", got=dtype)
    if shape is not None:
      for a in shape:
        if a not in axes:
          raise DatasetError("shape names an undeclared axis", file=path,
                             field=f"{kind}.{name}.shape", expected=f"one of {list(axes)}", got=a)
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
      raise DatasetError("bad axis type", file=path, field=f"axes.{name}.type",
                         expected="'var' or 'const'", got=a.get("type"))
    if a["type"] == "const" and not _is_count(a.get("value")):
      raise DatasetError("const axis needs a non-negative integer value", file=path,
                         field=f"axes.{name}.value", expected="int >= 0", got=a.get("value"))
    axes[name] = AxisSpec(name=name, type=a["type"], value=a.get("value"), description=a.get("description", ""))
  for expr in raw.get("constraints", []):
    try:
      names = {n.id for n in ast.walk(parse_constraint(expr)) if isinstance(n, ast.Name)}
    except ValueError as e:
      raise DatasetError(f"bad constraint: {e}", file=path, field="constraints",
                         expected="an arithmetic comparison over axis names", got=expr) from None
    if names - set(axes):
      raise DatasetError("constraint names unknown axes", file=path, field="constraints",
                         expected=f"names among {list(axes)}", got=expr)
  return Definition(
      name=raw["name"], op_type=raw["op_type"], description=raw.get("description", ""),
      tags=tuple(raw.get("tags", ())), axes=axes,
      inputs=_tensor_specs(raw["inputs"], path, "inputs", axes),
      outputs=_tensor_specs(raw["outputs"], path, "outputs", axes),
      constraints=tuple(raw.get("constraints", ())), reference=raw["reference"], raw=dict(raw))


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
      raise DatasetError("definition name differs from its file name", file=path, field="name",
                         expected=path.stem, got=d.name)
    defs[d.name] = d
  return defs


# --------------------------------------------------------------------------
# Typed workloads.


@chex.dataclass(frozen=True, mappable_dataclass=False)
class Workload:
  uuid: str
  definition: str
  axes: dict[str, int]
  record: dict  # the whole recorded object, every field as recorded
  file: str = ""
  line: int = 0

  @property
  def variant(self) -> str | None:
    return self.record.get("variant")

  @property
  def provenance(self) -> dict:
    """Everything recorded beyond uuid, definition and axes."""
    return {k: v for k, v in self.record.items() if k not in CORE_FIELDS}


def _is_count(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def close_matches(name: str, names: Iterable[str]) -> list[str]:
  return difflib.get_close_matches(name, list(names), n=3, cutoff=0.5)


def validate_record(rec: Any, definitions: Mapping[str, Definition], *, file: str = "<record>",
                    line: int | None = None, expect_definition: str | None = None) -> Workload:
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
    raise err("unknown definition" + (f"; did you mean {', '.join(hint)}?" if hint else ""),
              field="definition", expected="a known definition", got=name)
  if expect_definition is not None and name != expect_definition:
    raise err("record is in another definition's file", field="definition",
              expected=expect_definition, got=name)
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
    if not _is_count(v):
      raise err("axis must be a non-negative integer", field=f"axes.{a}", expected="int >= 0", got=v)
    if d.axes[a].is_const and v != d.axes[a].value:
      raise err("const axis disagrees with the definition", field=f"axes.{a}",
                expected=d.axes[a].value, got=v)
  full = d.full_axes(axes)
  for c in d.check_constraints(full):
    raise err("constraint violated", field="axes", expected=c, got={k: full[k] for k in d.var_axes})
  return Workload(uuid=rec["uuid"], definition=name, axes={a: int(v) for a, v in axes.items()},
                  record=rec, file=str(file), line=line or 0)


ErrorSink = Callable[[DatasetError], None]


def _raise(e: DatasetError) -> None:
  raise e


def _read_records(path: str | os.PathLike, definitions: Mapping[str, Definition], *,
                  on_error: ErrorSink, seen_uuids: set[str], expect_definition: str | None = None,
                  to_record: Callable[[Any], Any] = lambda obj: obj) -> Iterator[tuple[Workload, str, bool]]:
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
        w = validate_record(rec, definitions, file=str(path), line=lineno,
                            expect_definition=expect_definition)
        if w.uuid in seen_uuids:
          raise DatasetError("duplicate uuid", file=path, line=lineno, field="uuid",
                             expected="unique in the dataset", got=w.uuid)
        seen_uuids.add(w.uuid)
      except DatasetError as e:
        on_error(e)
        continue
      yield w, text.rstrip("\r\n"), rec is not obj


def iter_jsonl(path: str | os.PathLike, definitions: Mapping[str, Definition], *,
               on_error: ErrorSink = _raise, seen_uuids: set[str] | None = None,
               expect_definition: str | None = None) -> Iterator[Workload]:
  """Yields the valid workloads of a JSONL file; each bad line goes to
  `on_error` (raise by default) and the rest of the file still loads."""
  seen = set() if seen_uuids is None else seen_uuids
  for w, _, _ in _read_records(path, definitions, on_error=on_error, seen_uuids=seen,
                            expect_definition=expect_definition):
    yield w


def workloads_path(name: str, dataset_dir: str | os.PathLike | None = None) -> pathlib.Path:
  return pathlib.Path(dataset_dir or default_dataset_dir()) / "workloads" / f"{name}.jsonl"


def load_workloads(name: str, dataset_dir: str | os.PathLike | None = None, *,
                   on_error: ErrorSink = _raise,
                   definitions: Mapping[str, Definition] | None = None) -> list[Workload]:
  """The typed workload records of one definition, in recorded order."""
  defs = definitions if definitions is not None else load_definitions(dataset_dir)
  if name not in defs:
    raise KeyError(f"unknown definition {name!r}; close matches: {close_matches(name, defs)}")
  path = workloads_path(name, dataset_dir)
  if not path.exists():
    return []
  return list(iter_jsonl(path, defs, on_error=on_error, expect_definition=name))


# --------------------------------------------------------------------------
# Import.


def record_from_line(obj: Any) -> Any:
  """A seed record as is; a FlashInfer-Bench trace (`{definition, workload:
  {uuid, axes, inputs}, solution, evaluation}`) flattened into a record with
  the trace's other fields kept under `fib_trace`."""
  if isinstance(obj, dict) and isinstance(obj.get("workload"), dict) and "uuid" not in obj:
    rec = {"definition": obj.get("definition"), **obj["workload"]}
    rest = {k: v for k, v in obj.items() if k not in ("definition", "workload") and v is not None}
    if rest:
      rec["fib_trace"] = rest
    return rec
  return obj


def convert(input_path: str | os.PathLike, output_dir: str | os.PathLike, *,
            definitions: Mapping[str, Definition] | None = None,
            on_error: ErrorSink = _raise) -> dict[str, int]:
  """Splits a JSONL of records (or FIB traces) into `output_dir/workloads/<definition>.jsonl`.

  Seed lines are written verbatim, so every field keeps its recorded value and
  a second conversion reproduces the first byte for byte. Files of definitions
  with records in the input are replaced; returns counts per definition."""
  defs = definitions if definitions is not None else load_definitions()
  out: dict[str, list[str]] = collections.defaultdict(list)
  for w, text, converted in _read_records(input_path, defs, on_error=on_error, seen_uuids=set(),
                                          to_record=record_from_line):
    # Seed records verbatim; records made from FIB traces in a canonical form.
    out[w.definition].append(json.dumps(w.record, sort_keys=True) if converted else text)
  wdir = pathlib.Path(output_dir) / "workloads"
  wdir.mkdir(parents=True, exist_ok=True)
  for name, lines in out.items():
    (wdir / f"{name}.jsonl").write_text("".join(l + "\n" for l in lines), encoding="utf-8")
  return {name: len(lines) for name, lines in sorted(out.items())}


def validate_dataset(dataset_dir: str | os.PathLike | None = None, *,
                     on_error: ErrorSink = _raise) -> dict[str, list[Workload]]:
  """Every workload of a dataset by definition; errors go to `on_error`."""
  ddir = pathlib.Path(dataset_dir or default_dataset_dir())
  defs = load_definitions(ddir)
  seen: set[str] = set()
  result = {}
  for path in sorted((ddir / "workloads").glob("*.jsonl")):
    if path.stem not in defs:
      on_error(DatasetError("workload file of an unknown definition", file=path,
                            expected=f"a definition file definitions/{path.stem}.json", got=path.name))
      continue
    result[path.stem] = list(iter_jsonl(path, defs, on_error=on_error, seen_uuids=seen,
                                        expect_definition=path.stem))
  return result


def stats_rows(workloads: Mapping[str, list[Workload]]) -> list[list[Any]]:
  rows = []
  for name, ws in sorted(workloads.items()):
    variants = collections.Counter(str(w.variant) for w in ws if w.variant is not None)
    ranges = {}
    for w in ws:
      for a, v in w.axes.items():
        lo, hi = ranges.get(a, (v, v))
        ranges[a] = (min(lo, v), max(hi, v))
    shown = ", ".join(f"{k}:{v}" for k, v in sorted(variants.items())[:4])
    if len(variants) > 4:
      shown += f", ... ({len(variants)} variants)"
    rows.append([name, len(ws), shown or "-",
                 ", ".join(f"{a}={lo}" if lo == hi else f"{a}={lo}..{hi}" for a, (lo, hi) in ranges.items())])
  return rows


def main(argv: list[str] | None = None) -> int:
  import argparse  # pylint: disable=g-import-not-at-top
  import tabulate  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(prog="python -m jaxkern.dataset", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("convert", help="import seed records or FIB traces")
  p.add_argument("--input", required=True)
  p.add_argument("--output", required=True)
  p.add_argument("--definitions", default=None,
                 help="dataset dir whose definitions/ validates the input (default: the output, else the repo's)")
  for name in ("validate", "stats"):
    sub.add_parser(name).add_argument("--dataset", default=None)
  args = parser.parse_args(argv)

  errors: list[DatasetError] = []

  def report(e: DatasetError) -> None:
    errors.append(e)
    print(f"error: {e}", file=sys.stderr)

  if args.cmd == "convert":
    def_dir = args.definitions
    if def_dir is None:
      def_dir = args.output if (pathlib.Path(args.output) / "definitions").is_dir() else None
    counts = convert(args.input, args.output, definitions=load_definitions(def_dir), on_error=report)
    print(tabulate.tabulate(sorted(counts.items()), headers=["definition", "records"]))
    print(f"{sum(counts.values())} records written, {len(errors)} skipped")
  else:
    workloads = validate_dataset(args.dataset, on_error=report)
    if args.cmd == "stats":
      print(tabulate.tabulate(stats_rows(workloads), headers=["definition", "records", "variants", "axes"]))
    total = sum(len(ws) for ws in workloads.values())
    print(f"{total} valid records in {len(workloads)} definitions, {len(errors)} errors")
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
