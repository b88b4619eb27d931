"""jaxkern.peers: the libraries a user would pick instead, on the replay's own workloads."""

import dataclasses
import json

import pytest

from jaxkern import dataset, peers, plan, registry, replay, results

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
