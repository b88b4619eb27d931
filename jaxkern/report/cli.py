"""`python -m jaxkern.report`: a report of a replay's results that people can look at.

  python -m jaxkern.report RESULTS.jsonl [--baseline OTHER.jsonl] [--out DIR] [--dataset_dir DIR]
                           [--markdown SUMMARY.md] [--peers PEERS.jsonl]

Prints a table per definition and timer (status counts, worst error against
tolerance, median kernel / reference / speed-of-light time, median SOL
fraction where timed on a GPU) and writes `DIR/index.html` (default:
`<results>_report/` beside the results file) with matplotlib PNGs:

- `errors.png`: each workload's worst error / tolerance, per definition;
- `latency.png`: kernel vs reference time per workload (log-log);
- `sol_fraction.png`: speed of light / kernel time per workload (GPU runs);
- `baseline.png` (with `--baseline`): status changes per definition and the
  latency ratio (this run / baseline) of each workload present in both.

Failed workloads appear in every plot (without a value: in a red error
band). `--markdown` also writes the summary (per definition: timer, passed /
total, median kernel, reference time and SOL fraction; the geomean SOL
fraction and the definitions furthest from their speed of light, per timer):
the page a device run leaves in `docs/perf/<device>.md`. `--peers` (from
`python -m jaxkern.peers`) adds to each row the best peer, its median time
and peer/ours (the median per-workload ratio peer time / our time: > 1, ours
is faster), only where both were timed by the same timer (else `n/c`: on a
CPU the kernels run in interpret mode and the peers by wall clock), and a
peers table with every peer's counts and times.
Exit code 0, or 2 when a results file is missing or holds no result, or an
output cannot be written.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from jaxkern.report.page import build


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m jaxkern.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("results", nargs="+", help="replay results JSONL (several: read together, e.g. one per backend)")
  parser.add_argument("--baseline", default=None, help="another run's results JSONL to compare with")
  parser.add_argument("--out", default=None, help="output folder (default: <results>_report beside the results)")
  parser.add_argument("--dataset_dir", default="", help="dataset with the definitions (default: the package's)")
  parser.add_argument("--markdown", default=None, help="also write the summary table as markdown to this file")
  parser.add_argument("--peers", default=None, help="peer results JSONL (python -m jaxkern.peers) to put beside ours")
  args = parser.parse_args(argv)
  for path in (*args.results, args.baseline, args.peers):
    if path is not None and not pathlib.Path(path).is_file():
      print(f"error: no results file {path}", file=sys.stderr)
      return 2
  if args.markdown is not None and not pathlib.Path(args.markdown).resolve().parent.is_dir():
    print(f"error: --markdown {args.markdown}: no folder {pathlib.Path(args.markdown).parent}", file=sys.stderr)
    return 2
  try:
    report = build(
      args.results,
      baseline=args.baseline,
      out_dir=args.out,
      dataset_dir=args.dataset_dir,
      markdown=args.markdown,
      peers=args.peers,
    )
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except OSError as e:
    print(f"error: cannot write the report: {e}", file=sys.stderr)
    return 2
  print(report.text)
  return 0
