"""QSA indexer decode (SPEC 4.11): the kit's data (launches; edge cases for
the kernel in interpret mode: sequences shorter than one block, n < 512 with
the -1 suffix, n just above 512, several sequences, selection chunks finer
and coarser than the score chunks, records at CPU scale; lowering at the
largest recorded extremes) and the family's own checks: the stage-1 scores
with shared pages, ties, the radix selection against a stable sort, the
lowered index path free of wide sorts, the reference against float64 NumPy,
the contract on out-of-range inputs in both paths, the paged
input synthesis shared with test_qsa_sparse_gqa.py. (The checks themselves:
test_definitions.py and kit.py.)"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kit import EVERY_CANDIDATE, Case, TritonCall

from jaxkern import compare, ops, registry
from jaxkern.families import qsa_index as fam
from pallas_kernels.qsa_index import triton as qi
from pallas_kernels.shared import radix_select
from pallas_kernels.shared.lowering import lower_for_h100, triton_calls

INDEX = "qsa_index_topk_decode_qwen38_h4_d128_topk512_c4"
GQA = "qsa_sparse_gqa_decode_qwen38_h24_kv2_d256_topk512_c4"
DATASETS = os.path.join(os.path.dirname(__file__), os.pardir, "datasets", "workloads")

# Small tilings so that interpret-mode tests have several steps and programs.
INDEX_SMALL = qi.QsaIndexConfig(qi.ScoreStage(block_keys=32, chunk_keys=128), qi.SelectStage(32, 128))
# The selection's chunks smaller, resp. larger, than the score stage's.
INDEX_FINE = qi.QsaIndexConfig(qi.ScoreStage(block_keys=16, chunk_keys=64), qi.SelectStage(16, 32))
INDEX_COARSE = qi.QsaIndexConfig(qi.ScoreStage(block_keys=16, chunk_keys=64), qi.SelectStage(64, 256))


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
  return dict(
    q=normal(rng, (len(seq_lens), 4, 128)),
    index_k=normal(rng, (num_pages, 16, 1, 128)),
    page_table=page_table_for(rng, pages, max_pages, num_pages, shared),
    seq_lens=jnp.asarray(seq_lens, jnp.int32),
  )


def assert_topk_ok(ids, expected, inputs):
  """Exact, or tie-accepted per SPEC 5 (scores from the reference)."""
  scores = np.asarray(fam.index_topk_scores(inputs))
  exact, tie = compare.check_topk_rows(np.asarray(ids), np.asarray(expected), scores, 2e-5, 1e-4)
  assert (exact | tie).all(), (np.asarray(ids), np.asarray(expected))


def launches(config, axes):
  """Stage 1 over (sequences, score chunks of the page table's ids), then the
  radix selection's second digit histogram and its write pass over
  (sequences, selection chunks); both stages' blocks fitted to the ids, the
  selection's chunks widened to at most 64 a padded row."""
  ids = axes["MP"] * axes["P"]
  pow2 = lambda n: 1 << max(n - 1, 0).bit_length()
  score, select = config.score, config.select
  score_block = max(16, pow2(axes["P"]), min(score.block_keys, pow2(ids)))
  score_chunk = max(score_block, min(score.chunk_keys, pow2(ids)))
  select_block = max(16, min(select.block_keys, pow2(ids)))
  select_chunk = max(select_block, min(select.chunk_keys, pow2(ids)), pow2(-(-ids // 64)))
  width = lambda: -(-ids // max(score_chunk, select_chunk)) * max(score_chunk, select_chunk)
  while width() // select_chunk > 64:
    select_chunk *= 2
  return [
    TritonCall("qsa_index_scores", (axes["B"], width() // score_chunk, 1), score.num_warps, score.num_stages),
    *(
      TritonCall(name, (axes["B"], width() // select_chunk, 1), select.num_warps, select.num_stages)
      for name in ("qsa_index_hist1", "qsa_index_write")
    ),
  ]


def minus_one_suffix(out, ref, inputs):
  """Exactly max(512 - n, 0) empty slots per sequence (n complete blocks)."""
  n = np.asarray(inputs["seq_lens"]) // 4
  assert ((np.asarray(out["topk_ids"]) == -1).sum(1) == np.maximum(512 - n, 0)).all()


def at_cpu_scale(name, **axes):
  """A recorded workload shrunk by cpu_axes, with its record."""
  rec = first_record(name, **axes)
  return Case(
    name,
    registry.get(name).cpu_axes(rec["axes"]),
    record=rec,
    id="record_" + "_".join(f"{k}{v}" for k, v in axes.items()),
  )


KERNEL_CASES = [
  *(
    Case(
      INDEX, inputs=lambda s=seq_lens, p=max_pages: index_case(s, p), config=config, check=minus_one_suffix, id=label
    )
    for seq_lens, max_pages, config, label in [
      ((129,), 2, INDEX_SMALL, "recorded_tiny_n32"),
      ((3, 2049, 2051 + 64 * 3), 36, INDEX_SMALL, "no_block_n512_n560"),
      ((2052, 2055, 7), 33, INDEX_FINE, "n513_n513_n1_fine_select"),
      ((4 * 16 * 40 + 3, 2100), 40, INDEX_COARSE, "n640_n525_coarse_select"),
      ((4 * 16 * 40 + 3,), 40, None, "heuristic_n640"),
    ]
  ),
  at_cpu_scale(INDEX, B=1, MP=2),
  at_cpu_scale(INDEX, B=23, MP=516),
]
# The largest recorded extremes, where every candidate is lowered.
INDEX_LOWERING_AXES = [dict(B=1, MP=3895, NP=3895), dict(B=23, MP=517, NP=1550), dict(B=3, MP=555, NP=583)]
GQA_LOWERING_AXES = [dict(B=1, MP=3895, NP=3895), dict(B=23, MP=517, NP=1550)]


LOWERING_CASES = [Case(INDEX, a, config=EVERY_CANDIDATE) for a in INDEX_LOWERING_AXES]


def test_lowering_axes_cover_the_recorded_extremes():
  for name, covered in ((INDEX, INDEX_LOWERING_AXES), (GQA, GQA_LOWERING_AXES)):
    recorded = [r["axes"] for r in records(name)]
    assert max(a["MP"] for a in recorded) <= max(a["MP"] for a in covered)
    assert max(a["B"] for a in recorded) <= max(a["B"] for a in covered)
    assert max(a["NP"] for a in recorded) <= max(a["NP"] for a in covered)


# ---------------------------------------------------------------------------
# The family's own kernel checks.


def test_index_scores_match_reference_with_shared_pages():
  # Three sequences; the second and third share the first's first 20 pages.
  inputs = index_case((2600, 1500, 2300), 41, seed=3, num_pages=70, shared=((0, 1, 20), (0, 2, 20)))
  config = qi._fit(INDEX_SMALL, 41 * 16, 16)
  got, totals = qi.index_scores(**inputs, compress=4, config=config, interpret=True)
  want = fam.qsa_index_scores(**inputs)
  width = want.shape[1]
  assert got.shape[1] >= width and np.isneginf(np.asarray(got[:, width:])).all()
  # The first digit's counts: every candidate, once; the other digits' zero.
  totals = np.asarray(totals)
  np.testing.assert_array_equal(totals[:, 0].sum(axis=(1, 2)), np.isfinite(np.asarray(want)).sum(1))
  assert not totals[:, 1:].any()
  np.testing.assert_allclose(np.asarray(got[:, :width]), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert_topk_ok(
    qi.qsa_index_topk(**inputs, config=INDEX_SMALL, interpret=True), fam.qsa_index_topk_reference(**inputs), inputs
  )


def test_index_ties_go_to_the_lower_id():
  inputs = index_case((4 * 700, 4 * 100), 44)
  inputs["q"] = jnp.zeros_like(inputs["q"])  # every score is 0
  want = np.concatenate([np.arange(512)[None], np.r_[np.arange(100), -np.ones(412, int)][None]])
  for config in (INDEX_SMALL, INDEX_FINE, INDEX_COARSE):
    np.testing.assert_array_equal(qi.qsa_index_topk(**inputs, config=config, interpret=True), want)
  np.testing.assert_array_equal(fam.qsa_index_topk_reference(**inputs), want)


def test_index_no_complete_block_selects_nothing():
  inputs = index_case((1, 2, 3), 1)
  np.testing.assert_array_equal(qi.qsa_index_topk(**inputs, config=INDEX_SMALL, interpret=True), -np.ones((3, 512)))
  np.testing.assert_array_equal(fam.qsa_index_topk_reference(**inputs), -np.ones((3, 512)))


# ---------------------------------------------------------------------------
# The radix selection on its own: any scores, against a stable sort.


def numpy_select(scores, topk):
  """The ids of the topk largest non -inf scores in XLA TopK's total order
  of floats (-inf < -0 < +0 < inf < NaN, every NaN taken as +NaN whatever
  its sign bit), ties to the lower id, ascending."""
  out = -np.ones((len(scores), topk), np.int64)
  for b, row in enumerate(np.asarray(scores, np.float32)):
    row = np.where(np.isnan(row), np.float32(np.nan), row)  # one NaN, sign bit clear
    bits = row.view(np.int32).astype(np.int64)
    key = np.where(bits < 0, ~bits & 0xFFFFFFFF, bits | 0x80000000)
    candidates = np.flatnonzero(~np.isneginf(row))
    best = candidates[np.argsort(-key[candidates], kind="stable")][:topk]
    out[b, : len(best)] = np.sort(best)
  return out


def select_rows(width=700, seed=0):
  rng = np.random.default_rng(seed)
  rows = [
    rng.standard_normal(width),
    np.round(rng.standard_normal(width), 1),
    np.zeros(width),
    np.abs(rng.standard_normal(width)),
  ]
  sparse = rng.standard_normal(width)
  sparse[::3] = -np.inf
  few = np.full(width, -np.inf)
  few[5:50] = 1.0  # 45 candidates, all tied
  special = rng.standard_normal(width)
  special[[3, 9]], special[4], special[31] = np.nan, -np.nan, np.inf
  special[10:20], special[20:30] = 0.0, -0.0
  rows += [sparse, few, np.full(width, -np.inf), special]
  return jnp.asarray(np.stack(rows).astype(np.float32))


@pytest.mark.parametrize(
  "topk,stage", [(512, qi.SelectStage(32, 128)), (100, qi.SelectStage(16, 64)), (512, qi.SelectStage(256, 1024))]
)
def test_radix_select_is_a_stable_total_order_top_k(topk, stage):
  """Random rows, many ties, all equal, non-candidates (-inf), fewer
  candidates than topk, none, NaN of both signs, +-0, +inf; a topk that is
  no power of two."""
  scores = select_rows()
  got = radix_select.select_topk(
    scores, topk=topk, stage=radix_select.fit_stage(stage, scores.shape[1]), interpret=True
  )
  np.testing.assert_array_equal(got, numpy_select(scores, topk))


def test_radix_select_of_no_rows():
  assert radix_select.select_topk(jnp.zeros((0, 64)), topk=8, stage=qi.SelectStage()).shape == (0, 8)


_SORTING = re.compile(r"stablehlo\.sort|chlo\.top_k|ApproxTopK|@TopK")
_IR = re.compile(r'\bir = "(?:[^"\\]|\\.)*"')  # a Triton call's serialized kernel


def sorted_widths(stablehlo: str) -> list[int]:
  """The row width (last dimension of the first operand) of every sort and
  top-k of a lowered module."""
  text = _IR.sub("", stablehlo)
  widths = []
  for match in _SORTING.finditer(text):
    # A sort's operand types follow its comparator region; a top_k's its call.
    signature = re.compile(r"\) : \(?tensor<((?:\d+x)+)").search(text, match.end())
    widths.append(int(signature.group(1).rstrip("x").split("x")[-1]))
  return widths


@pytest.mark.parametrize("axes", INDEX_LOWERING_AXES[:2], ids=["B1_MP3895", "B23_MP517"])
def test_index_path_sorts_no_wide_row(axes):
  """The lowered kernel path (scores, selection, glue) has no sort or top_k
  over more than 4096 elements a row; the reference's top_k over the whole
  row shows the check sees one."""
  op = registry.get(INDEX)
  shapes = op.input_shapes(op.validated_axes(axes))
  kernel = lower_for_h100(lambda x: op.kernel(x, interpret=False), shapes)
  assert triton_calls(kernel) and all(w <= 4096 for w in sorted_widths(kernel)), sorted_widths(kernel)
  reference = lower_for_h100(lambda x: fam.qsa_index_topk_reference(**x), shapes)
  assert max(sorted_widths(reference)) == axes["MP"] * 16


# ---------------------------------------------------------------------------
# Reference vs float64 NumPy (independent, token by token).


def numpy_index_topk(q, index_k, page_table, seq_lens):
  """The contract, id by id: candidates are the ids j < n = clip(L // 4, 0,
  MP * 16) whose page-table entry is in [0, NP)."""
  q, k = np.asarray(q, np.float64), np.asarray(index_k, np.float64)[:, :, 0]
  table = np.asarray(page_table)
  out = -np.ones((len(q), 512), np.int64)
  for b, length in enumerate(np.asarray(seq_lens)):
    j = np.arange(np.clip(length // 4, 0, table.shape[1] * 16))
    j = j[(table[b, j // 16] >= 0) & (table[b, j // 16] < len(k))]
    keys = k[table[b, j // 16], j % 16]
    scores = np.maximum(keys @ q[b].T, 0.0).sum(1) / np.sqrt(128)
    order = j[np.argsort(-scores, kind="stable")[:512]]  # ties: lower id first
    out[b, : len(order)] = np.sort(order)
  return out


def test_index_reference_matches_float64():
  inputs = index_case((2055, 600, 2, 2049), 33, seed=7, shared=((0, 1, 5),))
  np.testing.assert_array_equal(fam.qsa_index_topk_reference(**inputs), numpy_index_topk(**inputs))


# ---------------------------------------------------------------------------
# The contract on inputs outside the definition's range: both
# paths give the contract's answer (float64 NumPy above).


def both_paths(inputs):
  """(kernel in interpret mode, reference) through the public op."""
  run = lambda backend: np.asarray(ops.qsa_index_topk(*inputs.values(), config=INDEX_SMALL, backend=backend))
  return run("pallas"), run("xla")


def test_index_seq_lens_beyond_the_table_are_clamped():
  """10**6 tokens on a 5-page table: its 80 ids, not ids past the table; a
  negative length selects nothing."""
  inputs = index_case((4 * 80, 100), 5, num_pages=8)
  inputs["seq_lens"] = jnp.asarray([10**6, -7], jnp.int32)
  want = np.full((2, 512), -1)
  want[0, :80] = np.arange(80)
  for got in both_paths(inputs):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(numpy_index_topk(**inputs), want)


def test_index_absent_pages_hold_no_candidates():
  """Page-table entries outside [0, NP) (NP, -1, 10**6) inside n: their ids
  are never selected, by either path, and NaN keys elsewhere in the cache
  (on no candidate's page) change nothing."""
  inputs = index_case((4 * 16 * 40, 4 * 16 * 12 + 8), 40, seed=11, num_pages=60)
  table = np.asarray(inputs["page_table"]).copy()
  table[0, [3, 17, 39]] = [60, -1, 10**6]
  table[1, [0, 11]] = [-5, 60]
  inputs["page_table"] = jnp.asarray(table)
  used = np.unique(table[(table >= 0) & (table < 60)])
  unused = np.setdiff1d(np.arange(60), used)
  index_k = np.asarray(inputs["index_k"], np.float32)
  index_k[unused] = np.nan
  inputs["index_k"] = jnp.asarray(index_k, jnp.bfloat16)
  want = numpy_index_topk(**inputs)
  assert (want[1] == -1).sum() == 512 - (12 * 16 + 2 - 16 - 16)  # fewer candidates: a longer -1 suffix
  for got in both_paths(inputs):
    assert_topk_ok(got, want, inputs)
    assert not np.isin(got[0], [*range(3 * 16, 4 * 16), *range(17 * 16, 18 * 16), *range(39 * 16, 40 * 16)]).any()


def test_index_nan_scores_rank_first():
  """A NaN key makes its id's score NaN: selected first; NaN queries make
  every score NaN: all tie, the lowest ids win. Both paths."""
  inputs = index_case((4 * 700, 4 * 600), 44, seed=16)
  index_k = np.asarray(inputs["index_k"], np.float32)
  table = np.asarray(inputs["page_table"])
  index_k[table[0, 650 // 16], 650 % 16, 0, 5] = np.nan
  q = np.asarray(inputs["q"], np.float32)
  q[1, 2, 7] = np.nan
  inputs.update(index_k=jnp.asarray(index_k, jnp.bfloat16), q=jnp.asarray(q, jnp.bfloat16))
  for got in both_paths(inputs):
    assert 650 in got[0]
    np.testing.assert_array_equal(got[1], np.arange(512))


def test_index_of_no_sequences():
  inputs = index_case((), 3, num_pages=4)
  for got in both_paths(inputs):
    assert got.shape == (0, 512) and got.dtype == np.int32


# ---------------------------------------------------------------------------
# Input synthesis (shared by both QSA definitions), the public op, configs.


def test_shared_prefix_page_table_uses_exactly_np_pages():
  rng = np.random.default_rng(0)
  pages = np.array([554, 548, 552])  # the recorded B=3, MP=554, NP=580 case
  table = fam.shared_prefix_page_table(pages, 554, 580, rng)
  used = np.concatenate([table[b, :p] for b, p in enumerate(pages)])
  assert len(np.unique(used)) == 580 and used.max() < 580
  for b, p in enumerate(pages):
    assert len(np.unique(table[b, :p])) == p
    shared = np.flatnonzero(table[b, :p] != table[0, :p])
    assert b == 0 or shared.size == 0 or (table[b, : shared[0]] == table[0, : shared[0]]).all()
  # Enough pages: all private, the rest unreferenced.
  table = fam.shared_prefix_page_table(np.array([3, 0, 2]), 4, 9, rng)
  assert len(np.unique(np.concatenate([table[0, :3], table[2, :2]]))) == 5


@pytest.mark.parametrize("name,pages_of", [(INDEX, lambda L: -(-(L // 4) // 16)), (GQA, lambda L: -(-L // 64))])
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


def test_cpu_axes_keep_structure():
  op = registry.get(INDEX)
  small = op.cpu_axes(dict(B=23, MP=517, NP=1550))
  assert small["B"] == 4 and small["MP"] == 40 and small["MP"] <= small["NP"] and small["TOPK"] == 512
  assert op.cpu_axes(dict(B=1, MP=2, NP=2))["MP"] == 2
  # Prefix sharing survives: B=3, MP=554, NP=580 keeps NP far below B * MP.
  shared = op.cpu_axes(dict(B=3, MP=554, NP=580))
  assert shared["MP"] <= shared["NP"] < 2 * shared["MP"]


@pytest.mark.parametrize("backend", ["pallas", "xla", None])  # None: XLA here (no GPU)
def test_ops_function_jits(backend):
  inputs = index_case((2100, 30), 33)
  ids = jax.jit(lambda *a: ops.qsa_index_topk(*a, backend=backend))(*inputs.values())
  assert_topk_ok(ids, fam.qsa_index_topk_reference(**inputs), inputs)


def test_bad_configs_raise():
  with pytest.raises(ValueError):
    qi.ScoreStage(block_keys=24)
  with pytest.raises(ValueError):
    qi.ScoreStage(block_keys=256, chunk_keys=128)
  with pytest.raises(ValueError, match="SelectStage.block_keys=24 must be a power of two"):
    qi.SelectStage(block_keys=24)
  with pytest.raises(ValueError, match="SelectStage.chunk_keys=64 must be a multiple of block_keys"):
    qi.SelectStage(block_keys=128, chunk_keys=64)
