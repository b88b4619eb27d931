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
   and pads the id list with -1 to `splits * keys_per_split` slots (a slot
   is an id). Grid `(B, HKV, splits)`: program (b, g, s) owns
   `keys_per_split` id slots of sequence b for kv head g, and walks them
   `block_k` ids (`C * block_k` tokens) per step. Per step: gather the step's ids from its
   slice, expand them to token positions (`id * C + lane % C`), look up each
   token's physical page in the page-table row, gather its K and V rows from
   the flattened `[NP * P, HKV, D]` caches (runs of C contiguous rows), and fold
   them into an online softmax (base 2, FlashAttention-2 style) for the 12
   query heads of the group, zero-padded to 16 rows so both dots run on tensor
   cores (`[16, D] x [D, C*block_k]` and `[16, C*block_k] x
   [C*block_k, D]`, fp32 accumulation): every K/V tile loaded serves all 12
   heads of its group. Masked tokens (-1 slots, ids >= n, t >= seq_len) score
   -inf and are never read. The program writes its normalized partial output
   `[16, D]` f32 and its base-2 log-sum-exp `[16]` (-inf when it saw nothing).
   Splitting the 513 ids lets B=1 fill the GPU (B * HKV * splits programs).
2. Combine (`split_kv.combine_splits`, no sink), grid
   `(1, B * HKV, D / block_d)`: the partials are merged with their lse
   weights (`exp2(lse_s - max_s lse)`), normalized, rounded once to the
   output dtype; rows whose every split is empty output 0.

Ids are assumed unique (the indexer's output is); ids >= n are ignored, which
matches the definition (their only tokens below seq_len are the tail's).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels import common
import jax.numpy as jnp

from pallas_kernels.common import MIN_DOT_DIM, cdiv, check_pow2_dim, fitted_candidates, next_pow2, resolve_interpret
from pallas_kernels.config_rules import KernelConfig, field, instance_of
from pallas_kernels.device import num_sms
from pallas_kernels.online_softmax import LOG2_E, init_carry, lse_base2, normalize, online_softmax_step
from pallas_kernels.split_kv import CombineStage, SplitStage, combine_splits, fit_combine


@dataclasses.dataclass(frozen=True)
class QsaDecodeConfig(KernelConfig):
  """`split`: a key slot is one selected id (C tokens): `block_k` ids per
  step (C * block_k tokens, fitted to >= 16 for the dots), `keys_per_split`
  ids per program; `block_h` is the kv head's query group, padded to >= 16
  (fitted, not a choice). `combine`: `split_kv.combine_splits`' tiling."""
  split: SplitStage = field(SplitStage(block_k=16, keys_per_split=64, num_warps=4, num_stages=2),
                            instance_of(SplitStage))
  combine: CombineStage = field(CombineStage(), instance_of(CombineStage))


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
  ids: the tail block is one more); the group's padded heads per program."""
  split = config.split
  block = max(split.block_k, next_pow2(cdiv(MIN_DOT_DIM, compress)))
  per_split = max(block, min(split.keys_per_split, next_pow2(sizes.topk + 1)))
  split = dataclasses.replace(split, block_h=sizes.group_rows, block_k=block, keys_per_split=per_split)
  return QsaDecodeConfig(split=split, combine=fit_combine(config.combine, sizes.group_rows, sizes.head_dim))


def choose_config(shapes: Mapping[str, Any], *, compress: int = 4) -> QsaDecodeConfig:
  """Heuristic: the longest split (64, 32, 16 or 8 ids) that still gives about
  one program per SM. B=1: 8-id splits (one 32-token step each), 65 splits x
  2 kv heads = 130 programs; B=23: 64-id splits, 414 programs of four 64-token
  steps. 64-token steps run 8 warps and 3 stages: on sm_90a 4 warps need
  about twice the registers, so 8 warps keep more gathers in flight per SM
  (docs/perf/kernel_notes.md)."""
  sizes = QsaDecodeSizes.of(shapes)
  num_ids = sizes.topk + 1
  per_split = 64
  while per_split > 8 and sizes.batch * sizes.kv_heads * cdiv(num_ids, per_split) < num_sms():
    per_split //= 2
  block = min(16, per_split)
  if block >= 16:
    split = SplitStage(block_k=block, keys_per_split=per_split, num_warps=8, num_stages=3)
  else:
    split = SplitStage(block_k=block, keys_per_split=per_split, num_warps=4, num_stages=2)
  return _fit(QsaDecodeConfig(split=split, combine=CombineStage(block_d=64, num_warps=4)), sizes, compress)


_SWEEP = (
    QsaDecodeConfig(SplitStage(block_k=16, keys_per_split=64, num_warps=4, num_stages=2), CombineStage(block_d=64)),
    QsaDecodeConfig(SplitStage(block_k=16, keys_per_split=64, num_warps=8, num_stages=3), CombineStage(block_d=64)),
    QsaDecodeConfig(SplitStage(block_k=32, keys_per_split=128, num_warps=8, num_stages=2), CombineStage(block_d=128)),
    QsaDecodeConfig(SplitStage(block_k=8, keys_per_split=32, num_warps=4, num_stages=2), CombineStage(block_d=32)),
    QsaDecodeConfig(SplitStage(block_k=8, keys_per_split=8, num_warps=4, num_stages=1),
                    CombineStage(block_d=32, num_warps=2)),
    QsaDecodeConfig(SplitStage(block_k=16, keys_per_split=16, num_warps=4, num_stages=1), CombineStage(block_d=64)),
)


def candidate_configs(shapes: Mapping[str, Any], *, compress: int = 4) -> list[QsaDecodeConfig]:
  """Heuristic first, then the sweep's configurations fitted to the shapes."""
  sizes = QsaDecodeSizes.of(shapes)
  return fitted_candidates(choose_config(shapes, compress=compress), _SWEEP,
                           lambda c: _fit(c, sizes, compress))


def _split_kernel(q_ref, k_ref, v_ref, pt_ref, ids_ref, len_ref, scale_ref, o_ref, lse_ref, *,
                  block_ids: int, steps: int, compress: int, page: int, max_pages: int):
  # q_ref [Gp, D] (group's heads, zero-padded); k_ref, v_ref [NP * P, D] (this
  # kv head); pt_ref [MP]; ids_ref [keys_per_split]; len_ref [1]; scale_ref [1];
  # o_ref [Gp, D] f32; lse_ref [Gp] f32 (base 2).
  seq_len = len_ref[0]
  qk_scale = scale_ref[0] * LOG2_E
  q = q_ref[...]
  rows_p, head_dim = q.shape
  block_t = block_ids * compress
  lane = jnp.arange(block_t, dtype=jnp.int32)
  cols = jnp.arange(head_dim, dtype=jnp.int32)

  def body(i, carry):
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
    return online_softmax_step(s, carry, v, visible=visible[None, :])

  o, m, l = lax.fori_loop(0, steps, body, init_carry(rows_p, head_dim))
  o_ref[...] = normalize(o, m, l)
  lse_ref[...] = lse_base2(m, l)


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
  check_pow2_dim("head dim D", head_dim)
  shapes = {"q": q, "topk_ids": topk_ids, "k_cache": k_cache}
  if config is None:
    config = choose_config(shapes, compress=compress)
  config = _fit(config, QsaDecodeSizes.of(shapes), compress)
  split = config.split
  num_ids = topk + 1
  num_splits = cdiv(num_ids, split.keys_per_split)
  group = q_heads // kv_heads
  group_p = split.block_h

  seq_lens = seq_lens.astype(jnp.int32)
  n = seq_lens // compress
  # Ids the definition ignores (>= n: only the tail's tokens, added below).
  ids = jnp.where((topk_ids >= 0) & (topk_ids < n[:, None]), topk_ids, -1).astype(jnp.int32)
  tail = jnp.where(seq_lens % compress != 0, n, -1)
  pad = num_splits * split.keys_per_split - num_ids
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
  o_part, lse_part = common.pallas_call(
      functools.partial(_split_kernel, block_ids=split.block_k,
                        steps=split.keys_per_split // split.block_k, compress=compress, page=page,
                        max_pages=max_pages),
      out_shape=(jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group_p, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group_p), jnp.float32)),
      grid=(batch, kv_heads, num_splits),
      in_specs=[
          pl.BlockSpec((None, None, group_p, head_dim), lambda b, g, s: (b, g, 0, 0)),
          kv_spec, kv_spec,
          pl.BlockSpec((None, max_pages), lambda b, g, s: (b, 0)),
          pl.BlockSpec((None, split.keys_per_split), lambda b, g, s: (b, s)),
          pl.BlockSpec((None, 1), lambda b, g, s: (b, 0)),
          pl.BlockSpec((1,), lambda b, g, s: (0,)),
      ],
      out_specs=(pl.BlockSpec((None, None, None, group_p, head_dim), lambda b, g, s: (b, g, s, 0, 0)),
                 pl.BlockSpec((None, None, None, group_p), lambda b, g, s: (b, g, s, 0))),
      compiler_params=plgpu.CompilerParams(num_warps=split.num_warps, num_stages=split.num_stages),
      interpret=interpret,
      name="qsa_sparse_gqa_split",
  )(q_p, k_flat, v_flat, page_table.astype(jnp.int32), ids, seq_lens.reshape(batch, 1), scale)

  rows = batch * kv_heads  # the combine's rows: (sequence, kv head) pairs
  out = combine_splits(o_part.reshape(rows, num_splits, group_p, head_dim),
                       lse_part.reshape(rows, num_splits, group_p), stage=config.combine,
                       out_dtype=q.dtype, name="qsa_sparse_gqa_combine", interpret=interpret)
  return out.reshape(batch, kv_heads, group_p, head_dim)[:, :, :group].reshape(batch, q_heads, head_dim)
