"""The online softmax of FlashAttention-2, in base 2: the step every attention
kernel folds its key blocks with, and the ways to finish it.

Scores arrive scaled by `LOG2_E * sm_scale`, so `exp2(s)` is `exp(q.k *
sm_scale)` and each probability costs one exp2. The carry is `(acc, m, l)`:
the unnormalized output accumulator (fp32, one array or a list of parts for
kernels that split the value dimension into several dots), the running row max `m` of the
scores (base 2) and the running row sum `l` of `exp2(s - m)`.

A row that has seen nothing yet has `m = -inf` and `l = 0`; a step whose
block may hide every key of a row subtracts 0 instead of -inf for it, so its
probabilities are 0, never NaN. Hidden keys are selected away to -inf with
`where` (exactly 0 probability), never multiplied by a 0/1 mask, which would
turn an infinite or NaN score into NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


# Columns of the row-sum dot (`online_softmax_step(..., row_sums_by_dot=True)`):
# the narrowest tensor-core tile.
ROW_SUM_COLUMNS = 16


def init_carry(
  rows: int, width: int, parts: int | None = None, *, row_sums_by_dot: bool = False, finite_max: bool = False
):
  """`(acc, m, l)` of rows that have seen nothing: acc `[rows, width]` zeros,
  or a list of `parts` such arrays; `l` `[rows]`, or with `row_sums_by_dot`
  `[rows, ROW_SUM_COLUMNS]` (`row_sums` reads it); `m` -inf, or with
  `finite_max` the lowest finite fp32 (`online_softmax_step`'s
  `finite_max`)."""
  zeros = lambda: jnp.zeros((rows, width), jnp.float32)
  acc = zeros() if parts is None else [zeros() for _ in range(parts)]
  l = jnp.zeros((rows, ROW_SUM_COLUMNS) if row_sums_by_dot else (rows,), jnp.float32)
  m = jnp.full((rows,), jnp.finfo(jnp.float32).min if finite_max else -jnp.inf, jnp.float32)
  return acc, m, l


def row_sums(l):
  """The `[rows]` row sums of a carry's `l` (either form of `init_carry`;
  the dot form's columns are equal)."""
  return l if l.ndim == 1 else jnp.max(l, axis=1)


def scaled_minus(s, scale: float, m, *, ptx: bool):
  """`s * scale - m` (fp32, `m` broadcasting to `s`): with `ptx` one
  `fma.rn.f32` a score (inline PTX, a Triton kernel on a GPU: the Triton
  lowering never contracts jnp's multiply and subtract), else jnp's two
  roundings."""
  if not ptx:
    return s * scale - m
  args = [s, jnp.full(s.shape, scale, jnp.float32), jnp.broadcast_to(-m, s.shape)]
  return plgpu.elementwise_inline_asm(
    "fma.rn.f32 $0, $1, $2, $3;",
    args=args,
    constraints="=f,f,f,f",
    pack=1,
    result_shape_dtypes=[jax.ShapeDtypeStruct(s.shape, jnp.float32)],
  )[0]


def online_softmax_step(
  s,
  carry,
  values,
  *,
  visible=None,
  value_scales=None,
  p_hi_lo=False,
  score_scale=None,
  fma_ptx=False,
  row_sums_by_dot=False,
  finite_max=False,
):
  """Folds one key block into the carry; returns the new carry.

  Args:
    s: `[rows, keys]` fp32 scores, already scaled by `LOG2_E * sm_scale`,
      or with `score_scale` the raw dot.
    carry: `(acc, m, l)`, see the module docstring.
    values: the value tile `[keys, width]`, or a list of tiles (the value
      dimension in parts; `acc` is then a list of as many parts). The update
      of each part is `p @ tile` with the probabilities rounded to the tile's
      dtype, as every flash kernel does; each part is updated right after
      its dot (that order keeps Triton's shared memory as small as a
      hand-written loop's).
    visible: bool, broadcasting to `s`, or None when every row sees every
      key of the block (then each row has a finite score in it and the
      empty-row guard is skipped).
    value_scales: with a list of tiles, optional per-key factors `[keys]`
      (one per tile, or None) that multiply the fp32 probabilities before
      that tile's dot: dequantization scales of the values, applied where
      they cost no rounding of the values themselves.
    p_hi_lo: the probabilities enter each value dot as two terms of the
      tile's dtype, `hi = bf16(p)` and `lo = bf16(p - hi)` (two dots, about
      16 significant bits instead of 8): for values whose magnitudes make
      the rounding of p visible in the sum (dequantized outlier blocks over
      hundreds of keys).
    score_scale: a positive float that the step applies to `s` itself:
      the row max is taken on the raw scores and then scaled (a positive
      scale commutes with max, roundings included) and each probability is
      `exp2(s * score_scale - m)` in one `scaled_minus` (`fma_ptx`: one fma
      a score instead of a multiply and a subtract).
    row_sums_by_dot: `l` is `[rows, ROW_SUM_COLUMNS]` (`init_carry`) and
      the block's row sums come from a dot of the probabilities, rounded to
      the value dtype as for the value dot, with ones: a narrow tensor-core
      op instead of an add a score and a cross-lane reduction. The
      denominator is then the sum of exactly the weights the numerator
      used (one value tile, no `p_hi_lo`).
    finite_max: the carry's `m` started finite (`init_carry(...,
      finite_max=True)`), so it stays finite and a row whose block hides
      every key needs no guard: its probabilities are `exp2(-inf - m) = 0`
      and its correction `exp2(0) = 1`. (A finite score is at least the
      lowest fp32, so the running max is still the scores' max once a row
      has seen a key; a score that overflowed to -inf counts as hidden.)
  """
  acc, m_prev, l_prev = carry
  if visible is not None:
    s = jnp.where(visible, s, -jnp.inf)
  block_max = jnp.max(s, axis=-1)
  m_next = jnp.maximum(m_prev, block_max if score_scale is None else block_max * score_scale)
  m_safe = m_next if visible is None or finite_max else jnp.where(m_next == -jnp.inf, 0.0, m_next)
  correction = jnp.exp2(m_prev - m_safe)
  if score_scale is None:
    p = jnp.exp2(s - m_safe[:, None])
  else:
    p = jnp.exp2(scaled_minus(s, score_scale, m_safe[:, None], ptx=fma_ptx))
  if row_sums_by_dot:
    if p_hi_lo or isinstance(values, (list, tuple)):
      raise ValueError("row_sums_by_dot takes one value tile and no p_hi_lo")
    ones = jnp.ones((values.shape[0], ROW_SUM_COLUMNS), values.dtype)
    l_next = correction[:, None] * l_prev + jnp.dot(p.astype(values.dtype), ones, preferred_element_type=jnp.float32)
  else:
    l_next = correction * l_prev + jnp.sum(p, axis=-1)
  if isinstance(values, (list, tuple)):
    scales = value_scales or [None] * len(values)
    acc = [
      correction[:, None] * a + _weighted_values(p if w is None else p * w[None, :], v, p_hi_lo)
      for a, v, w in zip(acc, values, scales)
    ]
  else:
    acc = correction[:, None] * acc + _weighted_values(p, values, p_hi_lo)
  return acc, m_next, l_next


def _weighted_values(p, v, p_hi_lo=False):
  hi = p.astype(v.dtype)
  out = jnp.dot(hi, v, preferred_element_type=jnp.float32)
  if p_hi_lo:
    lo = (p - hi.astype(jnp.float32)).astype(v.dtype)
    out = out + jnp.dot(lo, v, preferred_element_type=jnp.float32)
  return out


def normalize(acc, m, l, sink=None):
  """The attention output `acc / denominator` (acc an array or a list of
  parts). The denominator is `l`, plus, with `sink` (`[rows]` logits in
  natural units, the attention sink), `exp(sink)` in the running scale
  `2**m`. Rows with `l == 0` (nothing seen) give 0."""
  seen = l > 0.0
  denominator = l
  if sink is not None:
    denominator = l + jnp.exp2(sink * LOG2_E - jnp.where(seen, m, 0.0))
  inverse = jnp.where(seen, 1.0 / denominator, 0.0)
  return jax.tree.map(lambda a: a * inverse[:, None], acc)


def lse_base2(m, l):
  """`log2(sum exp2(s))` of each row, -inf for a row that saw nothing: the
  partial result of one split that `split_kv.combine_splits` merges."""
  seen = l > 0.0
  return jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)


def lse_natural(m, l):
  """`log(sum exp(q.k * sm_scale))` of each row (natural log, no sink), +inf
  for a lonely row (one that saw no key), as the definitions return it."""
  seen = l > 0.0
  return jnp.where(seen, (jnp.where(seen, m, 0.0) + jnp.log2(jnp.where(seen, l, 1.0))) * LN_2, jnp.inf)


def lse_for_backward(m, l):
  """`log2(sum exp2(s))` of each row (base 2, the forward's scale), +inf for
  a lonely row: a backward pass recomputes each probability as
  `exp2(s - lse)`, which is then exactly 0 for a row that saw no key."""
  seen = l > 0.0
  return jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf)


def hide_keys(x, visible):
  """Rows `[keys, width]` of a key or value tile with the hidden keys
  (`visible [keys]` False) selected to 0: whatever they hold (NaN, Inf)
  cannot reach a dot product in which their weight is 0."""
  return jnp.where(visible[:, None], x, jnp.zeros_like(x))
