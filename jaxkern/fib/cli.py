"""`python -m jaxkern.fib export|import`: the command line of the
FlashInfer-Bench interop (README, "FlashInfer-Bench")."""

from __future__ import annotations

import argparse
import sys

from jaxkern import dataset

USAGE = """FlashInfer-Bench 0.1.2 TraceSet folders:
  export --out DIR [--dataset DS] [--results R.jsonl ...] [--definitions NAME ...]
      our dataset (and replay results, as traces) as a TraceSet folder
  import DIR --out DATASET_DIR
      a TraceSet folder as a dataset of ours; replay it with
      python -m jaxkern.replay --config configs/replay.py --config.dataset_dir=DATASET_DIR
"""


def main(argv: list[str] | None = None) -> int:
  """Exit codes: 0 done (export: results FIB cannot hold are counted, by
  reason); 1 import done, but definitions or records were left out
  (reported); 2 bad arguments, a missing or non-empty folder, or a bad dataset."""
  from jaxkern.fib import export as fib_export
  from jaxkern.fib import import_ as fib_import

  parser = argparse.ArgumentParser(
    prog="python -m jaxkern.fib", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  sub = parser.add_subparsers(dest="cmd", required=True)
  what = "our dataset and results as a FIB TraceSet folder"
  ex = sub.add_parser("export", help=what, description=what)
  ex.add_argument("--out", required=True, help="the TraceSet folder to write (absent or empty; required)")
  ex.add_argument("--dataset", default=None, help="dataset folder (default: the shipped one)")
  ex.add_argument(
    "--results", nargs="*", default=[], help="replay result files (JSONL) to export as traces (default: none)"
  )
  ex.add_argument("--definitions", nargs="*", default=None, help="only these definitions (default: every one)")
  what = "a FIB TraceSet folder as a dataset of ours"
  im = sub.add_parser("import", help=what, description=what)
  im.add_argument("dir", help="the TraceSet folder to read (definitions/, workloads/, traces/)")
  im.add_argument("--out", required=True, help="the dataset folder to write (absent or empty; required)")
  args = parser.parse_args(argv)
  try:
    if args.cmd == "export":
      s = fib_export.export(args.out, dataset_dir=args.dataset, results=args.results, names=args.definitions)
      print("\n".join(s.lines()))
      print(f"wrote {args.out}")
      return 0
    s = fib_import.import_trace_set(args.dir, args.out)
    print("\n".join(s.lines()))
    print(
      f"replay: python -m jaxkern.replay --config configs/replay.py --config.dataset_dir={args.out}"
      f" [--config.blob_root={args.dir}]"
    )
    return 1 if (s.unmatched or s.problems) else 0
  except (FileExistsError, FileNotFoundError, KeyError, dataset.DatasetError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
