"""Peers: what a user of this field would run instead of a jaxkern kernel,
timed beside it on the same inputs with the same timer (`jaxkern.bench`).

  python -m jaxkern.peers --results R.jsonl --out P.jsonl [--scale auto]

re-runs every passed, timed workload of the replay results `R.jsonl` whose
definition a peer covers, on the inputs the replay used (the record, the
trace's seed and the run size `--scale`, which must be the replay's), checks
the peer's output against the definition's reference with the definition's
tolerances, times it with `bench.measure` (the replay's warmup, iters and
cold-L2 flush by default) and writes one JSON line per (workload, peer) as it
finishes (`PeerResult`). `jaxkern.report --peers P.jsonl` puts them beside
our kernels.

The peers (`PEERS`):
  dense GEMM      XLA's dot, bf16 in, fp32 accumulation (cuBLAS on a GPU)
  attention       `jax.nn.dot_product_attention`, implementation "cudnn" on a
                  GPU ("xla" without one: cuDNN needs a GPU; the name says
                  which ran); key masks and segments as its boolean `mask`,
                  a cached prefix concatenated before the keys
  attention       `tokamax.dot_product_attention` (same arguments), when
                  `tokamax` imports
Not covered: the FP8 x MXFP4 grouped GEMM (tokamax's `ragged_dot` takes
rows sorted by group and qwix-quantized operands, not the records' unsorted
rows with UE8M0 byte scales) and the other definitions (no library computes
their contracts as recorded).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxkern import bench, dataset, plan, registry, results
from jaxkern.compare import Status
from pallas_kernels.shared.common import has_gpu

PeerFn = Callable[[Mapping[str, jax.Array]], tuple[jax.Array, ...]]


@dataclasses.dataclass(frozen=True)
class Peer:
  """A library's way of computing a definition's outputs from its inputs."""

  name: str  # what ran, e.g. "jax.nn.dot_product_attention[cudnn]"
  covers: Callable[[str], bool]  # does it compute this definition's outputs
  build: Callable[[bool], PeerFn]  # on_gpu -> the function of the input dict


def _xla_dot(_: bool) -> PeerFn:
  def run(x):
    c = jnp.dot(x["A"], x["B"].T, preferred_element_type=jnp.float32)
    return (c.astype(x["A"].dtype),)

  return run


def _attention_arguments(x: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
  """q, k, v and a boolean mask [B, 1, Nq, Nk] (None: every key visible) for
  the attention definitions: key_valid hides keys, segment_ids makes the
  pass block-causal (key j visible to query i when segment j <= segment i),
  and a cached prefix is seen by every query."""
  q, k, v = x["q"], x["k"], x["v"]
  mask = None
  if "key_valid" in x:
    mask = x["key_valid"].astype(bool)[:, None, None, :]
  if "segment_ids" in x:
    seg = x["segment_ids"]
    mask = seg[:, None, None, :] <= seg[:, None, :, None]
  if "k_prefix" in x and x["k_prefix"].shape[1]:
    k = jnp.concatenate([x["k_prefix"], k], axis=1)
    v = jnp.concatenate([x["v_prefix"], v], axis=1)
  return q, k, v, mask


def _nn_attention(on_gpu: bool) -> PeerFn:
  implementation = "cudnn" if on_gpu else "xla"

  def run(x):
    q, k, v, mask = _attention_arguments(x)
    return (jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation),)

  return run


def _tokamax_attention(_: bool) -> PeerFn:
  import tokamax  # pyright: ignore[reportMissingImports] (optional: a peer only where it imports)

  def run(x):
    q, k, v, mask = _attention_arguments(x)
    return (tokamax.dot_product_attention(q, k, v, mask=mask),)

  return run


def _is_attention(name: str) -> bool:
  return name.startswith(("noncausal_dense_attention", "prefix_cached_block_causal"))


def peers(on_gpu: bool) -> tuple[Peer, ...]:
  """The peers this process can run (tokamax only where it imports)."""
  found = [
    Peer("xla dot" + (" (cuBLAS)" if on_gpu else ""), lambda n: n.startswith("dense_gemm"), _xla_dot),
    Peer(f"jax.nn.dot_product_attention[{'cudnn' if on_gpu else 'xla'}]", _is_attention, _nn_attention),
  ]
  if importlib.util.find_spec("tokamax") is not None:
    found.append(Peer("tokamax.dot_product_attention", _is_attention, _tokamax_attention))
  return tuple(found)


@dataclasses.dataclass
class PeerResult:
  """One peer on one workload. `speedup_vs_peer` = peer time / our time
  (> 1: ours is faster), only when both were measured by the same timer."""

  definition: str
  uuid: str
  peer: str
  status: str  # a `Status` value of the peer's output against the reference
  log: str = ""
  timer: str | None = None
  latency_ms: float | None = None
  ours_latency_ms: float | None = None
  ours_backend: str | None = None
  speedup_vs_peer: float | None = None

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def read_peer_results(path: str | pathlib.Path) -> list[PeerResult]:
  """The lines of a peers file (`python -m jaxkern.peers --out`)."""
  with open(path) as f:
    return [PeerResult(**json.loads(line)) for line in f if line.strip()]


def run_peer(
  peer: Peer,
  op: registry.Op,
  trace: results.Trace,
  inputs: Mapping[str, jax.Array],
  reference: Mapping[str, jax.Array],
  *,
  on_gpu: bool,
  warmup: int,
  iters: int,
  cold_l2: bool,
) -> PeerResult:
  """Checks and times one peer on one workload's inputs; a failing peer is a
  result with its error, never an exception."""
  perf = trace.evaluation.performance or {}
  row = PeerResult(
    trace.definition,
    trace.workload.uuid,
    peer.name,
    Status.RUNTIME_ERROR.value,
    ours_latency_ms=perf.get("latency_ms"),
    ours_backend=trace.evaluation.backend,
  )
  try:
    fn = jax.jit(peer.build(on_gpu))
    out = op.name_outputs(jax.block_until_ready(fn(inputs)))
    cmp = op.compare(out, reference, inputs=inputs)
    row.status = cmp.status.value
    row.log = "; ".join(f"{n}: {o.message}" for n, o in cmp.outputs.items() if o.message)
    t = bench.measure(lambda: fn(inputs), warmup=warmup, iters=iters, on_gpu=on_gpu, cold_l2=cold_l2 and on_gpu)
  except Exception as e:  # a peer that cannot run this workload is a result, not a stop
    row.log = bench.short_error(e)
    return row
  row.timer, row.latency_ms = t["timer"], t["median_ms"]
  if row.ours_latency_ms and row.latency_ms and perf.get("timer") == row.timer:
    row.speedup_vs_peer = row.latency_ms / row.ours_latency_ms
  return row


def run(
  results_path: str,
  out_path: str,
  *,
  scale: str = "auto",
  warmup: int = 1,
  iters: int = 3,
  cold_l2: bool = True,
  dataset_dir: str = "",
  log: Callable[[str], None] = print,
) -> list[PeerResult]:
  """Every peer on every passed, timed workload of `results_path` it covers,
  written to `out_path` (appended, a line per result as it finishes)."""
  on_gpu = has_gpu()
  available = peers(on_gpu)
  traces = [
    t
    for t in results.read_traces(results_path)
    if t.status == Status.PASSED and results.timer_of(t) and any(p.covers(t.definition) for p in available)
  ]
  log(f"peers: {len(traces)} workloads of {results_path} have a peer ({', '.join(p.name for p in available)})")
  records: dict[str, dict[str, dataset.Workload]] = {}
  written: list[PeerResult] = []
  pathlib.Path(out_path).parent.mkdir(parents=True, exist_ok=True)
  with open(out_path, "a") as out:
    for i, trace in enumerate(traces, 1):
      op = registry.get(trace.definition, dataset_dir or None)
      if trace.definition not in records:
        records[trace.definition] = {w.uuid: w for w in dataset.load_workloads(trace.definition, dataset_dir or None)}
      w = records[trace.definition].get(trace.workload.uuid)
      if w is None:
        log(f"peers: {trace.definition} {trace.workload.uuid}: not in the dataset; skipped")
        continue
      try:
        p = plan.plan(op, w, size=scale, seed=trace.workload.seed, on_gpu=on_gpu, tuned=False)
        reference = jax.block_until_ready(jax.jit(op.reference)(p.inputs))
      except Exception as e:  # the replay ran these inputs; a failure here is reported, not fatal
        log(f"peers: {trace.definition} {trace.workload.uuid}: inputs or reference failed: {bench.short_error(e)}")
        continue
      for peer in available:
        if not peer.covers(trace.definition):
          continue
        row = run_peer(peer, op, trace, p.inputs, reference, on_gpu=on_gpu, warmup=warmup, iters=iters, cold_l2=cold_l2)
        out.write(json.dumps(row.to_json()) + "\n")
        out.flush()
        written.append(row)
        ratio = f", peer/ours {row.speedup_vs_peer:.2f}" if row.speedup_vs_peer is not None else ""
        time_text = f"{row.latency_ms:.4g} ms ({row.timer})" if row.latency_ms is not None else row.log
        log(f"[{i}/{len(traces)}] {trace.definition} {peer.name}: {row.status}, {time_text}{ratio}")
  return written


def main(argv: Sequence[str] | None = None) -> int:
  import argparse

  parser = argparse.ArgumentParser(prog="python -m jaxkern.peers", description=(__doc__ or "").split("\n\n")[0])
  parser.add_argument("--results", required=True, help="replay results (JSONL) whose workloads the peers run")
  parser.add_argument("--out", required=True, help="peer results (JSONL), appended a line per result")
  parser.add_argument("--scale", default="auto", choices=plan.RUN_SIZES, help="the replay's run size (default: auto)")
  parser.add_argument("--warmup", type=int, default=1, help="untimed calls before timing (default: 1)")
  parser.add_argument("--iters", type=int, default=3, help="timed calls (default: 3)")
  parser.add_argument(
    "--cold_l2",
    default=True,
    action=argparse.BooleanOptionalAction,
    help="flush the L2 before each timed call (default: on)",
  )
  parser.add_argument("--dataset_dir", default="", help="dataset folder (default: the packaged dataset)")
  args = parser.parse_args(argv)
  try:
    run(
      args.results,
      args.out,
      scale=args.scale,
      warmup=args.warmup,
      iters=args.iters,
      cold_l2=args.cold_l2,
      dataset_dir=args.dataset_dir,
    )
  except (OSError, ValueError, dataset.DatasetError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
