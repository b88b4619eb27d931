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
dot). One gather thus serves `block_h` heads; the online softmax
(`online_softmax`) runs in fp32 and base 2 (`sm_scale * log2 e` folded into
one multiply), probabilities are rounded to bf16 for the PV dot, as every
flash kernel does.

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
(the fastest of the sweep on an H200, spill-free on sm_90a), and 16 heads
with 32-slot steps for M < 32 (see `choose_config`; measurements in
docs/perf/kernel_notes.md).

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
from typing import Any, Mapping, NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels import common
import jax.numpy as jnp

from pallas_kernels.common import check_pow2_dim, fit_block, fitted_candidates, resolve_interpret
from pallas_kernels.config_rules import DOT_BLOCK, NUM_STAGES, NUM_WARPS, KernelConfig, field
from pallas_kernels.online_softmax import LOG2_E, init_carry, lse_natural, normalize, online_softmax_step


@dataclasses.dataclass(frozen=True)
class SparseMlaPrefillConfig(KernelConfig):
  """Tiling of the sparse MLA prefill kernel.

  block_h: heads per program (divides H).
  block_k: index slots (gathered rows) per step.
  block_d: output columns per program (divides D); D = no split.
  """
  block_h: int = field(32, DOT_BLOCK)
  block_k: int = field(64, DOT_BLOCK)
  block_d: int = field(512, DOT_BLOCK)
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)


class SparseMlaSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""
  m: int
  heads: int
  head_dim: int
  topk: int

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> SparseMlaSizes:
    m, heads, head_dim = shapes["q"].shape
    return cls(int(m), int(heads), int(head_dim), int(shapes["indices"].shape[-1]))


def _fit(config: SparseMlaPrefillConfig, num_heads: int, head_dim: int,
         topk: int) -> SparseMlaPrefillConfig:
  """Clamps the blocks to the problem: heads and columns to H and D, the slot
  block to TOPK rounded up to a power of two (>= 16)."""
  return dataclasses.replace(config, block_h=min(config.block_h, num_heads),
                             block_d=min(config.block_d, head_dim), block_k=fit_block(config.block_k, topk))


# What a sweep explores, before fitting. Shared memory: the resident q tile
# (block_h * 512 * 2 B) plus the gathered tiles of the pipeline stages
# (block_k * 512 * 2 B each) and a conversion buffer; 64 heads x 64 slots at
# two stages does not fit an H100/H200 CTA, so it is not listed. The 32-head
# tilings run mma.sync (32 rows are below wgmma's 64 per warpgroup), the
# 64-head ones wgmma; the 4-warp tilings of 32 heads or 64-slot steps spill
# on sm_90a but stay for the sweep to measure. 128-slot and 16-slot steps
# were slower everywhere on an H200 (timings and register counts:
# docs/perf/kernel_notes.md).
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
  k640 sizes, spill-free on sm_90a), two pipeline stages for TOPK > 128 and
  three for TOPK <= 128 (two slot blocks, both prefetched, measured faster
  at k128). The 4-warp 32-head variants spill.

  Small M (< 32 rows, decode-like): the grid of 2 x M programs is far from
  filling the GPU and each program's serial slot loop is the latency, so
  16-head programs with 32-slot steps at 4 warps (spill-free) double the
  grid and shorten each step: faster on an H200 at M = 1 and 16, slower at
  M = 64 (docs/perf/kernel_notes.md)."""
  m, h, d, topk = SparseMlaSizes.of(shapes)
  if m < 32:
    config = SparseMlaPrefillConfig(block_h=16, block_k=32, block_d=512, num_warps=4, num_stages=2)
  else:
    config = SparseMlaPrefillConfig(num_warps=8, num_stages=2 if topk > 128 else 3)
  return _fit(config, h, d, topk)


def candidate_configs(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> list[SparseMlaPrefillConfig]:
  """The sweep's configurations fitted to the problem, heuristic first."""
  _, h, d, topk = SparseMlaSizes.of(shapes)
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
    if split_d:
      v = jnp.where(valid[:, None], kv_ref[rows, d_cols], 0.0).astype(kv_ref.dtype)  # [bk, bd]
    else:
      v = k
    return online_softmax_step(s, carry, v, visible=valid[None, :])

  acc, m, l = lax.fori_loop(limits_ref[0], limits_ref[1], body, init_carry(block_h, block_d))
  out_ref[...] = normalize(acc, m, l, sink_ref[...]).astype(out_ref.dtype)
  lse_ref[...] = lse_natural(m, l)


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
  check_pow2_dim("head dim D", head_dim)
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
  qk_scale = jnp.full((num_heads,), jnp.asarray(sm_scale, jnp.float32) * LOG2_E, jnp.float32)

  kernel = functools.partial(_sparse_mla_prefill_kernel, num_kv=num_kv, topk=topk,
                             block_k=block_k, block_d=block_d, split_d=block_d < head_dim)
  head_spec = pl.BlockSpec((block_h,), lambda g, c, i: (g,))
  out, lse = common.pallas_call(
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
