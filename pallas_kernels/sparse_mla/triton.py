"""DeepSeek sparse MLA prefill (FlashMLA `flash_mla_sparse_fwd` semantics) on
the Pallas Triton lowering.

Math, per query row m and head h, over the valid slots t of `indices[m, 0, :]`
(valid: `0 <= idx < Nkv`; negative and `>= Nkv` are invalid and contribute
nothing):
  P[t]      = q[m, h, :] . kv[idx_t, 0, :] * sm_scale
  lse[m, h] = log(sum_t exp(P[t]))                  natural log, no sink
  out[m, h] = sum_t exp(P[t]) kv[idx_t] / (sum_t exp(P[t]) + exp(attn_sink[h]))
The sink adds to the denominator only. A row with no valid slot (lonely)
outputs 0 and lse = +inf.

Design. MLA has one latent KV head of width D = 512 that serves as both key
and value, shared by all H = 64 query heads. A program owns ONE query row and
`block_h` heads (a `[block_h, D]` q tile; 64 heads = one wgmma row tile on
sm_90a, below that Triton falls back to mma.sync) and walks that row's index
slots `block_k` at a time: it gathers those workspace rows once and uses the
tile twice, as K for the scores `[block_h, block_k]` and as V for the output
update `[block_h, D]`. One gather serves `block_h` heads; the online softmax
(`online_softmax`) runs in fp32 and base 2 (`sm_scale * log2 e` folded into
one multiply), probabilities are rounded to bf16 for the PV dot, as every
flash kernel does.

D in chunks: the gathered tile, q and the accumulator are handled as
`D / block_d` column chunks (`[block_k, block_d]` gathers, scores as the sum
of the chunks' `q_c . K_c^T` dots, the output accumulated per chunk). The
arithmetic is the same as with whole rows; what changes is what Triton
keeps in shared memory: 64 heads x 64 slots with whole 512-wide rows asked
for 256.5 KiB (more than an H100/H200 CTA has), with 128-wide chunks the
resident q tile plus two pipeline stages of the gathered tile fit in 192 KiB
(docs/perf/kernel_notes.md).

With `prefetch` the loop carries the next slot block's indices: each step
loads the indices of the step after it before it gathers its own rows, so
the gather never waits on its index load (at a cost in registers).

Split over TOPK (small M). The grid is `(H / block_h, splits, M)`. With
`splits > 1` the row's slot blocks are cut into `splits` contiguous runs, one
program each, that write fp32 partials (normalized output, base-2 lse) which
the shared `split_kv.combine_splits` merges with the sink (a second launch).
The heuristic splits only when the grid would otherwise be under two waves
of programs on the GPU's SMs.

Masks and skipping: invalid slots gather row 0 in their place, are zeroed
with `where` after the load (never multiplied by a mask: garbage or NaN in
that row cannot leak) and get score -inf (probability exactly 0); the
ragged last slot block (TOPK not a multiple of `block_k`) is masked too. A
small per-row table computed by XLA before the launch (`slot_block_limits`)
gives the first and one-past-last slot block holding a valid index, so runs
of -1 padding at either end (the synthesized k640 rows of early queries) are
skipped; interior invalid slots are masked.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.shared import common
from pallas_kernels.shared.common import MIN_DOT_DIM, cdiv, fit_block, resolve_interpret
from pallas_kernels.shared.device import num_sms
from pallas_kernels.shared.online_softmax import (
  LOG2_E,
  init_carry,
  lse_base2,
  lse_natural,
  normalize,
  online_softmax_step,
)
from pallas_kernels.shared.split_kv import combine_splits
from pallas_kernels.sparse_mla.config import SparseMlaPrefillConfig
from pallas_kernels.sparse_mla.slots import (
  SparseMlaSizes,
  blocks_per_split,
  check_inputs,
  slot_block_limits,
  split_runs,
)

# The TOPK splits the heuristic makes at most. Each split costs a 128 KiB
# fp32 partial per row and head group (written, then read by the combine),
# more than the 32-64 KiB of rows a split of one or two slot blocks
# gathers; four reach two waves at M = 128 (the smallest recorded M) for
# both TOPKs. Below M = 66, where more splits would still add programs,
# nothing is recorded; and the combine's cost in interpret mode grows with
# splits x programs (the CPU-scale runs use M = 16).
MAX_SPLITS = 4


def _fit(config: SparseMlaPrefillConfig, sizes: SparseMlaSizes) -> SparseMlaPrefillConfig:
  """Clamps the blocks to the problem: heads and chunk columns to H and D,
  the slot block to TOPK rounded up to a power of two (>= 16), and `splits`
  to the number of runs the slot blocks actually cut into (no empty split)."""
  block_k = fit_block(config.block_k, sizes.topk)
  splits = split_runs(sizes.topk, block_k, config.splits)
  return dataclasses.replace(
    config,
    block_h=min(config.block_h, sizes.heads),
    block_k=block_k,
    block_d=min(config.block_d, sizes.head_dim),
    splits=splits,
  )


def split_for(sizes: SparseMlaSizes, config: SparseMlaPrefillConfig, target_programs: int) -> SparseMlaPrefillConfig:
  """`config` fitted, with the fewest TOPK splits (at most `MAX_SPLITS`, and
  as many as the slot blocks allow) that give `target_programs` programs.
  The slot step shrinks from `block_k` (down to 16) only when it cannot cut
  the row into enough runs. Unsplit when the grid is large enough."""
  config = _fit(config, sizes)
  rows = sizes.m * cdiv(sizes.heads, config.block_h)
  if rows == 0 or rows >= target_programs:
    return config
  want = min(cdiv(target_programs, rows), MAX_SPLITS)
  block_k = config.block_k
  while block_k > MIN_DOT_DIM and cdiv(sizes.topk, block_k) < want:
    block_k //= 2
  blocks = cdiv(sizes.topk, block_k)
  reach = min(want, blocks)
  fitted = (_fit(dataclasses.replace(config, block_k=block_k, splits=s), sizes) for s in range(reach, blocks + 1))
  return next(c for c in fitted if c.splits >= reach)  # splits=blocks always reaches


# What a sweep explores, before fitting (and before the heuristic's TOPK
# split, applied to each). Shared memory: the resident q tile (block_h * D
# * 2 B) plus the gathered tiles of the pipeline stages (block_k * D * 2 B
# each): 64 heads x 64 slots x 2 stages is 192 KiB. The 64-head tilings run
# wgmma at the register limit, the 32- and 16-head ones mma.sync. The index
# carry (`prefetch`) costs registers. The 64-head tilings compile without
# spills with jax 0.12's Triton but spill with jax 0.11.2's (the GPU
# machine's), the 32- and 16-head ones are clean with both (figures:
# docs/perf/sm90a_compile.md, docs/perf/kernel_notes.md).
_SWEEP_CONFIGS = (
  SparseMlaPrefillConfig(block_h=64, block_k=64, block_d=128, num_warps=8, num_stages=2, prefetch=True),
  SparseMlaPrefillConfig(block_h=64, block_k=64, block_d=128, num_warps=8, num_stages=2, prefetch=False),
  SparseMlaPrefillConfig(block_h=64, block_k=32, block_d=128, num_warps=8, num_stages=3, prefetch=False),
  SparseMlaPrefillConfig(block_h=64, block_k=32, block_d=128, num_warps=8, num_stages=2, prefetch=False),
  SparseMlaPrefillConfig(block_h=64, block_k=64, block_d=128, num_warps=8, num_stages=1, prefetch=False),
  SparseMlaPrefillConfig(block_h=32, block_k=64, block_d=128, num_warps=8, num_stages=2, prefetch=True),
  SparseMlaPrefillConfig(block_h=32, block_k=64, block_d=128, num_warps=8, num_stages=3, prefetch=False),
  SparseMlaPrefillConfig(block_h=32, block_k=64, block_d=512, num_warps=8, num_stages=2, prefetch=False),
  SparseMlaPrefillConfig(block_h=16, block_k=32, block_d=128, num_warps=4, num_stages=2, prefetch=True),
)


def choose_config(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> SparseMlaPrefillConfig:
  """Heuristic: 32 heads (mma.sync), 64 gathered rows a step, 128-column
  chunks, no index carry, 8 warps, two pipeline stages: a tiling that
  compiles for sm_90a without spills, split or not, with both jax 0.11.2's
  and 0.12's Triton (the 64-head wgmma tilings spill with 0.11.2's); when
  M x H / 32 programs are fewer than two waves on the GPU's SMs, the
  fewest TOPK splits that reach two waves (at M = 128: 2 splits for both
  TOPKs)."""
  sizes = SparseMlaSizes.of(shapes)
  return split_for(sizes, SparseMlaPrefillConfig(), 2 * num_sms())


def candidate_configs(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> list[SparseMlaPrefillConfig]:
  """The sweep's configurations, fitted and split like the heuristic's,
  heuristic first, then the heuristic's tiling without its split (whether
  the split pays at a given M is for the sweep to measure)."""
  sizes = SparseMlaSizes.of(shapes)
  chosen = choose_config(shapes)
  split = lambda c: split_for(sizes, c, 2 * num_sms())
  return list(
    dict.fromkeys([chosen, *(split(c) for c in _SWEEP_CONFIGS), _fit(dataclasses.replace(chosen, splits=1), sizes)])
  )


def _sparse_mla_prefill_kernel(
  q_ref,
  kv_ref,
  idx_ref,
  limits_ref,
  sink_ref,
  scale_ref,
  out_ref,
  lse_ref,
  *,
  num_kv: int,
  topk: int,
  block_k: int,
  block_d: int,
  blocks_per_split: int,
  split: bool,
  prefetch: bool,
):
  # q_ref [bh, D]; kv_ref [Nkv, D]; idx_ref [TOPK]; limits_ref [2]; sink_ref,
  # scale_ref [bh] (scale in base 2). Unsplit: out_ref [bh, D] (q dtype),
  # lse_ref [bh] natural; split: out_ref [bh, D] f32 partial, lse_ref [bh]
  # base 2 (split_kv's partials).
  block_h, head_dim = q_ref.shape
  chunks = [pl.ds(c * block_d, block_d) for c in range(head_dim // block_d)]
  q_parts = [q_ref[:, cols] for cols in chunks]
  qk_scale = scale_ref[...]
  num_blocks = cdiv(topk, block_k)
  # This program's run of slot blocks (all of them unsplit), cut to the
  # row's valid ones. (Applied unsplit too: the same bounds compile without
  # the 8 bytes of spills the 64-head tile otherwise shows on sm_90a.)
  run = pl.program_id(1) * blocks_per_split
  first = jnp.maximum(limits_ref[0], run)
  end = jnp.minimum(limits_ref[1], run + blocks_per_split)

  def load_indices(block):
    # Clamped: the prefetch after the last block reloads an in-range one.
    start = jnp.minimum(block, num_blocks - 1) * block_k
    in_range = start + jnp.arange(block_k) < topk
    return plgpu.load(idx_ref.at[pl.ds(start, block_k)], mask=in_range, other=-1)

  def step(idx, carry):
    """Folds the slot block with indices `idx` into the carry."""
    valid = (idx >= 0) & (idx < num_kv)
    rows = jnp.where(valid, idx, 0)
    # Invalid slots read row 0 and are selected away (0 * NaN would be NaN
    # should that row hold garbage); their scores become -inf below.
    k_parts = [jnp.where(valid[:, None], kv_ref[rows, cols], 0.0).astype(kv_ref.dtype) for cols in chunks]
    s = None
    for q_c, k_c in zip(q_parts, k_parts):
      part = jnp.dot(q_c, k_c.T, preferred_element_type=jnp.float32)
      s = part if s is None else s + part
    return online_softmax_step(s * qk_scale[:, None], carry, k_parts, visible=valid[None, :])

  init = init_carry(block_h, block_d, parts=len(chunks))
  if prefetch:  # the carry holds the next block's indices, loaded a step early

    def body(block, state):
      carry, idx = state
      next_idx = load_indices(block + 1)
      return step(idx, carry), next_idx

    (acc, m, l), _ = lax.fori_loop(first, end, body, (init, load_indices(first)))
  else:
    acc, m, l = lax.fori_loop(first, end, lambda block, carry: step(load_indices(block), carry), init)
  parts = normalize(acc, m, l, None if split else sink_ref[...])
  for cols, part in zip(chunks, parts):
    out_ref[:, cols] = part.astype(out_ref.dtype)
  lse_ref[...] = lse_base2(m, l) if split else lse_natural(m, l)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def sparse_mla_prefill(
  q: jax.Array,
  kv: jax.Array,
  indices: jax.Array,
  sm_scale: jax.Array | float,
  attn_sink: jax.Array,
  *,
  config: SparseMlaPrefillConfig | None = None,
  interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Sparse MLA prefill attention with an attention sink.

  Args:
    q: `[M, H, D]` bf16 queries (D a power of two >= 16, e.g. 512); M >= 0.
    kv: `[Nkv, 1, D]` latent workspace, same dtype as q (key and value).
    indices: `[M, 1, TOPK]` int32 workspace rows per query row. Valid:
      `0 <= idx < Nkv`; anything else (-1 padding, other negatives, `>= Nkv`)
      is an invalid slot that contributes nothing. Duplicates count once per
      slot, as in the reference.
    sm_scale: scalar (python float or 0-d array, may be traced).
    attn_sink: `[H]` f32 per-head sink logits (denominator only).
    config: tiling; None = `choose_config`. Blocks are clamped to the problem.
    interpret: None = interpret when no GPU is present.

  Returns:
    `(out [M, H, D] q.dtype, lse [M, H] f32)`; lonely rows give 0 and +inf.
  """
  check_inputs(q, kv, indices, attn_sink)
  m, num_heads, head_dim = q.shape
  num_kv = kv.shape[0]
  topk = indices.shape[-1]
  sizes = SparseMlaSizes(m, num_heads, head_dim, topk)
  shapes = {"q": jax.ShapeDtypeStruct(q.shape, q.dtype), "indices": jax.ShapeDtypeStruct(indices.shape, indices.dtype)}
  config = _fit(config or choose_config(shapes), sizes)
  block_h, block_k, block_d, splits = config.block_h, config.block_k, config.block_d, config.splits
  if num_heads % block_h or head_dim % block_d:
    raise ValueError(f"block_h={block_h} / block_d={block_d} must divide H={num_heads} / D={head_dim}")
  if m == 0 or topk == 0 or num_kv == 0:  # nothing to launch: every row is lonely
    return (jnp.zeros(q.shape, q.dtype), jnp.full((m, num_heads), jnp.inf, jnp.float32))

  idx = indices.reshape(m, topk).astype(jnp.int32)
  limits = slot_block_limits(idx, num_kv, block_k)
  sink = attn_sink.astype(jnp.float32)
  qk_scale = jnp.full((num_heads,), jnp.asarray(sm_scale, jnp.float32) * LOG2_E, jnp.float32)
  split = splits > 1
  kernel = functools.partial(
    _sparse_mla_prefill_kernel,
    num_kv=num_kv,
    topk=topk,
    block_k=block_k,
    block_d=block_d,
    blocks_per_split=blocks_per_split(topk, block_k, splits),
    split=split,
    prefetch=config.prefetch,
  )
  head_spec = pl.BlockSpec((block_h,), lambda g, s, i: (g,))
  if split:
    out_shape = (
      jax.ShapeDtypeStruct((m, splits, num_heads, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((m, splits, num_heads), jnp.float32),
    )
    out_specs = (
      pl.BlockSpec((None, None, block_h, head_dim), lambda g, s, i: (i, s, g, 0)),
      pl.BlockSpec((None, None, block_h), lambda g, s, i: (i, s, g)),
    )
  else:
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((m, num_heads), jnp.float32))
    out_specs = (
      pl.BlockSpec((None, block_h, head_dim), lambda g, s, i: (i, g, 0)),
      pl.BlockSpec((None, block_h), lambda g, s, i: (i, g)),
    )
  interpret = resolve_interpret(interpret)
  out, lse = common.pallas_call(
    kernel,
    out_shape=out_shape,
    grid=(num_heads // block_h, splits, m),
    in_specs=[
      pl.BlockSpec((None, block_h, head_dim), lambda g, s, i: (i, g, 0)),
      # The whole workspace; the kernel gathers rows from it.
      pl.BlockSpec((num_kv, None, head_dim), lambda g, s, i: (0, 0, 0)),
      pl.BlockSpec((None, topk), lambda g, s, i: (i, 0)),
      pl.BlockSpec((None, 2), lambda g, s, i: (i, 0)),
      head_spec,
      head_spec,
    ],
    out_specs=out_specs,
    compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    interpret=interpret,
    name="sparse_mla_prefill",
  )(q, kv, idx, limits, sink, qk_scale)
  if not split:
    return out, lse
  return combine_splits(
    out,
    lse,
    sink,
    stage=config.combine,
    out_dtype=q.dtype,
    with_lse=True,
    name="sparse_mla_prefill_combine",
    interpret=interpret,
  )
