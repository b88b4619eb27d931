"""Tests of the QSA decode family (SPEC 4.11, 4.12): both Pallas kernels in
interpret mode against the jnp references (edge cases: sequences shorter than
one block, n < 512 with the -1 suffix, n just above 512, shared pages,
several sequences), the references against float64 NumPy, input synthesis
(determinism, page-table structure, topk_ids from the indexer), and
deviceless H100 lowering of every candidate config at the largest recorded
sizes."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import compare
from jaxkern import ops
from jaxkern import registry
from jaxkern.families import qsa_index as fam
from jaxkern.families import qsa_sparse_gqa as gqa_fam
from pallas_kernels import qsa_index as qi
from pallas_kernels import qsa_sparse_gqa as qg
from pallas_kernels.common import assert_lowers_to_triton
from numerics import assert_bf16_close

INDEX = "qsa_index_topk_decode_qwen38_h4_d128_topk512_c4"
GQA = "qsa_sparse_gqa_decode_qwen38_h24_kv2_d256_topk512_c4"
DATASETS = os.path.join(os.path.dirname(__file__), os.pardir, "datasets", "workloads")

# Small tilings so that interpret-mode tests have several steps and programs.
INDEX_SMALL = qi.QsaIndexConfig(qi.ScoreStage(block_keys=32, chunk_keys=128), qi.SelectStage("top_k"))
INDEX_SORT = qi.QsaIndexConfig(qi.ScoreStage(block_keys=16, chunk_keys=64), qi.SelectStage("sort"))
GQA_SMALL = qg.QsaDecodeConfig(qg.SplitStage(block_k=4, keys_per_split=32, num_warps=4), qg.CombineStage(block_d=64))


def records(name):
  with open(os.path.join(DATASETS, f"{name}.jsonl")) as f:
    return [json.loads(line) for line in f]


def first_record(name, **axes):
  return next(r for r in records(name) if all(r["axes"][k] == v for k, v in axes.items()))


def normal(rng, shape):
  return jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)


def page_table_for(rng, pages, max_pages, num_pages, shared=()):
  """Random private pages; `shared` = ((i, j, count), ...): sequence j reuses
  sequence i's first `count` pages."""
  perm = iter(rng.permutation(num_pages))
  table = np.zeros((len(pages), max_pages), np.int32)
  reuse = {j: (i, count) for i, j, count in shared}
  for b, p in enumerate(pages):
    i, count = reuse.get(b, (b, 0))
    table[b, :count] = table[i, :count]
    table[b, count:p] = [next(perm) for _ in range(count, p)]
  return jnp.asarray(table)


def index_case(seq_lens, max_pages, seed=0, num_pages=None, shared=()):
  rng = np.random.default_rng(seed)
  seq_lens = np.asarray(seq_lens)
  pages = -(-(seq_lens // 4) // 16)
  num_pages = num_pages or int(pages.sum()) + 1
  return dict(q=normal(rng, (len(seq_lens), 4, 128)), index_k=normal(rng, (num_pages, 16, 1, 128)),
              page_table=page_table_for(rng, pages, max_pages, num_pages, shared),
              seq_lens=jnp.asarray(seq_lens, jnp.int32))


def assert_topk_ok(ids, expected, inputs):
  """Exact, or tie-accepted per SPEC 5 (scores from the reference)."""
  scores = np.asarray(fam.index_topk_scores(inputs))
  exact, tie = compare.check_topk_rows(np.asarray(ids), np.asarray(expected), scores, 2e-5, 1e-4)
  assert (exact | tie).all(), (np.asarray(ids), np.asarray(expected))


# ---------------------------------------------------------------------------
# Index top-k: kernel (interpret mode) vs reference.

@pytest.mark.parametrize("seq_lens,max_pages,config", [
    ((129,), 2, INDEX_SMALL),                 # a recorded tiny case: n = 32 < 512
    ((3, 2049, 2051 + 64 * 3), 36, INDEX_SMALL),  # no block; n = 512; n = 560
    ((2052, 2055, 7), 33, INDEX_SORT),        # n = 513 (just above), n = 513, n = 1
    ((4 * 16 * 40 + 3,), 40, None),           # the heuristic config, n = 640
])
def test_index_kernel_matches_reference(seq_lens, max_pages, config):
  inputs = index_case(seq_lens, max_pages)
  got = qi.qsa_index_topk(**inputs, config=config, interpret=True)
  want = fam.qsa_index_topk_reference(**inputs)
  assert got.shape == (len(seq_lens), 512) and got.dtype == jnp.int32
  assert_topk_ok(got, want, inputs)
  n = np.asarray(inputs["seq_lens"]) // 4
  assert ((np.asarray(got) == -1).sum(1) == np.maximum(512 - n, 0)).all()


def test_index_scores_match_reference_with_shared_pages():
  # Three sequences; the second and third share the first's first 20 pages.
  inputs = index_case((2600, 1500, 2300), 41, seed=3, num_pages=70, shared=((0, 1, 20), (0, 2, 20)))
  got = qi.index_scores(**inputs, compress=4, score=INDEX_SMALL.score, min_width=512, interpret=True)
  want = fam.qsa_index_scores(**inputs)
  width = want.shape[1]
  assert got.shape[1] >= max(width, 512) and np.isneginf(np.asarray(got[:, width:])).all()
  np.testing.assert_allclose(np.asarray(got[:, :width]), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert_topk_ok(qi.qsa_index_topk(**inputs, config=INDEX_SMALL, interpret=True),
                 fam.qsa_index_topk_reference(**inputs), inputs)


def test_index_ties_go_to_the_lower_id():
  inputs = index_case((4 * 700, 4 * 100), 44)
  inputs["q"] = jnp.zeros_like(inputs["q"])  # every score is 0
  want = np.concatenate([np.arange(512)[None], np.r_[np.arange(100), -np.ones(412, int)][None]])
  for config in (INDEX_SMALL, INDEX_SORT):
    np.testing.assert_array_equal(qi.qsa_index_topk(**inputs, config=config, interpret=True), want)
  np.testing.assert_array_equal(fam.qsa_index_topk_reference(**inputs), want)


def test_index_no_complete_block_selects_nothing():
  inputs = index_case((1, 2, 3), 1)
  np.testing.assert_array_equal(qi.qsa_index_topk(**inputs, config=INDEX_SMALL, interpret=True),
                                -np.ones((3, 512)))
  np.testing.assert_array_equal(fam.qsa_index_topk_reference(**inputs), -np.ones((3, 512)))


# ---------------------------------------------------------------------------
# Sparse GQA decode: kernel (interpret mode) vs reference.

def gqa_case(seq_lens, max_pages, seed=0, num_pages=None, shared=(), topk_ids=None):
  rng = np.random.default_rng(seed)
  seq_lens = np.asarray(seq_lens)
  pages = -(-seq_lens // 64)
  num_pages = num_pages or int(pages.sum()) + 1
  batch = len(seq_lens)
  if topk_ids is None:  # a random sorted selection, -1 suffix
    topk_ids = -np.ones((batch, 512), np.int32)
    for b, n in enumerate(seq_lens // 4):
      sel = np.sort(rng.permutation(n)[:512])
      topk_ids[b, :len(sel)] = sel
  return dict(q=normal(rng, (batch, 24, 256)), k_cache=normal(rng, (num_pages, 64, 2, 256)),
              v_cache=normal(rng, (num_pages, 64, 2, 256)),
              page_table=page_table_for(rng, pages, max_pages, num_pages, shared),
              seq_lens=jnp.asarray(seq_lens, jnp.int32), topk_ids=jnp.asarray(topk_ids, jnp.int32),
              sm_scale=jnp.asarray(256 ** -0.5, jnp.float32))


@pytest.mark.parametrize("seq_lens,max_pages,config", [
    ((129,), 3, GQA_SMALL),               # recorded tiny case: n = 32, 1-token tail
    ((3, 2050, 2048), 33, GQA_SMALL),     # tail only; n = 512 + tail; n = 512, no tail
    ((2055, 1), 33, None),                # n = 513 (just above 512), 3-token tail; 1 token
])
def test_gqa_kernel_matches_reference(seq_lens, max_pages, config):
  inputs = gqa_case(seq_lens, max_pages)
  got = qg.qsa_sparse_gqa_decode(**inputs, config=config, interpret=True)
  assert got.shape == (len(seq_lens), 24, 256) and got.dtype == jnp.bfloat16
  assert_bf16_close(got, gqa_fam.qsa_sparse_gqa_decode_reference(**inputs))


def test_gqa_shared_pages_unsorted_ids_and_ignored_ids():
  inputs = gqa_case((1800, 1700, 900), 29, seed=5, num_pages=40, shared=((0, 1, 20), (0, 2, 14)))
  ids = np.asarray(inputs["topk_ids"]).copy()
  rng = np.random.default_rng(1)
  ids = ids[:, rng.permutation(512)]          # any order
  free = np.flatnonzero(ids[0] == -1)[:3]
  ids[0, free] = [450, 10_000, 451]  # id n = 450 (the tail's) and ids > n: ignored
  inputs["topk_ids"] = jnp.asarray(ids)
  got = qg.qsa_sparse_gqa_decode(**inputs, config=GQA_SMALL, interpret=True)
  assert_bf16_close(got, gqa_fam.qsa_sparse_gqa_decode_reference(**inputs))


def test_gqa_nothing_visible_outputs_zero():
  inputs = gqa_case((8, 64), 1, topk_ids=-np.ones((2, 512), np.int32))  # no ids, no tail
  got = qg.qsa_sparse_gqa_decode(**inputs, config=GQA_SMALL, interpret=True)
  np.testing.assert_array_equal(np.asarray(got, np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(gqa_fam.qsa_sparse_gqa_decode_reference(**inputs), np.float32), 0.0)


def test_gqa_every_candidate_config_in_interpret_mode():
  inputs = gqa_case((2055,), 33, seed=2)
  want = gqa_fam.qsa_sparse_gqa_decode_reference(**inputs)
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in inputs.items()}
  for config in qg.candidate_configs(shapes):
    assert_bf16_close(qg.qsa_sparse_gqa_decode(**inputs, config=config, interpret=True), want)


def test_gqa_sm_scale_is_traced():
  inputs = gqa_case((300,), 5, seed=4)
  run = jax.jit(lambda s: qg.qsa_sparse_gqa_decode(**{**inputs, "sm_scale": s}, config=GQA_SMALL,
                                                   interpret=True))
  for scale in (0.02, 0.3):
    want = gqa_fam.qsa_sparse_gqa_decode_reference(**{**inputs, "sm_scale": jnp.float32(scale)})
    assert_bf16_close(run(jnp.float32(scale)), want)


# ---------------------------------------------------------------------------
# References vs float64 NumPy (independent, token by token).

def numpy_index_topk(q, index_k, page_table, seq_lens):
  q, k = np.asarray(q, np.float64), np.asarray(index_k, np.float64)[:, :, 0]
  table = np.asarray(page_table)
  out = -np.ones((len(q), 512), np.int64)
  for b, length in enumerate(np.asarray(seq_lens)):
    j = np.arange(length // 4)
    keys = k[table[b, j // 16], j % 16]
    scores = np.maximum(keys @ q[b].T, 0.0).sum(1) / np.sqrt(128)
    order = np.argsort(-scores, kind="stable")[:512]  # ties: lower id first
    out[b, :len(order)] = np.sort(order)
  return out


def numpy_gqa(q, k_cache, v_cache, page_table, seq_lens, topk_ids, sm_scale):
  q = np.asarray(q, np.float64)
  k, v = np.asarray(k_cache, np.float64), np.asarray(v_cache, np.float64)
  table, ids = np.asarray(page_table), np.asarray(topk_ids)
  out = np.zeros(q.shape)
  for b, length in enumerate(np.asarray(seq_lens)):
    selected = set(ids[b][ids[b] >= 0].tolist())
    tokens = np.array([t for t in range(length) if t // 4 in selected or t >= 4 * (length // 4)], int)
    if not len(tokens):
      continue
    kt, vt = k[table[b, tokens // 64], tokens % 64], v[table[b, tokens // 64], tokens % 64]
    for h in range(q.shape[1]):
      g = h // (q.shape[1] // k.shape[2])
      s = kt[:, g] @ q[b, h] * float(sm_scale)
      p = np.exp(s - s.max())
      out[b, h] = p @ vt[:, g] / p.sum()
  return out


def test_index_reference_matches_float64():
  inputs = index_case((2055, 600, 2, 2049), 33, seed=7, shared=((0, 1, 5),))
  np.testing.assert_array_equal(fam.qsa_index_topk_reference(**inputs), numpy_index_topk(**inputs))


def test_gqa_reference_matches_float64():
  inputs = gqa_case((2055, 70, 2, 2048), 33, seed=8, shared=((0, 3, 10),))
  got = np.asarray(gqa_fam.qsa_sparse_gqa_decode_reference(**inputs), np.float32)
  want = numpy_gqa(**inputs)
  assert_bf16_close(got, want)
  assert np.abs(got - want).max() <= 2 ** -8 * np.abs(want).max()  # one bf16 rounding


# ---------------------------------------------------------------------------
# Input synthesis.

def test_shared_prefix_page_table_uses_exactly_np_pages():
  rng = np.random.default_rng(0)
  pages = np.array([554, 548, 552])       # the recorded B=3, MP=554, NP=580 case
  table = fam.shared_prefix_page_table(pages, 554, 580, rng)
  used = np.concatenate([table[b, :p] for b, p in enumerate(pages)])
  assert len(np.unique(used)) == 580 and used.max() < 580
  for b, p in enumerate(pages):
    assert len(np.unique(table[b, :p])) == p
    shared = np.flatnonzero(table[b, :p] != table[0, :p])
    assert b == 0 or shared.size == 0 or (table[b, :shared[0]] == table[0, :shared[0]]).all()
  # Enough pages: all private, the rest unreferenced.
  table = fam.shared_prefix_page_table(np.array([3, 0, 2]), 4, 9, rng)
  assert len(np.unique(np.concatenate([table[0, :3], table[2, :2]]))) == 5


@pytest.mark.parametrize("name,pages_of", [
    (INDEX, lambda L: -(-(L // 4) // 16)), (GQA, lambda L: -(-L // 64))])
def test_structure_from_records(name, pages_of):
  """Every recorded workload at its own axes and at CPU scale: the recorded
  lengths (rescaled keeping residues mod 4), the longest filling MP pages,
  exactly min(NP, pages needed) distinct physical pages."""
  op = registry.get(name)
  for rec in records(name):
    recorded_axes = op.validated_axes(rec["axes"])
    for axes in (recorded_axes, op.cpu_axes(rec["axes"])):
      table, lengths = map(np.asarray, fam.paged_structure(axes, jax.random.key(0), rec, index=name == INDEX))
      pages = pages_of(lengths)
      assert table.shape == (axes["B"], axes["MP"]) and pages.max() == axes["MP"]
      recorded = np.resize(rec["scheduler_sequence_lengths"], len(lengths))
      if axes is recorded_axes:
        np.testing.assert_array_equal(lengths, recorded)
      np.testing.assert_array_equal(lengths % 4, recorded % 4)
      used = np.unique(np.concatenate([table[b, :p] for b, p in enumerate(pages)]))
      assert used.min() >= 0 and used.max() < axes["NP"]
      assert len(used) == min(axes["NP"], pages.sum())


def test_gqa_topk_ids_come_from_the_indexer():
  op = registry.get(GQA)
  rec = first_record(GQA, B=3, MP=555)  # shared prefixes
  inputs = op.make_inputs(op.cpu_axes(rec["axes"]), seed=0, record=rec, allow_shrunk_constants=True)
  ids = np.asarray(inputs["topk_ids"])
  n = np.asarray(inputs["seq_lens"]) // 4
  for b in range(len(ids)):
    real = ids[b][ids[b] >= 0]
    assert len(real) == min(n[b], 512) and (np.diff(real) > 0).all() and real.max() < n[b]
    assert (ids[b][len(real):] == -1).all()
  assert float(inputs["sm_scale"]) == pytest.approx(1 / 16)


def test_cpu_axes_keep_structure():
  op = registry.get(INDEX)
  small = op.cpu_axes(dict(B=23, MP=517, NP=1550))
  assert small["B"] == 4 and small["MP"] == 40 and small["MP"] <= small["NP"] and small["TOPK"] == 512
  assert op.cpu_axes(dict(B=1, MP=2, NP=2))["MP"] == 2
  # Prefix sharing survives: B=3, MP=554, NP=580 keeps NP far below B * MP.
  shared = op.cpu_axes(dict(B=3, MP=554, NP=580))
  assert shared["MP"] <= shared["NP"] < 2 * shared["MP"]


@pytest.mark.parametrize("name,axes", [(INDEX, dict(B=1, MP=2)), (INDEX, dict(B=23, MP=516)),
                                       (GQA, dict(B=3, MP=555))])
def test_definition_at_cpu_scale(name, axes):
  op = registry.get(name)
  rec = first_record(name, **axes)
  inputs = op.make_inputs(op.cpu_axes(rec["axes"]), seed=0, record=rec, allow_shrunk_constants=True)
  result = op.compare(op.kernel(inputs, interpret=True), op.reference(inputs), inputs=inputs)
  assert result.passed, result.to_json()


@pytest.mark.parametrize("backend", ["pallas", "xla", None])  # None: XLA here (no GPU)
def test_ops_functions_jit(backend):
  inputs = index_case((2100, 30), 33)
  ids = jax.jit(lambda *a: ops.qsa_index_topk(*a, backend=backend))(*inputs.values())
  assert_topk_ok(ids, fam.qsa_index_topk_reference(**inputs), inputs)
  g = gqa_case((200, 7), 4)
  args = [g[k] for k in ("q", "k_cache", "v_cache", "page_table", "seq_lens", "topk_ids")]
  o = jax.jit(lambda *a: ops.qsa_sparse_gqa_decode(*a, backend=backend))(*args)  # default sm_scale
  assert_bf16_close(o, gqa_fam.qsa_sparse_gqa_decode_reference(**g))


def test_bad_configs_raise():
  with pytest.raises(ValueError):
    qi.ScoreStage(block_keys=24)
  with pytest.raises(ValueError):
    qi.ScoreStage(block_keys=256, chunk_keys=128)
  with pytest.raises(ValueError):
    qi.SelectStage("radix")
  with pytest.raises(ValueError, match="SplitStage.block_k=3 must be a power of two"):
    qg.SplitStage(block_k=3)
  with pytest.raises(ValueError, match="SplitStage.keys_per_split=4 must be a multiple of block_k"):
    qg.SplitStage(block_k=8, keys_per_split=4)
  with pytest.raises(ValueError):
    qg.CombineStage(block_d=8)


# ---------------------------------------------------------------------------
# Deviceless lowering for an H100 at the largest recorded sizes.

INDEX_LOWERING_AXES = [dict(B=1, MP=3895, NP=3895), dict(B=23, MP=517, NP=1550), dict(B=3, MP=555, NP=583)]
GQA_LOWERING_AXES = [dict(B=1, MP=3895, NP=3895), dict(B=23, MP=517, NP=1550)]


def test_recorded_axes_are_covered():
  for name, covered in ((INDEX, INDEX_LOWERING_AXES), (GQA, GQA_LOWERING_AXES)):
    recorded = [r["axes"] for r in records(name)]
    assert max(a["MP"] for a in recorded) <= max(a["MP"] for a in covered)
    assert max(a["B"] for a in recorded) <= max(a["B"] for a in covered)
    assert max(a["NP"] for a in recorded) <= max(a["NP"] for a in covered)


@pytest.mark.parametrize("name,axes", [(INDEX, a) for a in INDEX_LOWERING_AXES] +
                         [(GQA, a) for a in GQA_LOWERING_AXES])
def test_lowers_for_h100_with_every_candidate_config(name, axes):
  op = registry.get(name)
  shapes = op.input_shapes(axes)
  launcher = qi.qsa_index_topk if name == INDEX else qg.qsa_sparse_gqa_decode
  configs = op.candidate_configs(shapes)
  assert configs[0] == op.choose_config(shapes) and len(configs) == len(set(configs))
  for config in configs:
    def run(*args, config=config):
      return launcher(**dict(zip(shapes, args)), config=config, interpret=False)
    txt = assert_lowers_to_triton(run, *shapes.values())
    assert txt.count("__gpu$xla.gpu.triton") >= 1
