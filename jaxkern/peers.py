"""Peers: what a user of this field would run instead of a jaxkern kernel,
timed beside it on the same inputs with the same timer (`jaxkern.bench`).

  python -m jaxkern.peers --results R.jsonl --out P.jsonl [--scale auto]

re-runs every passed, timed workload of the replay results `R.jsonl` whose
definition a peer covers, on the inputs the replay used (the record, the
trace's seed and the run size `--scale`, which must be the replay's: a
workload whose axes come out otherwise is skipped), checks the peer's output
against the definition's reference with the definition's tolerances, times
it with `bench.measure` (the replay's warmup, iters and cold-L2 flush by
default) and writes one JSON line per (workload, peer) as it finishes
(`PeerResult`). `python -m jaxkern.report R.jsonl --peers P.jsonl` puts the
best peer beside our kernels.

The peers (`peers`; `[...]` names the implementation that ran):
  dense GEMM      XLA's dot, bf16 in, fp32 accumulation (cuBLAS on a GPU)
  attention       `jax.nn.dot_product_attention`, implementation "cudnn" on a
                  GPU ("xla" without one: cuDNN needs a GPU); key masks and
                  segments as its boolean `mask`, a cached prefix
                  concatenated before the keys
  attention       `tokamax.dot_product_attention` (same arguments), its
                  Pallas kernels "mosaic" and "triton" on a GPU, "xla"
                  without one
  FP8 x MXFP4     `tokamax.ragged_dot_general`, "mosaic" on a GPU (tokamax's
  grouped GEMM    Triton ragged dot needs the triton and jax-triton packages,
                  which the device kit does not carry), "xla" without one: the
                  activations and weights as qwix QArrays (e4m3 and e2m1
                  values, the UE8M0 scale bytes as bf16 powers of two, exact),
                  the weights [E, N, K] as stored (transposed-RHS dimension
                  numbers), group sizes counted from `expert_ids`. The
                  conversion to QArrays is done once before timing
                  (`Peer.prepare`), as a tokamax user keeps weights in its
                  format; counting the groups is timed. ragged_dot takes rows
                  grouped by expert: the synthesized workloads are (the
                  family's DeepGEMM contiguous layout); rows in another order
                  fail the peer's check rather than being timed with a sort.
tokamax peers exist where `tokamax` imports (the device kit carries it to the
GPU machine, `scripts/device_kit.py`; the development `.venv` does not have
it). Not covered: the other definitions (no library computes their contracts
as recorded).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxkern import bench, dataset, plan, quant, registry, results
from jaxkern.compare import Status
from pallas_kernels.shared.common import has_gpu

PeerFn = Callable[[Mapping[str, Any]], tuple[jax.Array, ...]]


@dataclasses.dataclass(frozen=True)
class Peer:
  """A library's way of computing a definition's outputs from its inputs."""

  name: str  # what ran, e.g. "jax.nn.dot_product_attention[cudnn]"
  covers: Callable[[str], bool]  # does it compute this definition's outputs
  build: Callable[[bool], PeerFn]  # on_gpu -> the timed function of the (prepared) inputs
  # The definition's inputs in the peer's own formats, untimed (None: as they are).
  prepare: Callable[[Mapping[str, jax.Array]], Mapping[str, Any]] | None = None


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


def _tokamax_attention(implementation: str) -> Callable[[bool], PeerFn]:
  def build(_: bool) -> PeerFn:
    import tokamax  # pyright: ignore[reportMissingImports] (optional: a peer only where it imports)

    def run(x):
      q, k, v, mask = _attention_arguments(x)
      return (tokamax.dot_product_attention(q, k, v, mask=mask, implementation=implementation),)

    return run

  return build


def grouped_gemm_operands(x: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """The FP8 x MXFP4 grouped GEMM's inputs as the arrays of qwix QArrays:
  `a` e4m3 [M, K] and `b` float4_e2m1fn [E, N, K] (the packed bytes' nibbles,
  low first, are e2m1 bit patterns: a bitcast), their UE8M0 scale bytes as
  bf16 powers of two `a_scale` [M, K/32], `b_scale` [E, N, K/32] (exact; 255
  is inf), `expert_ids` as they are."""
  b = x["b"]
  nibbles = jnp.stack([b % 16, b // 16], axis=-1).astype(jnp.uint4)
  return {
    "a": x["a"],
    "a_scale": quant.ue8m0_to_f32(x["a_scale"]).astype(jnp.bfloat16),
    "b": lax.bitcast_convert_type(nibbles, jnp.float4_e2m1fn).reshape(*b.shape[:-1], -1),
    "b_scale": quant.ue8m0_to_f32(x["b_scale"]).astype(jnp.bfloat16),
    "expert_ids": x["expert_ids"],
  }


def _tokamax_grouped_operands(x: Mapping[str, jax.Array]) -> dict[str, Any]:
  import qwix  # pyright: ignore[reportMissingImports] (tokamax's quantized arrays)

  o = jax.jit(grouped_gemm_operands)(x)
  return {
    "lhs": qwix.QArray(qvalue=o["a"], scale=o["a_scale"], qtype=jnp.float8_e4m3fn),
    "rhs": qwix.QArray(qvalue=o["b"], scale=o["b_scale"], qtype=jnp.float4_e2m1fn),
    "expert_ids": o["expert_ids"],
  }


# lhs [M, K] x rhs [E, N, K] (weights as stored, contracted on their last axis).
_TRANSPOSED_RHS = lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def _tokamax_ragged_dot(implementation: str) -> Callable[[bool], PeerFn]:
  def build(_: bool) -> PeerFn:
    import tokamax  # pyright: ignore[reportMissingImports] (optional: a peer only where it imports)

    def run(x):
      experts = x["rhs"].shape[0]
      group_sizes = jnp.bincount(x["expert_ids"], length=experts).astype(jnp.int32)
      c = tokamax.ragged_dot_general(
        x["lhs"],
        x["rhs"],
        group_sizes,
        _TRANSPOSED_RHS,
        preferred_element_type=jnp.bfloat16,
        implementation=implementation,
      )
      return (c,)

    return run

  return build


def _is_attention(name: str) -> bool:
  return name.startswith(("noncausal_dense_attention", "prefix_cached_block_causal"))


def _is_grouped_gemm(name: str) -> bool:
  return name.startswith("grouped_gemm_fp8_fp4")


def tokamax_unavailable() -> str | None:
  """None when tokamax imports here, else why not."""
  if importlib.util.find_spec("tokamax") is None:
    return "tokamax is not installed"
  try:
    import tokamax  # noqa: F401  # pyright: ignore[reportMissingImports]
  except Exception as e:  # a broken install (a compiled dependency missing) is not a peer
    return f"tokamax does not import: {bench.short_error(e)}"
  return None


def peers(on_gpu: bool, *, log: Callable[[str], None] = lambda s: None) -> tuple[Peer, ...]:
  """The peers this process can run (tokamax's only where it imports; `log`
  says why not)."""
  found = [
    Peer("xla dot" + (" (cuBLAS)" if on_gpu else ""), lambda n: n.startswith("dense_gemm"), _xla_dot),
    Peer(f"jax.nn.dot_product_attention[{'cudnn' if on_gpu else 'xla'}]", _is_attention, _nn_attention),
  ]
  why_not = tokamax_unavailable()
  if why_not:
    log(f"peers: no tokamax peers: {why_not}")
    return tuple(found)
  for impl in ("mosaic", "triton") if on_gpu else ("xla",):
    found.append(Peer(f"tokamax.dot_product_attention[{impl}]", _is_attention, _tokamax_attention(impl)))
  for impl in ("mosaic",) if on_gpu else ("xla",):
    found.append(
      Peer(
        f"tokamax.ragged_dot_general[{impl}]",
        _is_grouped_gemm,
        _tokamax_ragged_dot(impl),
        prepare=_tokamax_grouped_operands,
      )
    )
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


def read_peer_results(path: str | os.PathLike) -> list[PeerResult]:
  """The lines of a peers file (`python -m jaxkern.peers --out`); ValueError
  naming the line that is not a peer result."""
  rows = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rows.append(PeerResult(**json.loads(line)))
      except (ValueError, TypeError) as e:
        raise ValueError(f"{path}:{n}: not a peer result ({e})") from None
  return rows


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
    args = jax.block_until_ready(peer.prepare(inputs)) if peer.prepare else inputs  # untimed: the peer's formats
    out = op.name_outputs(jax.block_until_ready(fn(args)))
    cmp = op.compare(out, reference, inputs=inputs)
    row.status = cmp.status.value
    row.log = "; ".join(f"{n}: {o.message}" for n, o in cmp.outputs.items() if o.message)
    t = bench.measure(lambda: fn(args), warmup=warmup, iters=iters, on_gpu=on_gpu, cold_l2=cold_l2 and on_gpu)
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
  available = peers(on_gpu, log=log)
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
        axes = plan.axes_run(op, plan.run_axes(op, op.validated_axes(w.axes), scale, on_gpu))
        if trace.workload.axes_run is not None and axes != trace.workload.axes_run:
          log(
            f"peers: {trace.definition} {trace.workload.uuid}: --scale {scale} gives axes {axes}, the replay ran "
            f"{trace.workload.axes_run}; skipped (pass the replay's scale)"
          )
          continue
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
