"""DeepSeek sparse MLA prefill (FlashMLA `flash_mla_sparse_fwd` semantics) on
the Pallas Triton lowering.

Math, per query row m and head h, over the valid slots t of `indices[m, 0, :]`
(valid: `0 <= idx < Nkv`; -1 and `>= Nkv` are invalid):
  P[t]      = q[m, h, :] . kv[idx_t, 0, :] * sm_scale
  lse[m, h] = log(sum_t exp(P[t]))                  natural log, no sink
  out[m, h] = sum_t exp(P[t]) kv[idx_t] / (sum_t exp(P[t]) + exp(attn_sink[h]))
The sink adds to the denominator only. A row with no valid slot (lonely)
outputs 0 and lse = +inf.

Design. MLA has one latent KV head of width D = 512 that serves as both key
and value, shared by all H = 64 query heads. A program owns ONE query row and
`block_h` heads (a `[block_h, D]` q tile), and walks that row's TOPK index
slots `block_k` at a time: it loads the `block_k` indices, gathers those
workspace rows once (`kv_ref[idx, :]`, a `[block_k, D]` tile) and uses the
tile twice, as K for the scores `[block_h, block_k]` (one `q . K^T` dot on
tensor cores) and as V for the output update `[block_h, D]` (the second
dot). One gather thus serves `block_h` heads; the online softmax runs in fp32
and base 2 (`sm_scale * log2 e` folded into one multiply), probabilities are
rounded to bf16 for the PV dot, as every flash kernel does.

Registers: the fp32 accumulator `[block_h, block_d]` is the big resident
(64 x 512 x 4 B = 128 KiB for all heads at once: 128 registers a thread at 8
warps, before q, scores and the gathered tile). Two knobs bound it:
* `block_h` (16, 32 or 64) splits the heads over programs; each head group
  gathers the same rows again (mostly from L2: the head groups of a row run
  next to each other, grid axis 0 varies fastest);
* `block_d` < D splits the OUTPUT columns over programs: each program still
  computes the full-width scores (the QK contraction needs all 512 dims, so
  the QK work is repeated D / block_d times) but accumulates only `block_d`
  columns of V, gathered as a separate column slice.
The heuristic takes `block_h = 32, block_k = 64, block_d = 512` at 8 warps
(the fastest measured on an H200; 225-237 registers, no spills for sm_90a),
and 16 heads with 32-slot steps for M < 32 (see `choose_config`).

Masks and skipping: invalid slots get score -inf (probability exactly 0) and
gather row 0 in their place, zeroed after the load (a masked gather does not
run in interpret mode; the row is in bounds and hot in cache); the
ragged last slot block (TOPK not a multiple of `block_k`) is masked too. A
small per-row table computed by XLA before the launch
(`slot_block_limits`) gives the first and one-past-last slot block holding a
valid index, so runs of -1 padding at either end (the synthesized k640 rows
of early queries) are skipped; interior invalid slots are masked.

Grid: `(H / block_h, D / block_d, M)`, head group fastest.
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

from pallas_kernels.common import MIN_DOT_DIM, check_dot_blocks, fitted_candidates, online_softmax_weights, resolve_interpret

_LOG2_E = math.log2(math.e)
_LN_2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class SparseMlaPrefillConfig:
  """Tiling of the sparse MLA prefill kernel (powers of two >= 16).

  block_h: heads per program (divides H).
  block_k: index slots (gathered rows) per step.
  block_d: output columns per program (divides D); D = no split.
  """
  block_h: int = 32
  block_k: int = 64
  block_d: int = 512
  num_warps: int = 8
  num_stages: int = 2

  def __post_init__(self):
    check_dot_blocks(self, "block_h", "block_k", "block_d")
    if self.num_warps < 1 or self.num_stages < 1:
      raise ValueError(f"bad num_warps/num_stages in {self}")


def _fit(config: SparseMlaPrefillConfig, num_heads: int, head_dim: int,
         topk: int) -> SparseMlaPrefillConfig:
  """Clamps the blocks to the problem: heads and columns to H and D, the slot
  block to TOPK rounded up to a power of two (>= 16)."""
  block_k = max(MIN_DOT_DIM, min(config.block_k, 1 << max(topk - 1, 0).bit_length()))
  return dataclasses.replace(config, block_h=min(config.block_h, num_heads),
                             block_d=min(config.block_d, head_dim), block_k=block_k)


def _problem(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> tuple[int, int, int, int]:
  """(M, H, D, TOPK) of the definition's input shapes."""
  m, h, d = shapes["q"].shape
  topk = shapes["indices"].shape[-1]
  return int(m), int(h), int(d), int(topk)


# What a sweep explores, before fitting. Shared memory: the resident q tile
# (block_h * 512 * 2 B) plus the gathered tiles of the pipeline stages
# (block_k * 512 * 2 B each) and a conversion buffer; 64 heads x 64 slots at
# two stages asks for 256.5 KiB and fails on an H200 (227 KiB), so it is not
# listed.
#
# sm_90a compiles (XLA's Triton + ptxas 12.9, k640 at the largest recorded
# axes): the 8-warp 32-head tilings use 225-237 registers without spills and
# mma.sync (block_h = 32 is below wgmma's 64 rows per warpgroup); the
# 64-head tilings use wgmma at 255 registers (no spills at 8 warps and 2
# stages); the 4-warp tilings of 32 heads or 64-slot steps spill 64-620
# bytes.
#
# Measured on one H200 (jax 0.11.2), ms, k640 at M=4096, Nkv=277247 / k128
# at M=4096, Nkv=4223: (32,64,512,8w,2s) 3.0-3.3 / 1.2-1.35;
# (32,64,512,8w,3s) 3.4 / 1.11; (32,64,512,4w,2s) 4.2 / 1.01;
# (64,32,512,8w,1s) 4.6 / 1.15; (64,32,512,8w,2s) 3.5 / -;
# (64,32,256,4w,2s) 3.9 / -; (16,64,512,4w,2s) 4.3 / -; block_k = 128 and
# 16-slot steps were slower everywhere.
_SWEEP_CONFIGS = (
    SparseMlaPrefillConfig(block_h=32, block_k=64, block_d=512, num_warps=8, num_stages=2),
    SparseMlaPrefillConfig(block_h=32, block_k=64, block_d=512, num_warps=8, num_stages=3),
    SparseMlaPrefillConfig(block_h=32, block_k=64, block_d=512, num_warps=4, num_stages=2),
    SparseMlaPrefillConfig(block_h=64, block_k=32, block_d=512, num_warps=8, num_stages=2),
    SparseMlaPrefillConfig(block_h=64, block_k=32, block_d=512, num_warps=8, num_stages=1),
    SparseMlaPrefillConfig(block_h=32, block_k=32, block_d=512, num_warps=4, num_stages=2),
    SparseMlaPrefillConfig(block_h=16, block_k=32, block_d=512, num_warps=4, num_stages=2),
    SparseMlaPrefillConfig(block_h=16, block_k=64, block_d=512, num_warps=4, num_stages=2),
    SparseMlaPrefillConfig(block_h=64, block_k=64, block_d=256, num_warps=8, num_stages=2),
    SparseMlaPrefillConfig(block_h=64, block_k=32, block_d=256, num_warps=4, num_stages=2),
)


def choose_config(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> SparseMlaPrefillConfig:
  """Heuristic: 32 heads x all 512 output columns per program, 64 gathered
  rows a step, 8 warps (the fastest of the sweep on an H200 at the recorded
  k640 sizes; 237 registers, no spills for sm_90a), two pipeline stages for
  TOPK > 128 and three for TOPK <= 128 (two slot blocks, both prefetched:
  0.98-1.14 ms against 1.2-1.35 ms at k128, M=4096; 225 registers, no
  spills). The 4-warp 32-head variants spill.

  Small M (< 32 rows, decode-like): the grid of 2 x M programs is far from
  filling 132 SMs and each program's serial slot loop is the latency, so
  16-head programs with 32-slot steps at 4 warps (204 registers, no spills)
  double the grid and shorten each step: measured 159 / 170 us at M = 1 /
  16 (TOPK 640) against 208 / 223 us for the default tiling; at M = 64 the
  default is faster (202 against 228 us)."""
  m, h, d, topk = _problem(shapes)
  if m < 32:
    config = SparseMlaPrefillConfig(block_h=16, block_k=32, block_d=512, num_warps=4, num_stages=2)
  else:
    config = SparseMlaPrefillConfig(num_warps=8, num_stages=2 if topk > 128 else 3)
  return _fit(config, h, d, topk)


def candidate_configs(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> list[SparseMlaPrefillConfig]:
  """The sweep's configurations fitted to the problem, heuristic first."""
  _, h, d, topk = _problem(shapes)
  return fitted_candidates(choose_config(shapes), _SWEEP_CONFIGS, lambda c: _fit(c, h, d, topk))


def slot_block_limits(indices: jax.Array, num_kv: int, block_k: int) -> jax.Array:
  """`[M, 2]` int32: per query row, the first slot block holding a valid
  index and one past the last (both 0 for a lonely row). `indices [M, TOPK]`."""
  topk = indices.shape[-1]
  valid = (indices >= 0) & (indices < num_kv)
  any_valid = jnp.any(valid, axis=-1)
  first = jnp.argmax(valid, axis=-1)
  end = topk - jnp.argmax(valid[:, ::-1], axis=-1)
  start_block = jnp.where(any_valid, first // block_k, 0)
  end_block = jnp.where(any_valid, (end + block_k - 1) // block_k, 0)
  return jnp.stack([start_block, end_block], axis=-1).astype(jnp.int32)


def _sparse_mla_prefill_kernel(q_ref, kv_ref, idx_ref, limits_ref, sink_ref, scale_ref,
                               out_ref, lse_ref, *, num_kv: int, topk: int, block_k: int,
                               block_d: int, split_d: bool):
  # q_ref [bh, D]; kv_ref [Nkv, D]; idx_ref [TOPK]; limits_ref [2];
  # sink_ref, scale_ref [bh] (scale in base 2); out_ref [bh, bd]; lse_ref [bh].
  block_h = q_ref.shape[0]
  q = q_ref[...]
  qk_scale = scale_ref[...]
  d_cols = pl.ds(pl.program_id(1) * block_d, block_d)

  def body(block, carry):
    acc, m_prev, l_prev = carry
    start = block * block_k
    slots = pl.ds(start, block_k)
    in_range = start + jnp.arange(block_k) < topk
    idx = plgpu.load(idx_ref.at[slots], mask=in_range, other=-1)
    valid = (idx >= 0) & (idx < num_kv)
    rows = jnp.where(valid, idx, 0)
    # Invalid slots read row 0 and are zeroed: their probability is exactly 0,
    # and 0 * NaN would be NaN should that row hold garbage.
    k = jnp.where(valid[:, None], kv_ref[rows, :], 0.0).astype(kv_ref.dtype)  # [bk, D]
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * qk_scale[:, None]
    s = jnp.where(valid[None, :], s, -jnp.inf)
    p, correction, m_next, l_next = online_softmax_weights(s, m_prev, l_prev)
    if split_d:
      v = jnp.where(valid[:, None], kv_ref[rows, d_cols], 0.0).astype(kv_ref.dtype)  # [bk, bd]
    else:
      v = k
    acc = correction[:, None] * acc + jnp.dot(p.astype(v.dtype), v,
                                              preferred_element_type=jnp.float32)
    return acc, m_next, l_next

  carry = (jnp.zeros((block_h, block_d), jnp.float32),
           jnp.full((block_h,), -jnp.inf, jnp.float32),
           jnp.zeros((block_h,), jnp.float32))
  acc, m, l = lax.fori_loop(limits_ref[0], limits_ref[1], body, carry)

  seen = l > 0.0
  m_safe = jnp.where(seen, m, 0.0)
  # Denominator in the running scale 2**m: sum_t 2**(s_t - m) + exp(sink) / 2**m.
  denom = l + jnp.exp2(sink_ref[...] * _LOG2_E - m_safe)
  out = acc * jnp.where(seen, 1.0 / denom, 0.0)[:, None]
  out_ref[...] = out.astype(out_ref.dtype)
  lse_ref[...] = jnp.where(seen, (m_safe + jnp.log2(jnp.where(seen, l, 1.0))) * _LN_2, jnp.inf)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def sparse_mla_prefill(q: jax.Array, kv: jax.Array, indices: jax.Array, sm_scale: jax.Array | float,
                       attn_sink: jax.Array, *, config: SparseMlaPrefillConfig | None = None,
                       interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Sparse MLA prefill attention with an attention sink.

  Args:
    q: `[M, H, D]` bf16 queries (D a power of two >= 16, e.g. 512).
    kv: `[Nkv, 1, D]` latent workspace, same dtype as q (key and value).
    indices: `[M, 1, TOPK]` int32 workspace rows per query row; negative or
      `>= Nkv` = invalid slot.
    sm_scale: scalar (python float or 0-d array, may be traced).
    attn_sink: `[H]` f32 per-head sink logits (denominator only).
    config: tiling; None = `choose_config`. Blocks are clamped to the problem.
    interpret: None = interpret when no GPU is present.

  Returns:
    `(out [M, H, D] q.dtype, lse [M, H] f32)`; lonely rows give 0 and +inf.
  """
  m, num_heads, head_dim = q.shape
  num_kv = kv.shape[0]
  if kv.ndim != 3 or kv.shape[1] != 1 or kv.shape[2] != head_dim:
    raise ValueError(f"kv {kv.shape} must be [Nkv, 1, {head_dim}]")
  if indices.ndim != 3 or indices.shape[:2] != (m, 1):
    raise ValueError(f"indices {indices.shape} must be [{m}, 1, TOPK]")
  if kv.dtype != q.dtype:
    raise ValueError(f"q and kv dtypes differ: {q.dtype}, {kv.dtype}")
  if attn_sink.shape != (num_heads,):
    raise ValueError(f"attn_sink {attn_sink.shape} must be [{num_heads}]")
  if head_dim < MIN_DOT_DIM or head_dim & (head_dim - 1):
    raise ValueError(f"D={head_dim} must be a power of two >= {MIN_DOT_DIM}")
  topk = indices.shape[-1]
  shapes = {"q": jax.ShapeDtypeStruct(q.shape, q.dtype),
            "indices": jax.ShapeDtypeStruct(indices.shape, indices.dtype)}
  config = _fit(config or choose_config(shapes), num_heads, head_dim, topk)
  block_h, block_k, block_d = config.block_h, config.block_k, config.block_d
  if num_heads % block_h or head_dim % block_d:
    raise ValueError(f"block_h={block_h} / block_d={block_d} must divide H={num_heads} / D={head_dim}")
  if m == 0:
    return (jnp.zeros(q.shape, q.dtype), jnp.full((0, num_heads), jnp.inf, jnp.float32))

  idx = indices.reshape(m, topk).astype(jnp.int32)
  limits = slot_block_limits(idx, num_kv, block_k)
  sink = attn_sink.astype(jnp.float32)
  qk_scale = jnp.full((num_heads,), jnp.asarray(sm_scale, jnp.float32) * _LOG2_E, jnp.float32)

  kernel = functools.partial(_sparse_mla_prefill_kernel, num_kv=num_kv, topk=topk,
                             block_k=block_k, block_d=block_d, split_d=block_d < head_dim)
  head_spec = pl.BlockSpec((block_h,), lambda g, c, i: (g,))
  out, lse = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((m, num_heads), jnp.float32)),
      grid=(num_heads // block_h, head_dim // block_d, m),
      in_specs=[
          pl.BlockSpec((None, block_h, head_dim), lambda g, c, i: (i, g, 0)),
          # The whole workspace; the kernel gathers rows from it.
          pl.BlockSpec((num_kv, None, head_dim), lambda g, c, i: (0, 0, 0)),
          pl.BlockSpec((None, topk), lambda g, c, i: (i, 0)),
          pl.BlockSpec((None, 2), lambda g, c, i: (i, 0)),
          head_spec,
          head_spec,
      ],
      out_specs=(pl.BlockSpec((None, block_h, block_d), lambda g, c, i: (i, g, c)),
                 pl.BlockSpec((None, block_h), lambda g, c, i: (i, g))),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=resolve_interpret(interpret),
      name="sparse_mla_prefill",
  )(q, kv, idx, limits, sink, qk_scale)
  return out, lse
