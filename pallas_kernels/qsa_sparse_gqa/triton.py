"""QSA sparse GQA decode (Qwen sparse attention): attention of one decoded
token over the 4-token blocks chosen by the QSA indexer, on a paged cache.

Token t of sequence b lives in physical page `page_table[b, t // P]`, slot
`t % P` of `k_cache, v_cache [NP, P, HKV, D]`. With the length clamped to the
page table, `L = clip(seq_lens[b], 0, MP * P)`, its visible tokens are the
tokens `t < L` whose block `t // C` is in `topk_ids[b]` (each block once,
however often it is listed; ids outside [0, L // C) ignored), plus the
incomplete tail block `C * (L // C) <= t < L`, less the tokens on a page whose
table entry is outside [0, NP) (absent: they contribute nothing). Query head
h reads kv head `h // (HQ / HKV)`. Softmax in fp32; a sequence with no
visible token outputs 0.

One Pallas launch (`QsaDecodeConfig(split=SplitStage, block_dv=...,
merge_block=...)`) after an XLA memset of its counters. Grid `(B, HKV *
D / block_dv, splits)`: program (b, (g, j), s) owns `keys_per_split` id
slots of sequence b for kv head g and the value columns `[j * block_dv,
(j + 1) * block_dv)`. The `TOPK + 1` slots are the listed ids in their
order, then the tail block's id (`L // C`, when L % C != 0).

1. Split (flash-decoding). A program first decides which of its slots
   count: an id counts if it is in [0, L // C) and no earlier slot lists it
   (its slots' ids compared with the list before them, 128 listed ids a
   step: repeats drop without a sort), the tail slot's if there is a tail.
   It writes its slots' counted ids (-1: none) to a small scratch row and
   walks them `block_k` ids (`C * block_k` tokens) per step, up to its last
   counted slot (a CTA barrier orders the scratch writes before the steps'
   gathers of them). Per step: gather the step's counted ids, expand them
   to token positions (`id * C + lane % C`), look up each token's physical page in the page-table row,
   gather its K row (all D columns: the scores need them) and its V columns
   from the flattened `[NP * P, HKV, D]` caches (runs of C contiguous rows),
   and fold them into an online softmax (base 2, FlashAttention-2 style) for
   the 12 query heads of the group, gathered into 16 rows whose padding
   rows are masked to zero, so both dots run on tensor cores (`[16, D] x
   [D, C*block_k]` and `[16, C*block_k] x [C*block_k, block_dv]`, fp32
   accumulation): every K/V tile loaded serves all 12 heads of its group.
   Masked tokens score -inf and are never read. The program writes its
   normalized partial output `[16, block_dv]` f32 and its base-2
   log-sum-exp `[16]` (-inf when it saw nothing). Splitting the value
   columns as well as the ids lets B=1 fill the GPU with fuller splits: the
   value blocks of a split re-read its K rows, from L2.
2. Combine, by the last program to finish: each program then arrives at
   the counter of its (b, g, j) (`last_program.arrive`: a CTA barrier, then
   one acquire-release atomic at GPU scope; the memory-ordering argument is
   that module's). The split program that arrives last merges the splits'
   partials of its (b, g, j) with their lse weights
   (`split_kv.merge_splits`: `exp2(lse_s - max_s lse)`, `merge_block`
   splits a step), normalizes, rounds once to the output dtype and writes
   the group's 12 rows of its value columns; a row whose every split is
   empty outputs 0.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.qsa_sparse_gqa.config import QsaDecodeConfig
from pallas_kernels.shared import common
from pallas_kernels.shared.common import (
  MIN_DOT_DIM,
  cdiv,
  check_pow2_dim,
  fitted_candidates,
  next_pow2,
  resolve_interpret,
)
from pallas_kernels.shared.device import num_sms
from pallas_kernels.shared.last_program import arrive
from pallas_kernels.shared.online_softmax import LOG2_E, init_carry, lse_base2, normalize, online_softmax_step
from pallas_kernels.shared.split_kv import SplitStage, merge_splits


class QsaDecodeSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""

  batch: int
  q_heads: int
  kv_heads: int
  topk: int
  head_dim: int

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> QsaDecodeSizes:
    batch, topk = shapes["topk_ids"].shape
    _, _, kv_heads, head_dim = shapes["k_cache"].shape
    return cls(int(batch), int(shapes["q"].shape[1]), int(kv_heads), int(topk), int(head_dim))

  @property
  def group_rows(self) -> int:
    """Query heads of one kv head, padded to a dot dimension."""
    return max(MIN_DOT_DIM, next_pow2(self.q_heads // self.kv_heads))


def _fit(config: QsaDecodeConfig, sizes: QsaDecodeSizes, compress: int) -> QsaDecodeConfig:
  """Steps of at least 16 tokens; no split wider than the slot list (TOPK +
  1 slots: the tail block is one more); the group's padded heads per
  program; no value block wider than D; no more splits a merge step than
  the splits."""
  split = config.split
  block = max(split.block_k, next_pow2(cdiv(MIN_DOT_DIM, compress)))
  per_split = max(block, min(split.keys_per_split, next_pow2(sizes.topk + 1)))
  split = dataclasses.replace(split, block_h=sizes.group_rows, block_k=block, keys_per_split=per_split)
  splits = cdiv(sizes.topk + 1, per_split)
  return QsaDecodeConfig(
    split=split, block_dv=min(config.block_dv, sizes.head_dim), merge_block=min(config.merge_block, next_pow2(splits))
  )


# (ids per split, ids per step, warps, stages): longest splits first, each of
# at least two steps so that the gathers of one overlap the dots of another.
_SPLITS = ((64, 16, 8, 3), (32, 16, 8, 3), (16, 8, 4, 2), (8, 4, 4, 2))
_MAX_VALUE_BLOCKS = 4
# Listed ids compared with a split's slots at a time (the repeat check).
_DEDUPE_BLOCK = 128
# Splits per step of the last program's merge (B=1: 33 splits in 9 steps).
_MERGE_BLOCK = 4


def choose_config(shapes: Mapping[str, Any], *, compress: int = 4) -> QsaDecodeConfig:
  """Heuristic: the longest split of `_SPLITS`, with the fewest value blocks
  (1, 2 or 4) that still give two programs per SM. B=1: 16-id splits of two
  32-token steps, 33 splits x 2 kv heads x 4 value blocks of 64 columns =
  264 programs; B=2: 32-id splits, 272; B >= 15: 64-id splits, whole rows
  of V. 64-token steps run 8 warps and 3 stages: on sm_90a 4 warps need
  about twice the registers, so 8 warps keep more gathers in flight per SM
  (docs/perf/kernel_notes.md). The merge takes `_MERGE_BLOCK` splits a
  step."""
  sizes = QsaDecodeSizes.of(shapes)
  rows = sizes.batch * sizes.kv_heads
  value_blocks = [v for v in (1, 2, _MAX_VALUE_BLOCKS) if sizes.head_dim % v == 0 and sizes.head_dim // v >= 16]
  choice = (_SPLITS[-1], value_blocks[-1])
  for split in _SPLITS:
    fits = [v for v in value_blocks if rows * cdiv(sizes.topk + 1, split[0]) * v >= 2 * num_sms()]
    if fits:
      choice = (split, fits[0])
      break
  (per_split, block, warps, stages), blocks = choice
  config = QsaDecodeConfig(
    split=SplitStage(block_k=block, keys_per_split=per_split, num_warps=warps, num_stages=stages),
    block_dv=sizes.head_dim // blocks,
    merge_block=_MERGE_BLOCK,
  )
  return _fit(config, sizes, compress)


_SWEEP = (
  QsaDecodeConfig(SplitStage(block_k=16, keys_per_split=64, num_warps=4, num_stages=2)),
  QsaDecodeConfig(SplitStage(block_k=16, keys_per_split=64, num_warps=8, num_stages=3), merge_block=2),
  QsaDecodeConfig(SplitStage(block_k=32, keys_per_split=128, num_warps=8, num_stages=2), merge_block=1),
  QsaDecodeConfig(SplitStage(block_k=8, keys_per_split=32, num_warps=4, num_stages=2), block_dv=128, merge_block=2),
  QsaDecodeConfig(SplitStage(block_k=8, keys_per_split=8, num_warps=4, num_stages=1), merge_block=1),
  QsaDecodeConfig(SplitStage(block_k=16, keys_per_split=32, num_warps=8, num_stages=3), block_dv=64),
  QsaDecodeConfig(SplitStage(block_k=8, keys_per_split=16, num_warps=4, num_stages=2), block_dv=128),
)


def candidate_configs(shapes: Mapping[str, Any], *, compress: int = 4) -> list[QsaDecodeConfig]:
  """Heuristic first, then the sweep's configurations fitted to the shapes."""
  sizes = QsaDecodeSizes.of(shapes)
  return fitted_candidates(choose_config(shapes, compress=compress), _SWEEP, lambda c: _fit(c, sizes, compress))


def _split_kernel(
  q_ref,
  k_ref,
  v_ref,
  pt_ref,
  ids_ref,
  len_ref,
  scale_ref,
  _,
  o_part_ref,
  lse_part_ref,
  counter_ref,
  out_ref,
  counted_ref,
  *,
  block_ids: int,
  steps: int,
  compress: int,
  page: int,
  max_pages: int,
  num_pages: int,
  value_blocks: int,
  num_splits: int,
  merge_block: int,
  interpret: bool,
):
  # q_ref [group, D] (the kv head's query heads); k_ref [NP * P, D] (this kv
  # head); v_ref [NP * P, block_dv] (its value block); pt_ref [MP];
  # ids_ref [TOPK] the listed ids; len_ref [1] (tokens); scale_ref [1];
  # o_part_ref [S, Gp, block_dv] f32 and lse_part_ref [S, Gp] f32 (base 2):
  # the partials of this (b, kv head, value block); counter_ref [J] its
  # arrivals (aliased to the zeroed input `_`); out_ref [group, D] the kv
  # head's rows of the output; counted_ref [keys_per_split] this program's
  # slots' ids that count (-1: none).
  j, split = pl.program_id(1), pl.program_id(2)
  topk = ids_ref.shape[0]
  per_split = steps * block_ids
  seq_len = jnp.clip(len_ref[0], 0, max_pages * page)  # L: the table's capacity at most
  blocks = seq_len // compress

  # The split's slots: an id counts if it is in [0, L // C) and no earlier
  # slot lists it (compared with the whole list, _DEDUPE_BLOCK slots at a
  # time: a repeat drops without a sort); the tail slot's id (L // C) if
  # there is a tail.
  slot = split * per_split + jnp.arange(per_split, dtype=jnp.int32)
  ids = plgpu.load(ids_ref.at[jnp.clip(slot, 0, topk - 1)], mask=slot < topk, other=-1)
  ids = jnp.where(slot == topk, jnp.where(seq_len % compress != 0, blocks, -1), ids)
  earlier = jnp.arange(_DEDUPE_BLOCK, dtype=jnp.int32)

  def repeats(c, seen):
    at = c * _DEDUPE_BLOCK + earlier
    listed = plgpu.load(ids_ref.at[jnp.minimum(at, topk - 1)], mask=at < topk, other=-1)
    same = (listed[None, :] == ids[:, None]) & (at[None, :] < slot[:, None])
    return seen + jnp.sum(same.astype(jnp.int32), axis=1)

  # Only the list before the split's last slot can hold an earlier repeat.
  before = jnp.minimum(split * per_split + per_split, topk)
  seen = lax.fori_loop(0, (before + _DEDUPE_BLOCK - 1) // _DEDUPE_BLOCK, repeats, jnp.zeros((per_split,), jnp.int32))
  counts = jnp.where(slot == topk, ids >= 0, (ids >= 0) & (ids < blocks) & (seen == 0))
  counted_ref[...] = jnp.where(counts, ids, -1)
  # Steps past the split's last counted slot have nothing to do.
  live = (jnp.max(jnp.where(counts, jnp.arange(per_split, dtype=jnp.int32) + 1, 0)) + block_ids - 1) // block_ids
  if not interpret:  # the steps gather counted_ref, written by other threads (interpret: one thread)
    plgpu.debug_barrier()
  qk_scale = scale_ref[0] * LOG2_E
  group, head_dim = q_ref.shape
  rows_p = o_part_ref.shape[1]
  cols = jnp.arange(head_dim, dtype=jnp.int32)
  head = jnp.arange(rows_p, dtype=jnp.int32)
  head_rows = jnp.minimum(head, group - 1)[:, None]
  q = plgpu.load(q_ref.at[head_rows, cols[None, :]], mask=(head < group)[:, None], other=0.0)
  block_t = block_ids * compress
  lane = jnp.arange(block_t, dtype=jnp.int32)
  value_cols = jnp.arange(v_ref.shape[-1], dtype=jnp.int32)

  def body(i, carry):
    block = counted_ref[i * block_ids + lane // compress]  # [block_t]
    t = block * compress + lane % compress
    visible = (block >= 0) & (t < seq_len)
    logical_page = jnp.clip(t // page, 0, max_pages - 1)
    phys = plgpu.load(pt_ref.at[logical_page], mask=visible, other=0)
    visible = visible & (phys >= 0) & (phys < num_pages)  # an absent page contributes nothing
    rows = jnp.where(visible, phys * page + t % page, 0)
    k = plgpu.load(k_ref.at[rows[:, None], cols[None, :]], mask=visible[:, None], other=0.0)
    # Zeros, not garbage: a 0 probability times a NaN value would be NaN.
    v = plgpu.load(v_ref.at[rows[:, None], value_cols[None, :]], mask=visible[:, None], other=0.0)
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * qk_scale  # [Gp, block_t]
    return online_softmax_step(s, carry, v, visible=visible[None, :])

  o, m, l = lax.fori_loop(0, live, body, init_carry(rows_p, v_ref.shape[-1]))
  o_part_ref[split] = normalize(o, m, l)
  lse_part_ref[split] = lse_base2(m, l)
  ticket = arrive(counter_ref, (j,), interpret=interpret)

  @pl.when(ticket == num_splits - 1)
  def _():
    acc, m_all, l_all = merge_splits(o_part_ref, lse_part_ref, num_splits=num_splits, block_s=merge_block)
    out = normalize(acc, m_all, l_all).astype(out_ref.dtype)
    out_cols = (j % value_blocks) * value_cols.shape[0] + value_cols
    # Padding rows point past the group: masked on a GPU, dropped by
    # interpret mode's scatter (where they would otherwise rewrite a row).
    out_rows = jnp.where(head < group, head, group)[:, None]
    plgpu.store(out_ref.at[out_rows, out_cols[None, :]], out, mask=(head < group)[:, None])


@functools.partial(jax.jit, static_argnames=("compress", "config", "interpret"))
def qsa_sparse_gqa_decode(
  q: jax.Array,
  k_cache: jax.Array,
  v_cache: jax.Array,
  page_table: jax.Array,
  seq_lens: jax.Array,
  topk_ids: jax.Array,
  sm_scale: jax.Array | float | None = None,
  *,
  compress: int = 4,
  config: QsaDecodeConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """QSA sparse GQA decode.

  Args:
    q: `[B, HQ, D]` queries (bf16); D a power of two >= 16.
    k_cache, v_cache: `[NP, P, HKV, D]` paged caches, q's dtype; HQ % HKV == 0.
    page_table: `[B, MP]` int32; an entry outside [0, NP) is an absent page
      (its tokens contribute nothing).
    seq_lens: `[B]` int32 tokens (the current one included), clamped to
      [0, MP * P].
    topk_ids: `[B, TOPK]` int32 selected blocks (token // compress), any
      order, TOPK >= 1; ids outside [0, L // compress) are ignored, a
      repeated id counts once.
    sm_scale: softmax scale, a scalar or 0-d array (may be traced);
      None = D ** -0.5.
    compress: tokens per block (static).
    config: `QsaDecodeConfig`; None = `choose_config`.
    interpret: None = interpret when no GPU is present.

  Returns:
    `[B, HQ, D]` in q's dtype; 0 for a sequence with no visible token.
  """
  batch, q_heads, head_dim = q.shape
  num_pages, page, kv_heads, _ = k_cache.shape
  max_pages = page_table.shape[1]
  topk = topk_ids.shape[1]
  if k_cache.shape != v_cache.shape or k_cache.shape[-1] != head_dim or q_heads % kv_heads:
    raise ValueError(f"q {q.shape}, k_cache {k_cache.shape}, v_cache {v_cache.shape} do not match")
  if topk_ids.ndim != 2 or topk_ids.shape[0] != batch or topk < 1:
    raise ValueError(f"topk_ids {topk_ids.shape} must be [B={batch}, TOPK >= 1]")
  check_pow2_dim("head dim D", head_dim)
  if batch == 0:
    return jnp.zeros(q.shape, q.dtype)
  shapes = {"q": q, "topk_ids": topk_ids, "k_cache": k_cache}
  if config is None:
    config = choose_config(shapes, compress=compress)
  config = _fit(config, QsaDecodeSizes.of(shapes), compress)
  split = config.split
  num_splits = cdiv(topk + 1, split.keys_per_split)
  value_blocks = head_dim // config.block_dv
  programs = kv_heads * value_blocks  # grid axis 1: (kv head, value block)
  group = q_heads // kv_heads
  group_p = split.block_h

  k_flat = k_cache.reshape(num_pages * page, kv_heads, head_dim)
  v_flat = v_cache.reshape(num_pages * page, kv_heads, head_dim)
  if sm_scale is None:
    sm_scale = head_dim**-0.5
  scale = jnp.asarray(sm_scale, jnp.float32).reshape(1)
  interpret = resolve_interpret(interpret)

  heads = lambda j: j // value_blocks
  _, _, _, out, _ = common.pallas_call(
    functools.partial(
      _split_kernel,
      block_ids=split.block_k,
      steps=split.keys_per_split // split.block_k,
      compress=compress,
      page=page,
      max_pages=max_pages,
      num_pages=num_pages,
      value_blocks=value_blocks,
      num_splits=num_splits,
      merge_block=config.merge_block,
      interpret=interpret,
    ),
    out_shape=(
      jax.ShapeDtypeStruct((batch, programs, num_splits, group_p, config.block_dv), jnp.float32),
      jax.ShapeDtypeStruct((batch, programs, num_splits, group_p), jnp.float32),
      jax.ShapeDtypeStruct((batch, programs), jnp.int32),
      jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), q.dtype),
      jax.ShapeDtypeStruct((batch, programs, num_splits, split.keys_per_split), jnp.int32),
    ),
    grid=(batch, programs, num_splits),
    in_specs=[
      pl.BlockSpec((None, None, group, head_dim), lambda b, j, s: (b, heads(j), 0, 0)),
      pl.BlockSpec((num_pages * page, None, head_dim), lambda b, j, s: (0, heads(j), 0)),
      pl.BlockSpec((num_pages * page, None, config.block_dv), lambda b, j, s: (0, heads(j), j % value_blocks)),
      pl.BlockSpec((None, max_pages), lambda b, j, s: (b, 0)),
      pl.BlockSpec((None, topk), lambda b, j, s: (b, 0)),
      pl.BlockSpec((None, 1), lambda b, j, s: (b, 0)),
      pl.BlockSpec((1,), lambda b, j, s: (0,)),
      pl.BlockSpec((None, programs), lambda b, j, s: (b, 0)),
    ],
    out_specs=(
      pl.BlockSpec((None, None, num_splits, group_p, config.block_dv), lambda b, j, s: (b, j, 0, 0, 0)),
      pl.BlockSpec((None, None, num_splits, group_p), lambda b, j, s: (b, j, 0, 0)),
      pl.BlockSpec((None, programs), lambda b, j, s: (b, 0)),
      pl.BlockSpec((None, None, group, head_dim), lambda b, j, s: (b, heads(j), 0, 0)),
      pl.BlockSpec((None, None, None, split.keys_per_split), lambda b, j, s: (b, j, s, 0)),
    ),
    input_output_aliases={7: 2},
    compiler_params=plgpu.CompilerParams(num_warps=split.num_warps, num_stages=split.num_stages),
    interpret=interpret,
    name="qsa_sparse_gqa_split",
  )(
    q.reshape(batch, kv_heads, group, head_dim),
    k_flat,
    v_flat,
    page_table.astype(jnp.int32),
    topk_ids.astype(jnp.int32),
    seq_lens.astype(jnp.int32).reshape(batch, 1),
    scale,
    jnp.zeros((batch, programs), jnp.int32),
  )
  return out.reshape(batch, q_heads, head_dim)
