"""QSA sparse GQA decode (Qwen sparse attention): attention of one decoded
token over the 4-token blocks chosen by the QSA indexer, on a paged cache.

Token t of sequence b lives in physical page `page_table[b, t // P]`, slot
`t % P` of `k_cache, v_cache [NP, P, HKV, D]`. Its visible tokens are the
tokens `t < seq_lens[b]` whose block `t // C` is in `topk_ids[b]` (-1 slots
ignored), plus the incomplete tail block `C * (seq_lens[b] // C) <= t <
seq_lens[b]`. Query head h reads kv head `h // (HQ / HKV)`. Softmax in fp32;
a sequence with no visible token outputs 0.

Two Pallas stages (`QsaDecodeConfig(split=SplitStage, combine=CombineStage)`):

1. Split (flash-decoding). The launcher appends the tail block as one more
   id (`seq_lens // C`; its tokens past seq_len are masked like any other)
   and pads the id list with -1 to `splits * ids_per_split` slots. Grid
   `(B, HKV, splits)`: program (b, g, s) owns `ids_per_split` id slots of
   sequence b for kv head g, and walks them `block_ids` ids
   (`C * block_ids` tokens) per step. Per step: gather the step's ids from its
   slice, expand them to token positions (`id * C + lane % C`), look up each
   token's physical page in the page-table row, gather its K and V rows from
   the flattened `[NP * P, HKV, D]` caches (runs of C contiguous rows), and fold
   them into an online softmax (base 2, FlashAttention-2 style) for the 12
   query heads of the group, zero-padded to 16 rows so both dots run on tensor
   cores (`[16, D] x [D, C*block_ids]` and `[16, C*block_ids] x
   [C*block_ids, D]`, fp32 accumulation): every K/V tile loaded serves all 12
   heads of its group. Masked tokens (-1 slots, ids >= n, t >= seq_len) score
   -inf and are never read. The program writes its normalized partial output
   `[16, D]` f32 and its base-2 log-sum-exp `[16]` (-inf when it saw nothing).
   Splitting the 513 ids lets B=1 fill the GPU (B * HKV * splits programs).
2. Combine. Grid `(B, HKV, D / block_d)`: the partials are merged with their
   lse weights (`exp2(lse_s - max_s lse)`), normalized, rounded once to the
   output dtype; rows whose every split is empty output 0.

Ids are assumed unique (the indexer's output is); ids >= n are ignored, which
matches the definition (their only tokens below seq_len are the tail's).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from pallas_kernels.common import MIN_DOT_DIM, cdiv, check_pow2, next_pow2, online_softmax_weights, resolve_interpret

_LOG2_E = math.log2(math.e)
_NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class SplitStage:
  """`block_ids` ids per step (C * block_ids tokens, >= 16 for the dots);
  `ids_per_split` id slots per program (a multiple of `block_ids`)."""
  block_ids: int = 16
  ids_per_split: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    check_pow2(self, "block_ids", "ids_per_split", minimum=4)
    if self.ids_per_split < self.block_ids:
      raise ValueError(f"ids_per_split={self.ids_per_split} < block_ids={self.block_ids}")
    check_pow2(self, "num_warps")
    if self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages} < 1")


@dataclasses.dataclass(frozen=True)
class CombineStage:
  """`block_d` output columns per program."""
  block_d: int = 64
  num_warps: int = 4

  def __post_init__(self):
    check_pow2(self, "block_d", minimum=16)
    check_pow2(self, "num_warps")


@dataclasses.dataclass(frozen=True)
class QsaDecodeConfig:
  split: SplitStage = SplitStage()
  combine: CombineStage = CombineStage()


def _dims(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> tuple[int, int, int, int]:
  """(B, HKV, TOPK, D) from the definition's input shapes."""
  batch, topk = shapes["topk_ids"].shape
  _, _, kv_heads, head_dim = shapes["k_cache"].shape
  return int(batch), int(kv_heads), int(topk), int(head_dim)


def _fit(split: SplitStage, num_ids: int, compress: int) -> SplitStage:
  """Steps of at least 16 tokens; no split wider than the id list."""
  block = max(split.block_ids, next_pow2(cdiv(MIN_DOT_DIM, compress)))
  per_split = max(block, min(split.ids_per_split, next_pow2(num_ids)))
  return dataclasses.replace(split, block_ids=block, ids_per_split=per_split)


def choose_config(shapes: Mapping[str, jax.ShapeDtypeStruct], *, compress: int = 4) -> QsaDecodeConfig:
  """Heuristic: the longest split (64, 32, 16 or 8 ids) that still gives about
  one program per SM. B=1: 8-id splits (one 32-token step each), 65 splits x
  2 kv heads = 130 programs; B=23: 64-id splits, 414 programs of four 64-token
  steps. 64-token steps run 8 warps and 3 stages: at 4 warps the sm_90a
  compile needs 204 registers (2 programs per SM), at 8 warps 128 with
  76 KiB of shared memory, so more gathers are in flight per SM."""
  batch, kv_heads, topk, head_dim = _dims(shapes)
  num_ids = topk + 1
  per_split = 64
  while per_split > 8 and batch * kv_heads * cdiv(num_ids, per_split) < _NUM_SMS:
    per_split //= 2
  block = min(16, per_split)
  if block >= 16:
    split = SplitStage(block_ids=block, ids_per_split=per_split, num_warps=8, num_stages=3)
  else:
    split = SplitStage(block_ids=block, ids_per_split=per_split, num_warps=4, num_stages=2)
  return QsaDecodeConfig(split=_fit(split, num_ids, compress),
                         combine=CombineStage(block_d=min(64, head_dim), num_warps=4))


_SWEEP = (
    QsaDecodeConfig(SplitStage(16, 64, 4, 2), CombineStage(64, 4)),
    QsaDecodeConfig(SplitStage(16, 64, 8, 3), CombineStage(64, 4)),
    QsaDecodeConfig(SplitStage(32, 128, 8, 2), CombineStage(128, 4)),
    QsaDecodeConfig(SplitStage(8, 32, 4, 2), CombineStage(32, 4)),
    QsaDecodeConfig(SplitStage(8, 8, 4, 1), CombineStage(32, 2)),
    QsaDecodeConfig(SplitStage(16, 16, 4, 1), CombineStage(64, 4)),
)


def candidate_configs(shapes: Mapping[str, jax.ShapeDtypeStruct], *,
                      compress: int = 4) -> list[QsaDecodeConfig]:
  """Heuristic first, then the sweep's configurations fitted to the shapes."""
  _, _, topk, head_dim = _dims(shapes)
  chosen = choose_config(shapes, compress=compress)
  rest = [dataclasses.replace(c, split=_fit(c.split, topk + 1, compress),
                              combine=dataclasses.replace(c.combine, block_d=min(c.combine.block_d, head_dim)))
          for c in _SWEEP]
  return list(dict.fromkeys([chosen, *rest]))


def _split_kernel(q_ref, k_ref, v_ref, pt_ref, ids_ref, len_ref, scale_ref, o_ref, lse_ref, *,
                  block_ids: int, steps: int, compress: int, page: int, max_pages: int):
  # q_ref [Gp, D] (group's heads, zero-padded); k_ref, v_ref [NP * P, D] (this
  # kv head); pt_ref [MP]; ids_ref [ids_per_split]; len_ref [1]; scale_ref [1];
  # o_ref [Gp, D] f32; lse_ref [Gp] f32.
  seq_len = len_ref[0]
  qk_scale = scale_ref[0] * _LOG2_E
  q = q_ref[...]
  head_dim = q.shape[-1]
  block_t = block_ids * compress
  lane = jnp.arange(block_t, dtype=jnp.int32)
  cols = jnp.arange(head_dim, dtype=jnp.int32)

  def body(i, carry):
    o_prev, m_prev, l_prev = carry
    block = ids_ref[i * block_ids + lane // compress]           # [block_t]
    t = block * compress + lane % compress
    visible = (block >= 0) & (t < seq_len)
    logical_page = jnp.clip(t // page, 0, max_pages - 1)
    phys = plgpu.load(pt_ref.at[logical_page], mask=visible, other=0)
    rows = jnp.where(visible, phys * page + t % page, 0)
    at = (rows[:, None], cols[None, :])
    k = plgpu.load(k_ref.at[at], mask=visible[:, None], other=0.0)
    # Zeros, not garbage: a 0 probability times a NaN value would be NaN.
    v = plgpu.load(v_ref.at[at], mask=visible[:, None], other=0.0)
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * qk_scale  # [Gp, block_t]
    s = jnp.where(visible[None, :], s, -jnp.inf)
    p, correction, m_next, l_next = online_softmax_weights(s, m_prev, l_prev)
    o_next = correction[:, None] * o_prev + jnp.dot(p.astype(v.dtype), v,
                                                    preferred_element_type=jnp.float32)
    return o_next, m_next, l_next

  rows_p = q.shape[0]
  init = (jnp.zeros((rows_p, head_dim), jnp.float32),
          jnp.full((rows_p,), -jnp.inf, jnp.float32),
          jnp.zeros((rows_p,), jnp.float32))
  o, m, l = lax.fori_loop(0, steps, body, init)
  seen = l > 0.0
  o_ref[...] = o * jnp.where(seen, 1.0 / l, 0.0)[:, None]
  lse_ref[...] = jnp.where(seen, m + jnp.log2(l), -jnp.inf)


def _combine_kernel(o_ref, lse_ref, out_ref, *, num_splits: int):
  # o_ref [S, Gp, block_d] f32; lse_ref [S, Gp] f32 (base 2); out_ref [Gp, block_d].
  rows_p = lse_ref.shape[1]
  m = lax.fori_loop(0, num_splits, lambda s, m: jnp.maximum(m, lse_ref[s, :]),
                    jnp.full((rows_p,), -jnp.inf, jnp.float32))
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)

  def body(s, carry):
    acc, den = carry
    w = jnp.exp2(lse_ref[s, :] - m_safe)  # 0 for empty splits
    return acc + w[:, None] * o_ref[s, :, :], den + w

  acc, den = lax.fori_loop(0, num_splits, body,
                           (jnp.zeros(out_ref.shape, jnp.float32), jnp.zeros((rows_p,), jnp.float32)))
  out_ref[...] = (acc * jnp.where(den > 0.0, 1.0 / den, 0.0)[:, None]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("compress", "config", "interpret"))
def qsa_sparse_gqa_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, page_table: jax.Array,
                          seq_lens: jax.Array, topk_ids: jax.Array, sm_scale: jax.Array | float | None = None,
                          *, compress: int = 4, config: QsaDecodeConfig | None = None,
                          interpret: bool | None = None) -> jax.Array:
  """QSA sparse GQA decode.

  Args:
    q: `[B, HQ, D]` queries (bf16); D a power of two >= 16.
    k_cache, v_cache: `[NP, P, HKV, D]` paged caches, q's dtype; HQ % HKV == 0.
    page_table: `[B, MP]` int32.
    seq_lens: `[B]` int32 tokens (the current one included).
    topk_ids: `[B, TOPK]` int32 selected blocks (token // compress), -1 = empty.
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
  if head_dim < MIN_DOT_DIM or head_dim & (head_dim - 1):
    raise ValueError(f"head dim {head_dim} must be a power of two >= {MIN_DOT_DIM}")
  if config is None:
    config = choose_config({"topk_ids": topk_ids, "k_cache": k_cache}, compress=compress)
  split = _fit(config.split, topk + 1, compress)
  block_d = min(config.combine.block_d, head_dim)
  num_ids = topk + 1
  num_splits = cdiv(num_ids, split.ids_per_split)
  group = q_heads // kv_heads
  group_p = max(MIN_DOT_DIM, next_pow2(group))

  seq_lens = seq_lens.astype(jnp.int32)
  n = seq_lens // compress
  # Ids the definition ignores (>= n: only the tail's tokens, added below).
  ids = jnp.where((topk_ids >= 0) & (topk_ids < n[:, None]), topk_ids, -1).astype(jnp.int32)
  tail = jnp.where(seq_lens % compress != 0, n, -1)
  pad = num_splits * split.ids_per_split - num_ids
  ids = jnp.concatenate([ids, tail[:, None], jnp.full((batch, pad), -1, jnp.int32)], axis=1)

  q_p = jnp.pad(q.reshape(batch, kv_heads, group, head_dim),
                ((0, 0), (0, 0), (0, group_p - group), (0, 0)))
  k_flat = k_cache.reshape(num_pages * page, kv_heads, head_dim)
  v_flat = v_cache.reshape(num_pages * page, kv_heads, head_dim)
  if sm_scale is None:
    sm_scale = head_dim ** -0.5
  scale = jnp.asarray(sm_scale, jnp.float32).reshape(1)
  interpret = resolve_interpret(interpret)

  kv_spec = pl.BlockSpec((num_pages * page, None, head_dim), lambda b, g, s: (0, g, 0))
  o_part, lse_part = pl.pallas_call(
      functools.partial(_split_kernel, block_ids=split.block_ids,
                        steps=split.ids_per_split // split.block_ids, compress=compress, page=page,
                        max_pages=max_pages),
      out_shape=(jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group_p, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group_p), jnp.float32)),
      grid=(batch, kv_heads, num_splits),
      in_specs=[
          pl.BlockSpec((None, None, group_p, head_dim), lambda b, g, s: (b, g, 0, 0)),
          kv_spec, kv_spec,
          pl.BlockSpec((None, max_pages), lambda b, g, s: (b, 0)),
          pl.BlockSpec((None, split.ids_per_split), lambda b, g, s: (b, s)),
          pl.BlockSpec((None, 1), lambda b, g, s: (b, 0)),
          pl.BlockSpec((1,), lambda b, g, s: (0,)),
      ],
      out_specs=(pl.BlockSpec((None, None, None, group_p, head_dim), lambda b, g, s: (b, g, s, 0, 0)),
                 pl.BlockSpec((None, None, None, group_p), lambda b, g, s: (b, g, s, 0))),
      compiler_params=plgpu.CompilerParams(num_warps=split.num_warps, num_stages=split.num_stages),
      interpret=interpret,
      name="qsa_sparse_gqa_split",
  )(q_p, k_flat, v_flat, page_table.astype(jnp.int32), ids, seq_lens.reshape(batch, 1), scale)

  out = pl.pallas_call(
      functools.partial(_combine_kernel, num_splits=num_splits),
      out_shape=jax.ShapeDtypeStruct((batch, kv_heads, group_p, head_dim), q.dtype),
      grid=(batch, kv_heads, head_dim // block_d),
      in_specs=[
          pl.BlockSpec((None, None, num_splits, group_p, block_d), lambda b, g, d: (b, g, 0, 0, d)),
          pl.BlockSpec((None, None, num_splits, group_p), lambda b, g, d: (b, g, 0, 0)),
      ],
      out_specs=pl.BlockSpec((None, None, group_p, block_d), lambda b, g, d: (b, g, 0, d)),
      compiler_params=plgpu.CompilerParams(num_warps=config.combine.num_warps, num_stages=1),
      interpret=interpret,
      name="qsa_sparse_gqa_combine",
  )(o_part, lse_part)
  return out[:, :, :group].reshape(batch, q_heads, head_dim)
