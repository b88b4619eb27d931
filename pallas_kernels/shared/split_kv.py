"""Split-KV decoding ("flash decoding"): the split stage's config and the one
combine every split kernel uses.

A split kernel cuts the key slots of each output row into S splits, one
program each, and writes per split s two partial results:

* `o_part[r, s, h, :]`: the split's softmax output, already normalized
  (`online_softmax.normalize`; 0 when the split saw no key), fp32;
* `lse_part[r, s, h]`: its log-sum-exp **in base 2**, `m_s + log2(l_s)` of
  scores scaled by `LOG2_E * sm_scale`, i.e. the natural lse times log2(e);
  -inf for an empty split (`online_softmax.lse_base2`).

Base 2 because that is what the online softmax carries: the split kernels
write their state as it is, and the combine's weights are single exp2s.

`combine_splits` merges them per row r and head h (one Pallas kernel):

    m   = max_s lse_s
    w_s = 2**(lse_s - m)                  0 for empty splits
    out = sum_s w_s o_s / (sum_s w_s + exp(sink_h) / 2**m)
    lse = (m + log2(sum_s w_s)) * ln 2    natural log, without the sink

rounded once to the output dtype. A lonely row (every split empty) gives
`out = 0` and `lse = +inf`. The sink (optional, one logit per head in natural
units) only enlarges the denominator.

It walks the splits once, `block_s` of them a step (one `[block_s, block_h,
block_d]` load, masked past the last split), keeping a running maximum and
rescaling what it summed so far when the maximum grows: the online softmax
with the splits' lses as scores. One pass over the partials, and a loop whose
loads Triton pipelines (`num_stages`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.shared import common
from pallas_kernels.shared.common import cdiv, next_pow2, resolve_interpret
from pallas_kernels.shared.config_rules import DOT_BLOCK, NUM_STAGES, NUM_WARPS, KernelConfig, field, multiple_of, pow2
from pallas_kernels.shared.online_softmax import lse_natural, normalize


@dataclasses.dataclass(frozen=True)
class SplitStage(KernelConfig):
  """The split stage: a program owns `keys_per_split` key slots of one row
  (fewer slots: more programs and more partials) for `block_h` query heads
  (the rows of both dots), walked `block_k` slots per step. What a slot is
  belongs to the kernel (a gathered token, or a block of tokens); each kernel
  fits `block_k` up to what its dots need."""

  block_h: int = field(16, DOT_BLOCK)
  block_k: int = field(32, pow2())
  keys_per_split: int = field(64, pow2(), multiple_of("block_k"))
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class CombineStage(KernelConfig):
  """The combine: a program merges the splits of `block_h` heads x `block_d`
  output columns of one row, `block_s` splits a step. No dot: any power of
  two of heads works."""

  block_h: int = field(16, pow2())
  block_d: int = field(64, pow2(16))
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)
  block_s: int = field(4, pow2())


def fit_combine(stage: CombineStage, heads: int, head_dim: int, num_splits: int | None = None) -> CombineStage:
  """Shrinks the blocks to divide the problem: at most the largest power of
  two dividing H (resp. D), so no program needs a mask; with `num_splits`,
  no more splits a step than the smallest power of two covering them."""
  block_s = stage.block_s if num_splits is None else min(stage.block_s, next_pow2(num_splits))
  return dataclasses.replace(
    stage, block_h=min(stage.block_h, heads & -heads), block_d=min(stage.block_d, head_dim & -head_dim), block_s=block_s
  )


def combine_programs(stage: CombineStage, rows: int, heads: int, head_dim: int) -> int:
  """Programs of the combine's grid `(H / block_h, R, D / block_d)`."""
  stage = fit_combine(stage, heads, head_dim)
  return (heads // stage.block_h) * rows * (head_dim // stage.block_d)


# Combine tiles from the largest down: (block_h, block_d, num_warps); up to
# 16 values of a split's tile per thread.
_COMBINE_TILES = ((16, 128, 4), (16, 64, 2), (8, 64, 1), (8, 32, 1), (4, 32, 1))
# Values of all the splits a step loads, per thread (a register budget).
_COMBINE_VALUES_PER_THREAD = 64


def choose_combine(rows: int, heads: int, head_dim: int, num_splits: int, target_programs: int) -> CombineStage:
  """The largest tile of `_COMBINE_TILES` whose grid has at least
  `target_programs` programs (else the smallest), fitted to the problem,
  with as many splits a step (up to 4) as keep a step's loads at
  `_COMBINE_VALUES_PER_THREAD` values a thread. Larger tiles stream longer
  rows; small batches need small tiles to spread over the SMs."""
  for block_h, block_d, num_warps in _COMBINE_TILES:
    stage = fit_combine(CombineStage(block_h, block_d, num_warps), heads, head_dim)
    if combine_programs(stage, rows, heads, head_dim) >= target_programs:
      break
  per_split = stage.block_h * stage.block_d // (32 * stage.num_warps)
  block_s = max(1, min(4, _COMBINE_VALUES_PER_THREAD // max(per_split, 1)))
  return fit_combine(dataclasses.replace(stage, block_s=1 << (block_s.bit_length() - 1)), heads, head_dim, num_splits)


def merge_splits(o_part_ref, lse_part_ref, *, num_splits: int, block_s: int):
  """The combine's merge inside a kernel: `o_part_ref [>= S, bh, bd]` f32
  normalized partials and `lse_part_ref [>= S, bh]` their base-2 lses (the
  first `num_splits` are read, `block_s` a step) -> `(acc, m, l)`: the
  lse-weighted sum of the partials, the running maximum m (0 where every
  split is empty) and the sum of the weights `2**(lse_s - m)`;
  `online_softmax.normalize(acc, m, l)` is the merged output."""
  block_h, block_d = o_part_ref.shape[1:]
  ragged = num_splits % block_s != 0

  def body(step, carry):
    acc, m, l = carry
    splits = pl.ds(step * block_s, block_s)
    if ragged:  # splits past the last: lse -inf, weight 0
      present = step * block_s + jnp.arange(block_s) < num_splits
      lse = plgpu.load(lse_part_ref.at[splits, :], mask=present[:, None], other=-jnp.inf)
      o = plgpu.load(o_part_ref.at[splits, :, :], mask=present[:, None, None], other=0.0)
    else:
      lse, o = lse_part_ref[splits, :], o_part_ref[splits, :, :]
    m_next = jnp.maximum(m, jnp.max(lse, axis=0))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    w = jnp.exp2(lse - m_safe[None, :])  # [bs, bh]; 0 for empty splits
    # Empty splits are selected away, not multiplied by their zero weight.
    weighted = jnp.where(w[:, :, None] > 0.0, w[:, :, None] * o, 0.0)
    correction = jnp.exp2(m - m_safe)
    return correction[:, None] * acc + jnp.sum(weighted, axis=0), m_next, correction * l + jnp.sum(w, axis=0)

  init = (
    jnp.zeros((block_h, block_d), jnp.float32),
    jnp.full((block_h,), -jnp.inf, jnp.float32),
    jnp.zeros((block_h,), jnp.float32),
  )
  acc, m, l = lax.fori_loop(0, cdiv(num_splits, block_s), body, init)
  return acc, jnp.where(m == -jnp.inf, 0.0, m), l


def _combine_kernel(*refs, num_splits: int, block_s: int, has_sink: bool, with_lse: bool):
  # o_part_ref [S, bh, bd] f32; lse_part_ref [S, bh] (base 2); sink_ref [bh];
  # out_ref [bh, bd]; lse_ref [bh] (natural).
  o_part_ref, lse_part_ref = refs[:2]
  sink_ref = refs[2] if has_sink else None
  out_ref = refs[3 if has_sink else 2]
  acc, m_safe, l = merge_splits(o_part_ref, lse_part_ref, num_splits=num_splits, block_s=block_s)
  out = normalize(acc, m_safe, l, None if sink_ref is None else sink_ref[...])
  out_ref[...] = out.astype(out_ref.dtype)
  if with_lse:
    lse_ref = refs[-1]

    @pl.when(pl.program_id(2) == 0)  # the first column block writes it
    def _():
      lse_ref[...] = lse_natural(m_safe, l)


def combine_splits(
  o_part: jax.Array,
  lse_part: jax.Array,
  sink: jax.Array | None = None,
  *,
  stage: CombineStage,
  out_dtype,
  with_lse: bool = False,
  name: str,
  interpret: bool | None = None,
):
  """Merges the partial results of S splits (module docstring).

  Args:
    o_part: `[R, S, H, D]` fp32 normalized partial outputs.
    lse_part: `[R, S, H]` fp32 base-2 partial log-sum-exps (-inf: empty).
    sink: optional `[H]` fp32 sink logits (natural units, denominator only).
    stage: the combine's tiling, fitted to H and D here.
    out_dtype: dtype of the output (the one rounding).
    with_lse: also return the natural-log lse `[R, H]` (+inf: lonely row).
    name: the kernel's name (its caller's, so profiles and compile reports
      name the definition).
    interpret: None = interpret when no GPU is present.

  Returns:
    `out [R, H, D]`, or `(out, lse)` with `with_lse`.
  """
  rows, num_splits, heads, head_dim = o_part.shape
  if lse_part.shape != (rows, num_splits, heads):
    raise ValueError(
      f"lse_part {lse_part.shape} does not match o_part {o_part.shape}: expected {(rows, num_splits, heads)}"
    )
  if sink is not None and sink.shape != (heads,):
    raise ValueError(f"sink {sink.shape} must be [{heads}]")
  stage = fit_combine(stage, heads, head_dim, num_splits)
  block_h, block_d = stage.block_h, stage.block_d
  # Grid (H / block_h, R, D / block_d): of the six axis orders, the one that
  # compiles to the fewest registers on sm_90a for both callers' shapes
  # (docs/perf/kernel_notes.md).
  operands = [o_part, lse_part]
  in_specs = [
    pl.BlockSpec((None, num_splits, block_h, block_d), lambda h, r, d: (r, 0, h, d)),
    pl.BlockSpec((None, num_splits, block_h), lambda h, r, d: (r, 0, h)),
  ]
  if sink is not None:
    operands.append(sink.astype(jnp.float32))
    in_specs.append(pl.BlockSpec((block_h,), lambda h, r, d: (h,)))
  out_shape = [jax.ShapeDtypeStruct((rows, heads, head_dim), out_dtype)]
  out_specs = [pl.BlockSpec((None, block_h, block_d), lambda h, r, d: (r, h, d))]
  if with_lse:
    out_shape.append(jax.ShapeDtypeStruct((rows, heads), jnp.float32))
    out_specs.append(pl.BlockSpec((None, block_h), lambda h, r, d: (r, h)))
  outputs = common.pallas_call(
    functools.partial(
      _combine_kernel, num_splits=num_splits, block_s=stage.block_s, has_sink=sink is not None, with_lse=with_lse
    ),
    out_shape=tuple(out_shape),
    grid=(heads // block_h, rows, head_dim // block_d),
    in_specs=in_specs,
    out_specs=tuple(out_specs),
    compiler_params=plgpu.CompilerParams(num_warps=stage.num_warps, num_stages=stage.num_stages),
    interpret=resolve_interpret(interpret),
    name=name,
  )(*operands)
  return outputs if with_lse else outputs[0]
