"""QSA sparse GQA decode (SPEC 4.12): the kit's data (launches; edge cases
for the kernel in interpret mode: a tail only, n just above 512, shared
pages, unsorted and ignored ids, nothing visible, a record at CPU scale;
lowering at the largest recorded extremes; every candidate) and the family's
own checks: the traced scale, the reference against float64 NumPy, the
contract on out-of-range inputs in both paths, the heuristic's
grids, topk_ids from the indexer, the lowered path without a sort. Paged inputs:
test_qsa_index.py. (The checks themselves:
test_definitions.py and kit.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kit import EVERY_CANDIDATE, Case, TritonCall
from numerics import assert_bf16_close
from test_qsa_index import (
  GQA,
  GQA_LOWERING_AXES,
  at_cpu_scale,
  first_record,
  normal,
  page_table_for,
  records,
  sorted_widths,
)

from jaxkern import ops, registry
from jaxkern.families import qsa_sparse_gqa as gqa_fam
from pallas_kernels.qsa_sparse_gqa import triton as qg
from pallas_kernels.shared.lowering import lower_for_h100, triton_calls

GQA_SMALL = qg.QsaDecodeConfig(qg.SplitStage(block_k=4, keys_per_split=32, num_warps=4))
# Value columns in four blocks of 64, two-step splits (the B=1 heuristic's
# shape), a merge of 4 splits a step over 65 splits (ragged).
GQA_VALUE_BLOCKS = qg.QsaDecodeConfig(
  qg.SplitStage(block_k=4, keys_per_split=8, num_warps=4), block_dv=64, merge_block=4
)


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
      topk_ids[b, : len(sel)] = sel
  return dict(
    q=normal(rng, (batch, 24, 256)),
    k_cache=normal(rng, (num_pages, 64, 2, 256)),
    v_cache=normal(rng, (num_pages, 64, 2, 256)),
    page_table=page_table_for(rng, pages, max_pages, num_pages, shared),
    seq_lens=jnp.asarray(seq_lens, jnp.int32),
    topk_ids=jnp.asarray(topk_ids, jnp.int32),
    sm_scale=jnp.asarray(256**-0.5, jnp.float32),
  )


def launches(config, axes):
  """One launch: the split over (B, HKV x value blocks of block_dv columns,
  id splits of TOPK + 1 slots: the listed ids and the tail), whose last
  program per (sequence, kv head, value block) also merges."""
  split, d = config.split, axes["D"]
  value_blocks = d // min(config.block_dv, d)
  step = max(split.block_k, 1 << (-(-16 // axes["C"]) - 1).bit_length())  # >= 16 tokens per step
  per_split = max(step, min(split.keys_per_split, 1 << axes["TOPK"].bit_length()))
  return [
    TritonCall(
      "qsa_sparse_gqa_split",
      (axes["B"], axes["HKV"] * value_blocks, -(-(axes["TOPK"] + 1) // per_split)),
      split.num_warps,
      split.num_stages,
    )
  ]


def shared_pages_unsorted_and_ignored_ids():
  inputs = gqa_case((1800, 1700, 900), 29, seed=5, num_pages=40, shared=((0, 1, 20), (0, 2, 14)))
  ids = np.asarray(inputs["topk_ids"]).copy()
  ids = ids[:, np.random.default_rng(1).permutation(512)]  # any order
  free = np.flatnonzero(ids[0] == -1)[:3]
  ids[0, free] = [450, 10_000, 451]  # id n = 450 (the tail's) and ids > n: ignored
  return {**inputs, "topk_ids": jnp.asarray(ids)}


def outputs_zero(out, ref, inputs):
  np.testing.assert_array_equal(np.asarray(out["o"], np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(ref["o"], np.float32), 0.0)


KERNEL_CASES = [
  *(
    Case(GQA, inputs=lambda s=seq_lens, p=max_pages: gqa_case(s, p), config=config, id=label)
    for seq_lens, max_pages, config, label in [
      ((129,), 3, GQA_SMALL, "recorded_tiny_n32_one_token_tail"),
      ((3, 2050, 2048), 33, GQA_SMALL, "tail_only_n512_plus_tail_n512"),
      ((2055, 700, 5), 33, GQA_VALUE_BLOCKS, "value_blocks_n513_n175_tail_only"),
      ((2055, 1), 33, None, "n513_three_token_tail_and_one_token"),
    ]
  ),
  Case(GQA, inputs=shared_pages_unsorted_and_ignored_ids, config=GQA_SMALL, id="shared_pages_unsorted_ignored_ids"),
  Case(
    GQA,
    inputs=lambda: gqa_case((8, 64), 1, topk_ids=-np.ones((2, 512), np.int32)),
    config=GQA_SMALL,
    check=outputs_zero,
    id="nothing_visible",
  ),  # no ids, no tail
  at_cpu_scale(GQA, B=3, MP=555),
]
LOWERING_CASES = [Case(GQA, a, config=EVERY_CANDIDATE) for a in GQA_LOWERING_AXES]
SWEEP_CASE = Case(GQA, inputs=lambda: gqa_case((2055,), 33, seed=2), id="n513")


def test_gqa_sm_scale_is_traced():
  inputs = gqa_case((300,), 5, seed=4)
  run = jax.jit(lambda s: qg.qsa_sparse_gqa_decode(**{**inputs, "sm_scale": s}, config=GQA_SMALL, interpret=True))
  for scale in (0.02, 0.3):
    want = gqa_fam.qsa_sparse_gqa_decode_reference(**{**inputs, "sm_scale": jnp.float32(scale)})
    assert_bf16_close(run(jnp.float32(scale)), want)


# ---------------------------------------------------------------------------
# Reference vs float64 NumPy (independent, token by token).


def numpy_gqa(q, k_cache, v_cache, page_table, seq_lens, topk_ids, sm_scale):
  """The contract, token by token: L = clip(seq_len, 0, MP * 64); tokens
  t < L whose block is listed (a set) or in the tail, on a page whose table
  entry is in [0, NP)."""
  q = np.asarray(q, np.float64)
  k, v = np.asarray(k_cache, np.float64), np.asarray(v_cache, np.float64)
  table, ids = np.asarray(page_table), np.asarray(topk_ids)
  out = np.zeros(q.shape)
  for b, length in enumerate(np.clip(np.asarray(seq_lens), 0, table.shape[1] * 64)):
    selected = set(ids[b][ids[b] >= 0].tolist())
    tokens = np.array(
      [t for t in range(length) if (t // 4 in selected or t >= 4 * (length // 4)) and 0 <= table[b, t // 64] < len(k)],
      int,
    )
    if not len(tokens):
      continue
    kt, vt = k[table[b, tokens // 64], tokens % 64], v[table[b, tokens // 64], tokens % 64]
    for h in range(q.shape[1]):
      g = h // (q.shape[1] // k.shape[2])
      s = kt[:, g] @ q[b, h] * float(sm_scale)
      p = np.exp(s - s.max())
      out[b, h] = p @ vt[:, g] / p.sum()
  return out


def test_gqa_reference_matches_float64():
  inputs = gqa_case((2055, 70, 2, 2048), 33, seed=8, shared=((0, 3, 10),))
  got = np.asarray(gqa_fam.qsa_sparse_gqa_decode_reference(**inputs), np.float32)
  want = numpy_gqa(**inputs)
  assert_bf16_close(got, want)
  assert np.abs(got - want).max() <= 2**-8 * np.abs(want).max()  # one bf16 rounding


# ---------------------------------------------------------------------------
# The contract on inputs outside the definition's range: both
# paths give the contract's answer (float64 NumPy above).


def both_paths(inputs, config=GQA_SMALL):
  """(kernel in interpret mode, reference) through the public op."""
  args = [inputs[k] for k in ("q", "k_cache", "v_cache", "page_table", "seq_lens", "topk_ids")]
  return [
    ops.qsa_sparse_gqa_decode(*args, sm_scale=inputs["sm_scale"], config=config, backend=backend)
    for backend in ("pallas", "xla")
  ]


def assert_contract(inputs, config=GQA_SMALL):
  want = numpy_gqa(**inputs)
  for got in both_paths(inputs, config):
    assert_bf16_close(got, want)
  return want


def test_gqa_page_entries_outside_the_cache_contribute_nothing():
  """Entries NP, -1 and 10**6 inside the sequences: those pages' tokens are
  invisible in both paths (the kernel neither reads nor counts them)."""
  inputs = gqa_case((1800, 700), 29, seed=12, num_pages=44)
  table = np.asarray(inputs["page_table"]).copy()
  table[0, [0, 5, 28]] = [44, -1, 10**6]  # 28: the tail's page
  table[1, 2] = -3
  inputs["page_table"] = jnp.asarray(table)
  assert_contract(inputs)


def test_gqa_repeated_ids_count_once():
  """Every selected block listed up to three times, in any order, with the
  tail's id and ids past n: each block counts once, in both paths."""
  inputs = gqa_case((1000, 2055), 33, seed=13)
  ids = np.asarray(inputs["topk_ids"]).copy()
  rng = np.random.default_rng(3)
  for b, n in enumerate((250, 513)):
    chosen = rng.choice(n, 150, replace=False)
    listed = np.concatenate([chosen, chosen[:100], chosen[:60], [n, n, n + 7], -np.ones(512, int)])[:512]
    ids[b] = rng.permutation(listed)
  inputs["topk_ids"] = jnp.asarray(ids, jnp.int32)
  for config in (GQA_SMALL, GQA_VALUE_BLOCKS):
    assert_contract(inputs, config)


def test_gqa_seq_lens_beyond_the_table_are_clamped():
  """10**6 + 2 tokens on a 5-page table are its 320 (no tail past the
  table, ids >= 80 ignored); a negative length sees nothing."""
  inputs = gqa_case((320, 100), 5, seed=14, num_pages=8)
  ids = np.asarray(inputs["topk_ids"]).copy()
  ids[0, -3:] = [80, 100, 249_999]  # blocks past the table, below 10**6 // 4
  inputs["topk_ids"] = jnp.asarray(ids)
  inputs["seq_lens"] = jnp.asarray([10**6 + 2, -5], jnp.int32)
  want = assert_contract(inputs)
  assert np.abs(want[0]).max() > 0 and not want[1].any()


def test_gqa_hidden_nan_never_leaks():
  """NaN in K and V wherever a token is not visible (unselected blocks, past
  seq_len, token 0 of an unselected block 0, unreferenced pages): both paths
  stay finite and right."""
  inputs = gqa_case((700, 66), 12, seed=15, num_pages=16)
  ids = np.asarray(inputs["topk_ids"]).copy()
  ids[ids == 0] = -1  # block 0 (token 0) unselected
  inputs["topk_ids"] = jnp.asarray(ids)
  table, lengths = np.asarray(inputs["page_table"]), np.asarray(inputs["seq_lens"])
  visible = np.zeros((16, 64), bool)
  for b, length in enumerate(lengths):
    for t in range(length):
      if t // 4 in set(ids[b].tolist()) or t >= 4 * (length // 4):
        visible[table[b, t // 64], t % 64] = True
  for name in ("k_cache", "v_cache"):
    x = np.asarray(inputs[name], np.float32)
    x[~visible] = np.nan
    inputs[name] = jnp.asarray(x, jnp.bfloat16)
  for got in both_paths(inputs):
    assert np.isfinite(np.asarray(got, np.float32)).all()
  assert_contract(inputs)


def test_gqa_of_no_sequences():
  inputs = gqa_case((), 2, num_pages=3)
  for got in both_paths(inputs):
    assert got.shape == (0, 24, 256) and got.dtype == jnp.bfloat16


# ---------------------------------------------------------------------------
# Input synthesis, the public op, configs.


def test_gqa_topk_ids_come_from_the_indexer():
  op = registry.get(GQA)
  rec = first_record(GQA, B=3, MP=555)  # shared prefixes
  inputs = op.make_inputs(op.cpu_axes(rec["axes"]), seed=0, record=rec, allow_shrunk_constants=True)
  ids = np.asarray(inputs["topk_ids"])
  n = np.asarray(inputs["seq_lens"]) // 4
  for b in range(len(ids)):
    real = ids[b][ids[b] >= 0]
    assert len(real) == min(n[b], 512) and (np.diff(real) > 0).all() and real.max() < n[b]
    assert (ids[b][len(real) :] == -1).all()
  assert float(inputs["sm_scale"]) == pytest.approx(1 / 16)


@pytest.mark.parametrize("backend", ["pallas", "xla", None])  # None: XLA here (no GPU)
def test_ops_function_jits(backend):
  g = gqa_case((200, 7), 4)
  args = [g[k] for k in ("q", "k_cache", "v_cache", "page_table", "seq_lens", "topk_ids")]
  o = jax.jit(lambda *a: ops.qsa_sparse_gqa_decode(*a, backend=backend))(*args)  # default sm_scale
  assert_bf16_close(o, gqa_fam.qsa_sparse_gqa_decode_reference(**g))


def test_heuristic_fills_the_gpu_with_two_step_splits():
  """At every recorded batch size the split stage launches >= 2 programs per
  SM (264 on an H100/H200) and a split walks >= 2 steps; B=1: 33 splits x
  2 kv heads x 4 value blocks."""
  op = registry.get(GQA)
  for rec in records(GQA):
    axes = op.definition.full_axes(op.validated_axes(rec["axes"]))
    config = qg.choose_config(op.input_shapes(axes))
    grid = launches(config, axes)[0].grid
    assert np.prod(grid) >= 264 and config.split.keys_per_split // config.split.block_k >= 2, (rec["axes"], config)
    if axes["B"] == 1:
      assert grid == (1, 8, 33), config


def test_gqa_path_sorts_nothing():
  """The lowered kernel path at the largest batch has no sort or top_k: the
  repeat check runs in the split kernel."""
  op = registry.get(GQA)
  shapes = op.input_shapes(op.validated_axes(GQA_LOWERING_AXES[1]))
  kernel = lower_for_h100(lambda x: op.kernel(x, interpret=False), shapes)
  assert [c.name for c in triton_calls(kernel)] == ["qsa_sparse_gqa_split"] and sorted_widths(kernel) == []


def test_bad_configs_raise():
  with pytest.raises(ValueError, match="SplitStage.block_k=3 must be a power of two"):
    qg.SplitStage(block_k=3)
  with pytest.raises(ValueError, match="SplitStage.keys_per_split=4 must be a multiple of block_k"):
    qg.SplitStage(block_k=8, keys_per_split=4)
  with pytest.raises(ValueError, match="QsaDecodeConfig.merge_block=3 must be a power of two"):
    qg.QsaDecodeConfig(merge_block=3)
  with pytest.raises(ValueError, match="QsaDecodeConfig.block_dv=8 must be a power of two >= 16"):
    qg.QsaDecodeConfig(block_dv=8)
