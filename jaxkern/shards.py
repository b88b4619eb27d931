"""Splitting a replay across processes (and hosts), and joining the results.

After `jax.distributed.initialize`, process `i` of `n` replays every n-th
selected workload starting at the i-th (the selection order is the dataset's,
identical in every process), writes its own results file
(`<output stem>.<i>-of-<n>.jsonl`) and, beside it, a manifest naming the
uuids it was assigned. `merge` joins the files of all shards and checks that
every shard is present, no uuid is missing and none is doubled:

  python -m jaxkern.shards merge --output OUT SHARD.jsonl ...
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import TypeVar

from jaxkern import results

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Shard:
  index: int = 0
  count: int = 1

  def __post_init__(self):
    if not 0 <= self.index < self.count:
      raise ValueError(f"shard index {self.index} is not in [0, {self.count})")

  def take(self, items: Sequence[T]) -> list[T]:
    return list(items[self.index :: self.count])

  def output(self, path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    if self.count == 1:
      return path
    return path.with_name(f"{path.stem}.{self.index}-of-{self.count}{path.suffix}")


def manifest_path(results_path: str | pathlib.Path) -> pathlib.Path:
  return pathlib.Path(str(results_path) + ".manifest.json")


def write_manifest(results_path: str | pathlib.Path, shard: Shard, uuids: Sequence[str], selected: int) -> None:
  manifest_path(results_path).write_text(
    json.dumps({"shard_index": shard.index, "shard_count": shard.count, "selected": selected, "uuids": list(uuids)})
    + "\n"
  )


def split_round_robin(items: Sequence[T], parts: int) -> list[list[T]]:  # noqa: UP047  (T is shared with Shard.take)
  """`parts` lists taking every `parts`-th item (one per local device)."""
  return [list(items[i::parts]) for i in range(parts)]


class MergeError(ValueError):
  pass


def merge(inputs: Sequence[str | pathlib.Path], output: str | pathlib.Path) -> int:
  """Joins shard result files into `output` (lines in shard order, then
  file order); returns the number of lines. Raises MergeError when a shard
  is missing, a file has no manifest, a uuid is doubled or an assigned uuid
  has no result."""
  seen: dict[str, str] = {}
  manifests = {}
  lines: list[tuple[int, str]] = []
  for path in map(pathlib.Path, inputs):
    mpath = manifest_path(path)
    if not mpath.exists():
      raise MergeError(f"{path}: no manifest {mpath.name} beside it (not written by a sharded replay?)")
    m = json.loads(mpath.read_text())
    if m["shard_index"] in manifests:
      raise MergeError(f"{path}: shard {m['shard_index']} given twice")
    manifests[m["shard_index"]] = m
    got = set()
    for trace in results.read_traces(path):
      uuid = trace.workload.uuid
      if uuid in seen:
        raise MergeError(f"uuid {uuid} appears in {seen[uuid]} and {path}")
      seen[uuid] = str(path)
      got.add(uuid)
      lines.append((m["shard_index"], json.dumps(trace.to_json())))
    missing = [u for u in m["uuids"] if u not in got]
    if missing:
      raise MergeError(
        f"{path}: {len(missing)} assigned workloads have no result (resume that shard): "
        f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
      )
  counts = {m["shard_count"] for m in manifests.values()}
  if len(counts) != 1:
    raise MergeError(f"files come from runs with different shard counts: {sorted(counts)}")
  (count,) = counts
  absent = sorted(set(range(count)) - set(manifests))
  if absent:
    raise MergeError(f"shards {absent} of {count} are missing")
  out = pathlib.Path(output)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text("".join(line + "\n" for _, line in sorted(lines, key=lambda x: x[0])))
  return len(lines)


def main(argv: list[str] | None = None) -> int:
  """`python -m jaxkern.shards merge --output OUT SHARD.jsonl ...`"""
  import argparse

  parser = argparse.ArgumentParser(prog="python -m jaxkern.shards")
  sub = parser.add_subparsers(dest="command", required=True)
  what = "join the result files of a sharded replay (checks every uuid once)"
  command = sub.add_parser("merge", help=what, description=what)
  command.add_argument("--output", required=True, help="the merged results file to write (required)")
  command.add_argument("inputs", nargs="+", help="every shard's results file (<output stem>.<i>-of-<n>.jsonl)")
  args = parser.parse_args(argv)
  try:
    n = merge(args.inputs, args.output)
  except MergeError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"merged {n} results from {len(args.inputs)} files into {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
