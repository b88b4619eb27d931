"""jaxkern.peers: the libraries a user would pick instead, on the replay's own workloads."""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxkern import dataset, peers, plan, quant, registry, replay, results

DEFINITIONS = (
  "dense_gemm_bf16_nt_n4096_k4096",
  "noncausal_dense_attention_h32_d64",
  "prefix_cached_block_causal_h32_d128",
  "prefix_cached_block_causal_h32_d128_prefix0",  # segments: the block-causal mask
)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
  """A smoke replay of one workload of each covered definition, in this process."""
  out = tmp_path_factory.mktemp("peers") / "replay.jsonl"
  cfg = replay.default_config()
  cfg.update(
    definitions=",".join(DEFINITIONS),
    max_workloads_per_definition=1,
    scale="smoke",
    isolation="none",
    progress=False,
    output=str(out),
    warmup=0,
    iters=1,
  )
  assert replay.replay(cfg, log=lambda s: None) == 0
  return out


def test_every_covered_workload_gets_each_peer_checked_and_timed(replayed, tmp_path):
  out = tmp_path / "peers.jsonl"
  rows = peers.run(str(replayed), str(out), scale="smoke", warmup=0, iters=1, log=lambda s: None)
  traces = {t.workload.uuid: t for t in results.read_traces(replayed)}
  assert [r.definition for r in rows] == list(DEFINITIONS)
  for r in rows:
    assert r.status == "passed", r.log
    assert r.peer == ("xla dot" if r.definition.startswith("dense_gemm") else "jax.nn.dot_product_attention[xla]")
    assert r.timer == "wall" and r.latency_ms > 0
    ours = traces[r.uuid].evaluation
    assert r.ours_latency_ms == ours.performance["latency_ms"] and r.ours_backend == ours.backend
    assert r.speedup_vs_peer is None  # interpret mode (ours) and wall clock (peer) are not compared
  assert [peers.PeerResult(**json.loads(line)) for line in out.read_text().splitlines()] == rows
  assert peers.read_peer_results(out) == rows


def test_a_peer_that_fails_is_a_result_and_equal_timers_give_the_ratio(replayed):
  trace = next(t for t in results.read_traces(replayed) if t.definition == DEFINITIONS[0])
  op = registry.get(trace.definition)
  [w] = [w for w in dataset.load_workloads(op.name) if w.uuid == trace.workload.uuid]
  p = plan.plan(op, w, size="smoke", seed=trace.workload.seed, tuned=False)
  reference = op.reference(p.inputs)

  def broken(_):
    def run(x):
      raise RuntimeError("no such kernel")

    return run

  row = peers.run_peer(
    peers.Peer("broken", lambda n: True, broken),
    op,
    trace,
    p.inputs,
    reference,
    on_gpu=False,
    warmup=0,
    iters=1,
    cold_l2=False,
  )
  assert row.status == "runtime_error" and "no such kernel" in row.log and row.latency_ms is None

  # A peer computing something else fails the definition's comparison.
  def transposed(_):
    return lambda x: ((x["A"] @ x["B"].T).T,)

  wrong = peers.run_peer(
    peers.Peer("wrong", lambda n: True, transposed),
    op,
    trace,
    p.inputs,
    reference,
    on_gpu=False,
    warmup=0,
    iters=1,
    cold_l2=False,
  )
  assert wrong.status != "passed"

  # Ours timed by the same timer as the peer: the ratio is peer time / our time.
  perf = dict(trace.evaluation.performance, timer="wall", latency_ms=1e-6)
  same_timer = dataclasses.replace(trace, evaluation=dataclasses.replace(trace.evaluation, performance=perf))
  xla = next(q for q in peers.peers(on_gpu=False) if q.covers(op.name))
  timed = peers.run_peer(xla, op, same_timer, p.inputs, reference, on_gpu=False, warmup=0, iters=1, cold_l2=False)
  assert timed.status == "passed" and timed.speedup_vs_peer == pytest.approx(timed.latency_ms / 1e-6)


def test_peers_cover_only_what_they_compute():
  available = {p.name: p for p in peers.peers(on_gpu=True)}
  assert {"xla dot (cuBLAS)", "jax.nn.dot_product_attention[cudnn]"} <= set(available)
  covered = {n for n in registry.names() if any(p.covers(n) for p in available.values())}
  assert covered == {n for n in registry.names() if n.startswith(("dense_gemm", "noncausal", "prefix_cached"))}


def test_scale_other_than_the_replays_is_skipped_before_inputs_are_made(replayed, tmp_path):
  gemm = tmp_path / "gemm.jsonl"  # the dense GEMM's smoke workload (M shrunk from the record's)
  gemm.write_text(next(l for l in replayed.read_text().splitlines() if DEFINITIONS[0] in l) + "\n")
  said = []
  rows = peers.run(str(gemm), str(tmp_path / "p.jsonl"), scale="full", warmup=0, iters=1, log=said.append)
  assert rows == [] and "skipped (pass the replay's scale)" in said[-1]


def test_prepare_is_untimed_and_the_check_sees_the_definitions_inputs(replayed):
  trace = next(t for t in results.read_traces(replayed) if t.definition == DEFINITIONS[0])
  op = registry.get(trace.definition)
  [w] = [w for w in dataset.load_workloads(op.name) if w.uuid == trace.workload.uuid]
  p = plan.plan(op, w, size="smoke", seed=trace.workload.seed, tuned=False)
  prepared = []

  def prepare(x):
    prepared.append(1)
    return {"lhs": x["A"], "rhs_t": x["B"].T}  # the peer's own layout

  def build(_):
    return lambda x: ((x["lhs"].astype(jnp.float32) @ x["rhs_t"].astype(jnp.float32)).astype(jnp.bfloat16),)

  peer = peers.Peer("transposed-weights dot", lambda n: True, build, prepare=prepare)
  row = peers.run_peer(
    peer, op, trace, p.inputs, op.reference(p.inputs), on_gpu=False, warmup=1, iters=3, cold_l2=False
  )
  assert row.status == "passed" and row.latency_ms is not None and prepared == [1]


def test_grouped_gemm_operands_are_the_exact_values_and_scales():
  """The QArray parts tokamax's ragged_dot gets: e2m1 values by bitcast of the
  nibbles (low first) and UE8M0 bytes as bf16 powers of two, extremes included."""

  @jax.jit
  def check(x):
    b, b_scale = quant.quantize_e2m1(x)
    b_scale = b_scale.at[0, 0, 0].set(1).at[0, 0, 1].set(254)  # 2**-126 and 2**127, the extremes of the scales
    a, a_scale = quant.quantize_fp8_e4m3(x[1])
    ids = jnp.array([0, 0, 1, 2, 2], jnp.int32)
    o = peers.grouped_gemm_operands({"a": a, "a_scale": a_scale, "b": b, "b_scale": b_scale, "expert_ids": ids})
    b_deq = o["b"].astype(jnp.float32) * jnp.repeat(o["b_scale"].astype(jnp.float32), 32, axis=-1)
    a_deq = o["a"].astype(jnp.float32) * jnp.repeat(o["a_scale"].astype(jnp.float32), 32, axis=-1)
    return o, b_deq, quant.dequantize_e2m1(b, b_scale), a_deq, quant.dequantize_fp8_e4m3(a, a_scale), ids

  x = jax.random.normal(jax.random.key(1), (3, 5, 64), jnp.float32) * jnp.array([1e-30, 1.0, 1e30])[:, None, None]
  o, b_deq, b_ref, a_deq, a_ref, ids = check(x)
  assert o["b"].dtype == jnp.float4_e2m1fn and o["b"].shape == (3, 5, 64) and o["b_scale"].dtype == jnp.bfloat16
  assert jnp.array_equal(b_deq, b_ref) and jnp.array_equal(a_deq, a_ref) and jnp.array_equal(o["expert_ids"], ids)
  assert float(o["b_scale"][0, 0, 0]) == 2.0**-126 and float(o["b_scale"][0, 0, 1]) == 2.0**127


def test_tokamax_peers_only_where_it_imports(tmp_path, monkeypatch):
  monkeypatch.delitem(sys.modules, "tokamax", raising=False)
  broken = tmp_path / "broken" / "tokamax"
  broken.mkdir(parents=True)
  (broken / "__init__.py").write_text("raise ImportError('pydantic_core is compiled: not importable from a zip')\n")
  monkeypatch.syspath_prepend(str(broken.parent))
  said = []
  assert not any("tokamax" in p.name for p in peers.peers(on_gpu=True, log=said.append))
  assert said == [
    "peers: no tokamax peers: tokamax does not import: ImportError: pydantic_core is compiled: not "
    "importable from a zip"
  ]
  monkeypatch.delitem(sys.modules, "tokamax", raising=False)
  working = tmp_path / "working" / "tokamax"
  working.mkdir(parents=True)
  (working / "__init__.py").write_text("")
  monkeypatch.syspath_prepend(str(working.parent))
  on_gpu = {p.name: p for p in peers.peers(on_gpu=True)}
  assert {n for n in on_gpu if n.startswith("tokamax")} == {
    "tokamax.dot_product_attention[mosaic]",
    "tokamax.dot_product_attention[triton]",
    "tokamax.ragged_dot_general[mosaic]",
  }
  ragged = on_gpu["tokamax.ragged_dot_general[mosaic]"]
  assert ragged.prepare is not None
  assert {n for n in registry.names() if ragged.covers(n)} == {
    n for n in registry.names() if n.startswith("grouped_gemm_fp8_fp4")
  }
  assert {p.name for p in peers.peers(on_gpu=False) if p.name.startswith("tokamax")} == {
    "tokamax.dot_product_attention[xla]",
    "tokamax.ragged_dot_general[xla]",
  }
