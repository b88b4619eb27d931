"""Importing records into a dataset (seed JSONL or FlashInfer-Bench
traces), per-definition statistics, and the `python -m jaxkern.dataset`
command line."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import sys
from collections.abc import Mapping
from typing import Any

from jaxkern.dataset.loading import ErrorSink, load_definitions, raise_error, read_records, validate_dataset
from jaxkern.dataset.records import DatasetError, Definition, Workload

USAGE = """Command line (`python -m jaxkern.dataset ...`):
  convert --input FILE --output DIR   import seed records or FIB trace JSONL
  validate [--dataset DIR]            check every record; one line per error
  stats [--dataset DIR]               counts per definition, variant, axis range
"""


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


def convert(
  input_path: str | os.PathLike,
  output_dir: str | os.PathLike,
  *,
  definitions: Mapping[str, Definition] | None = None,
  on_error: ErrorSink = raise_error,
) -> dict[str, int]:
  """Splits a JSONL of records (or FIB traces) into `output_dir/workloads/<definition>.jsonl`.

  Seed lines are written verbatim, so every field keeps its recorded value and
  a second conversion reproduces the first byte for byte. Files of definitions
  with records in the input are replaced; returns counts per definition."""
  defs = definitions if definitions is not None else load_definitions()
  out: dict[str, list[str]] = collections.defaultdict(list)
  for w, text, converted in read_records(
    input_path, defs, on_error=on_error, seen_uuids=set(), to_record=record_from_line
  ):
    # Seed records verbatim; records made from FIB traces in a canonical form.
    out[w.definition].append(json.dumps(w.record, sort_keys=True) if converted else text)
  wdir = pathlib.Path(output_dir) / "workloads"
  wdir.mkdir(parents=True, exist_ok=True)
  for name, lines in out.items():
    (wdir / f"{name}.jsonl").write_text("".join(l + "\n" for l in lines), encoding="utf-8")
  return {name: len(lines) for name, lines in sorted(out.items())}


def stats_rows(workloads: Mapping[str, list[Workload]]) -> list[list[Any]]:
  """Per definition: record count, the first variants with their counts, and
  each axis's recorded range."""
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
    rows.append(
      [
        name,
        len(ws),
        shown or "-",
        ", ".join(f"{a}={lo}" if lo == hi else f"{a}={lo}..{hi}" for a, (lo, hi) in ranges.items()),
      ]
    )
  return rows


def main(argv: list[str] | None = None) -> int:
  """The command line; exit code 1 when any record was bad."""
  import argparse

  import tabulate

  parser = argparse.ArgumentParser(
    prog="python -m jaxkern.dataset", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  sub = parser.add_subparsers(dest="cmd", required=True)
  what = "import seed records or FIB traces"
  p = sub.add_parser("convert", help=what, description=what)
  p.add_argument("--input", required=True, help="seed records or FIB trace JSONL to import (required)")
  p.add_argument("--output", required=True, help="the dataset folder to write workloads/ into (required)")
  p.add_argument(
    "--definitions",
    default=None,
    help="dataset dir whose definitions/ validates the input (default: the output, else the repo's)",
  )
  for name, what in (
    ("validate", "check every record; one line per error"),
    ("stats", "counts per definition, variant, axis range"),
  ):
    sub.add_parser(name, help=what, description=what).add_argument(
      "--dataset", default=None, help="dataset folder (default: the shipped one)"
    )
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
