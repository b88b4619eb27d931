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

Launcher (XLA, `[B, TOPK + 1]` ids): the listed ids that count and the tail
block's id (`L // C`, when L % C != 0) are sorted, repeats dropped (-1): the
ids that count come first, ascending, so the gathers walk the pages in order
and a split past them has nothing to do. The list is padded with -1 to
`splits * keys_per_split` slots (a slot is an id).

Two Pallas stages (`QsaDecodeConfig(split=SplitStage, combine=CombineStage,
block_dv=...)`):

1. Split (flash-decoding). Grid `(B, HKV * D / block_dv, splits)`: program
   (b, (g, j), s) owns `keys_per_split` id slots of sequence b for kv head g
   and the value columns `[j * block_dv, (j + 1) * block_dv)`, and walks the
   slots holding ids `block_k` ids (`C * block_k` tokens) per step. Per step:
   gather the step's ids, expand them to token positions (`id * C + lane %
   C`), look up each token's physical page in the page-table row, gather its
   K row (all D columns: the scores need them) and its V columns from the
   flattened `[NP * P, HKV, D]` caches (runs of C contiguous rows), and fold
   them into an online softmax (base 2, FlashAttention-2 style) for the 12
   query heads of the group, zero-padded to 16 rows so both dots run on
   tensor cores (`[16, D] x [D, C*block_k]` and `[16, C*block_k] x
   [C*block_k, block_dv]`, fp32 accumulation): every K/V tile loaded serves
   all 12 heads of its group. Masked tokens score -inf and are never read.
   The program writes its normalized partial output `[16, block_dv]` f32;
   the first value block also its base-2 log-sum-exp `[16]` (-inf when it
   saw nothing; every value block computes the same one). Splitting the
   value columns as well as the ids lets B=1 fill the GPU with fuller
   splits: the value blocks of a split re-read its K rows, from L2.
2. Combine (`split_kv.combine_splits`, no sink), grid
   `(1, B * HKV, D / block_d)`: the partials are merged with their lse
   weights (`exp2(lse_s - max_s lse)`), normalized, rounded once to the
   output dtype; rows whose every split is empty output 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels.shared import common
import jax.numpy as jnp

from pallas_kernels.shared.common import MIN_DOT_DIM, cdiv, check_pow2_dim, fitted_candidates, next_pow2, resolve_interpret
from pallas_kernels.shared.device import num_sms
from pallas_kernels.shared.online_softmax import LOG2_E, init_carry, lse_base2, normalize, online_softmax_step
from pallas_kernels.shared.split_kv import CombineStage, SplitStage, combine_splits, fit_combine
from pallas_kernels.qsa_sparse_gqa.config import QsaDecodeConfig


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
  """Steps of at least 16 tokens; no split wider than the id list (TOPK + 1
  ids: the tail block is one more); the group's padded heads per program; no
  value block wider than D."""
  split = config.split
  block = max(split.block_k, next_pow2(cdiv(MIN_DOT_DIM, compress)))
  per_split = max(block, min(split.keys_per_split, next_pow2(sizes.topk + 1)))
  split = dataclasses.replace(split, block_h=sizes.group_rows, block_k=block, keys_per_split=per_split)
  return QsaDecodeConfig(split=split, combine=fit_combine(config.combine, sizes.group_rows, sizes.head_dim),
                         block_dv=min(config.block_dv, sizes.head_dim))


# (ids per split, ids per step, warps, stages): longest splits first, each of
# at least two steps so that the gathers of one overlap the dots of another.
_SPLITS = ((64, 16, 8, 3), (32, 16, 8, 3), (16, 8, 4, 2), (8, 4, 4, 2))
_MAX_VALUE_BLOCKS = 4


def choose_config(shapes: Mapping[str, Any], *, compress: int = 4) -> QsaDecodeConfig:
  """Heuristic: the longest split of `_SPLITS`, with the fewest value blocks
  (1, 2 or 4) that still give two programs per SM. B=1: 16-id splits of two
  32-token steps, 33 splits x 2 kv heads x 4 value blocks of 64 columns =
  264 programs (the former one-step splits: 130); B=2: 32-id splits, 272;
  B >= 15: 64-id splits, whole rows of V. 64-token steps run 8 warps and 3
  stages: on sm_90a 4 warps need about twice the registers, so 8 warps keep
  more gathers in flight per SM (docs/perf/kernel_notes.md)."""
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
  config = QsaDecodeConfig(split=SplitStage(block_k=block, keys_per_split=per_split, num_warps=warps,
                                            num_stages=stages),
                           combine=CombineStage(block_d=64, num_warps=4), block_dv=sizes.head_dim // blocks)
  return _fit(config, sizes, compress)


_SWEEP = (
    QsaDecodeConfig(SplitStage(block_k=16, keys_per_split=64, num_warps=4, num_stages=2), CombineStage(block_d=64)),
    QsaDecodeConfig(SplitStage(block_k=16, keys_per_split=64, num_warps=8, num_stages=3), CombineStage(block_d=64)),
    QsaDecodeConfig(SplitStage(block_k=32, keys_per_split=128, num_warps=8, num_stages=2), CombineStage(block_d=128)),
    QsaDecodeConfig(SplitStage(block_k=8, keys_per_split=32, num_warps=4, num_stages=2), CombineStage(block_d=32),
                    block_dv=128),
    QsaDecodeConfig(SplitStage(block_k=8, keys_per_split=8, num_warps=4, num_stages=1),
                    CombineStage(block_d=32, num_warps=2)),
    QsaDecodeConfig(SplitStage(block_k=16, keys_per_split=32, num_warps=8, num_stages=3), CombineStage(block_d=64),
                    block_dv=64),
    QsaDecodeConfig(SplitStage(block_k=8, keys_per_split=16, num_warps=4, num_stages=2), CombineStage(block_d=64),
                    block_dv=128),
)


def candidate_configs(shapes: Mapping[str, Any], *, compress: int = 4) -> list[QsaDecodeConfig]:
  """Heuristic first, then the sweep's configurations fitted to the shapes."""
  sizes = QsaDecodeSizes.of(shapes)
  return fitted_candidates(choose_config(shapes, compress=compress), _SWEEP,
                           lambda c: _fit(c, sizes, compress))


def _split_kernel(q_ref, k_ref, v_ref, pt_ref, ids_ref, len_ref, scale_ref, o_ref, lse_ref, *,
                  block_ids: int, steps: int, compress: int, page: int, max_pages: int, num_pages: int,
                  value_blocks: int):
  # q_ref [Gp, D] (group's heads, zero-padded); k_ref [NP * P, D] (this kv
  # head); v_ref [NP * P, block_dv] (its value block); pt_ref [MP];
  # ids_ref [keys_per_split]; len_ref [1] (tokens); scale_ref [1];
  # o_ref [Gp, block_dv] f32; lse_ref [Gp] f32 (base 2).
  seq_len = jnp.clip(len_ref[0], 0, max_pages * page)   # L: the table's capacity at most
  # The ids that count come first (sorted): steps past the split's last one
  # have nothing to do.
  slot = jnp.arange(steps * block_ids, dtype=jnp.int32)
  live = (jnp.max(jnp.where(ids_ref[...] >= 0, slot + 1, 0)) + block_ids - 1) // block_ids
  qk_scale = scale_ref[0] * LOG2_E
  q = q_ref[...]
  rows_p, head_dim = q.shape
  block_t = block_ids * compress
  lane = jnp.arange(block_t, dtype=jnp.int32)
  cols = jnp.arange(head_dim, dtype=jnp.int32)
  value_cols = jnp.arange(v_ref.shape[-1], dtype=jnp.int32)

  def body(i, carry):
    block = ids_ref[i * block_ids + lane // compress]           # [block_t]
    t = block * compress + lane % compress
    visible = (block >= 0) & (t < seq_len)
    logical_page = jnp.clip(t // page, 0, max_pages - 1)
    phys = plgpu.load(pt_ref.at[logical_page], mask=visible, other=0)
    visible = visible & (phys >= 0) & (phys < num_pages)        # an absent page contributes nothing
    rows = jnp.where(visible, phys * page + t % page, 0)
    k = plgpu.load(k_ref.at[rows[:, None], cols[None, :]], mask=visible[:, None], other=0.0)
    # Zeros, not garbage: a 0 probability times a NaN value would be NaN.
    v = plgpu.load(v_ref.at[rows[:, None], value_cols[None, :]], mask=visible[:, None], other=0.0)
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * qk_scale  # [Gp, block_t]
    return online_softmax_step(s, carry, v, visible=visible[None, :])

  o, m, l = lax.fori_loop(0, live, body, init_carry(rows_p, v_ref.shape[-1]))
  o_ref[...] = normalize(o, m, l)

  @pl.when(pl.program_id(1) % value_blocks == 0)
  def _():
    lse_ref[...] = lse_base2(m, l)


def counted_ids(topk_ids: jax.Array, seq_lens: jax.Array, compress: int) -> jax.Array:
  """`[B, TOPK + 1]`: the listed ids in [0, L // C) and the tail block's id,
  sorted, each once (a repeat becomes -1), ahead of the -1 slots."""
  n = seq_lens // compress
  missing = jnp.iinfo(jnp.int32).max
  listed = jnp.where((topk_ids >= 0) & (topk_ids < n[:, None]), topk_ids.astype(jnp.int32), missing)
  tail = jnp.where(seq_lens % compress != 0, n, missing)
  ids = jnp.sort(jnp.concatenate([listed, tail[:, None]], axis=1), axis=1)
  repeat = jnp.concatenate([jnp.zeros_like(ids[:, :1], bool), ids[:, 1:] == ids[:, :-1]], axis=1)
  return jnp.where(repeat | (ids == missing), -1, ids)


@functools.partial(jax.jit, static_argnames=("compress", "config", "interpret"))
def qsa_sparse_gqa_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, page_table: jax.Array,
                          seq_lens: jax.Array, topk_ids: jax.Array, sm_scale: jax.Array | float | None = None,
                          *, compress: int = 4, config: QsaDecodeConfig | None = None,
                          interpret: bool | None = None) -> jax.Array:
  """QSA sparse GQA decode.

  Args:
    q: `[B, HQ, D]` queries (bf16); D a power of two >= 16.
    k_cache, v_cache: `[NP, P, HKV, D]` paged caches, q's dtype; HQ % HKV == 0.
    page_table: `[B, MP]` int32; an entry outside [0, NP) is an absent page
      (its tokens contribute nothing).
    seq_lens: `[B]` int32 tokens (the current one included), clamped to
      [0, MP * P].
    topk_ids: `[B, TOPK]` int32 selected blocks (token // compress), any
      order; ids outside [0, L // compress) are ignored, a repeated id
      counts once.
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
  check_pow2_dim("head dim D", head_dim)
  if batch == 0:
    return jnp.zeros(q.shape, q.dtype)
  shapes = {"q": q, "topk_ids": topk_ids, "k_cache": k_cache}
  if config is None:
    config = choose_config(shapes, compress=compress)
  config = _fit(config, QsaDecodeSizes.of(shapes), compress)
  split = config.split
  num_ids = topk + 1
  num_splits = cdiv(num_ids, split.keys_per_split)
  value_blocks = head_dim // config.block_dv
  group = q_heads // kv_heads
  group_p = split.block_h

  seq_lens = seq_lens.astype(jnp.int32)
  ids = counted_ids(topk_ids, jnp.clip(seq_lens, 0, max_pages * page), compress)
  ids = jnp.pad(ids, ((0, 0), (0, num_splits * split.keys_per_split - num_ids)), constant_values=-1)

  q_p = jnp.pad(q.reshape(batch, kv_heads, group, head_dim),
                ((0, 0), (0, 0), (0, group_p - group), (0, 0)))
  k_flat = k_cache.reshape(num_pages * page, kv_heads, head_dim)
  v_flat = v_cache.reshape(num_pages * page, kv_heads, head_dim)
  if sm_scale is None:
    sm_scale = head_dim ** -0.5
  scale = jnp.asarray(sm_scale, jnp.float32).reshape(1)
  interpret = resolve_interpret(interpret)

  heads = lambda j: j // value_blocks  # grid axis 1: (kv head, value block)
  o_part, lse_part = common.pallas_call(
      functools.partial(_split_kernel, block_ids=split.block_k, steps=split.keys_per_split // split.block_k,
                        compress=compress, page=page, max_pages=max_pages, num_pages=num_pages,
                        value_blocks=value_blocks),
      out_shape=(jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group_p, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group_p), jnp.float32)),
      grid=(batch, kv_heads * value_blocks, num_splits),
      in_specs=[
          pl.BlockSpec((None, None, group_p, head_dim), lambda b, j, s: (b, heads(j), 0, 0)),
          pl.BlockSpec((num_pages * page, None, head_dim), lambda b, j, s: (0, heads(j), 0)),
          pl.BlockSpec((num_pages * page, None, config.block_dv), lambda b, j, s: (0, heads(j), j % value_blocks)),
          pl.BlockSpec((None, max_pages), lambda b, j, s: (b, 0)),
          pl.BlockSpec((None, split.keys_per_split), lambda b, j, s: (b, s)),
          pl.BlockSpec((None, 1), lambda b, j, s: (b, 0)),
          pl.BlockSpec((1,), lambda b, j, s: (0,)),
      ],
      out_specs=(pl.BlockSpec((None, None, None, group_p, config.block_dv),
                              lambda b, j, s: (b, heads(j), s, 0, j % value_blocks)),
                 pl.BlockSpec((None, None, None, group_p), lambda b, j, s: (b, heads(j), s, 0))),
      compiler_params=plgpu.CompilerParams(num_warps=split.num_warps, num_stages=split.num_stages),
      interpret=interpret,
      name="qsa_sparse_gqa_split",
  )(q_p, k_flat, v_flat, page_table.astype(jnp.int32), ids, seq_lens.reshape(batch, 1), scale)

  rows = batch * kv_heads  # the combine's rows: (sequence, kv head) pairs
  out = combine_splits(o_part.reshape(rows, num_splits, group_p, head_dim),
                       lse_part.reshape(rows, num_splits, group_p), stage=config.combine,
                       out_dtype=q.dtype, name="qsa_sparse_gqa_combine", interpret=interpret)
  return out.reshape(batch, kv_heads, group_p, head_dim)[:, :, :group].reshape(batch, q_heads, head_dim)
