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
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels import common
import jax.numpy as jnp

from pallas_kernels.common import resolve_interpret
from pallas_kernels.config_rules import DOT_BLOCK, NUM_STAGES, NUM_WARPS, KernelConfig, field, multiple_of, pow2
from pallas_kernels.online_softmax import lse_natural, normalize


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
  output columns of one row. No dot: any power of two of heads works."""
  block_h: int = field(16, pow2())
  block_d: int = field(64, pow2(16))
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(1, NUM_STAGES)


def fit_combine(stage: CombineStage, heads: int, head_dim: int) -> CombineStage:
  """Shrinks the blocks to divide the problem: at most the largest power of
  two dividing H (resp. D), so no program needs a mask."""
  return dataclasses.replace(stage, block_h=min(stage.block_h, heads & -heads),
                             block_d=min(stage.block_d, head_dim & -head_dim))


def _combine_kernel(*refs, num_splits: int, has_sink: bool, with_lse: bool):
  # o_part_ref [S, bh, bd] f32; lse_part_ref [S, bh] (base 2); sink_ref [bh];
  # out_ref [bh, bd]; lse_ref [bh] (natural).
  o_part_ref, lse_part_ref = refs[:2]
  sink_ref = refs[2] if has_sink else None
  out_ref = refs[3 if has_sink else 2]
  block_h, block_d = out_ref.shape

  m = lax.fori_loop(0, num_splits, lambda s, m: jnp.maximum(m, lse_part_ref[s, :]),
                    jnp.full((block_h,), -jnp.inf, jnp.float32))
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)

  def body(s, carry):
    acc, l = carry
    w = jnp.exp2(lse_part_ref[s, :] - m_safe)  # 0 for empty splits
    return acc + w[:, None] * o_part_ref[s, :, :], l + w

  acc, l = lax.fori_loop(0, num_splits, body, (jnp.zeros((block_h, block_d), jnp.float32),
                                               jnp.zeros((block_h,), jnp.float32)))
  out = normalize(acc, m_safe, l, sink_ref[...] if has_sink else None)
  out_ref[...] = out.astype(out_ref.dtype)
  if with_lse:
    lse_ref = refs[-1]

    @pl.when(pl.program_id(2) == 0)  # the first column block writes it
    def _():
      lse_ref[...] = lse_natural(m_safe, l)


def combine_splits(o_part: jax.Array, lse_part: jax.Array, sink: jax.Array | None = None, *,
                   stage: CombineStage, out_dtype, with_lse: bool = False, name: str,
                   interpret: bool | None = None):
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
    raise ValueError(f"lse_part {lse_part.shape} does not match o_part {o_part.shape}: "
                     f"expected {(rows, num_splits, heads)}")
  if sink is not None and sink.shape != (heads,):
    raise ValueError(f"sink {sink.shape} must be [{heads}]")
  stage = fit_combine(stage, heads, head_dim)
  block_h, block_d = stage.block_h, stage.block_d
  # Grid (H / block_h, R, D / block_d): of the six axis orders, the one that
  # compiles to the fewest registers on sm_90a for both callers' shapes
  # (docs/perf/kernel_notes.md).
  operands = [o_part, lse_part]
  in_specs = [pl.BlockSpec((None, num_splits, block_h, block_d), lambda h, r, d: (r, 0, h, d)),
              pl.BlockSpec((None, num_splits, block_h), lambda h, r, d: (r, 0, h))]
  if sink is not None:
    operands.append(sink.astype(jnp.float32))
    in_specs.append(pl.BlockSpec((block_h,), lambda h, r, d: (h,)))
  out_shape = [jax.ShapeDtypeStruct((rows, heads, head_dim), out_dtype)]
  out_specs = [pl.BlockSpec((None, block_h, block_d), lambda h, r, d: (r, h, d))]
  if with_lse:
    out_shape.append(jax.ShapeDtypeStruct((rows, heads), jnp.float32))
    out_specs.append(pl.BlockSpec((None, block_h), lambda h, r, d: (r, h)))
  outputs = common.pallas_call(
      functools.partial(_combine_kernel, num_splits=num_splits, has_sink=sink is not None,
                        with_lse=with_lse),
      out_shape=tuple(out_shape),
      grid=(heads // block_h, rows, head_dim // block_d),
      in_specs=in_specs,
      out_specs=tuple(out_specs),
      compiler_params=plgpu.CompilerParams(num_warps=stage.num_warps, num_stages=stage.num_stages),
      interpret=resolve_interpret(interpret),
      name=name,
  )(*operands)
  return outputs if with_lse else outputs[0]
