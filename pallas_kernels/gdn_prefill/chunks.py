"""Pieces of the chunk-parallel gated delta net prefill
(`pallas_kernels.gdn_prefill`): the chunk table over packed sequences, the
`cu_seqlens` contract, the split bf16 dots and the blocked
unit-lower-triangular inverse.

Chunk table. Sequence n covers tokens `cu[n] .. cu[n+1]-1` of the packed
axis; its tokens are cut into chunks of `chunk` tokens from its own start (its
last chunk may be partial). The tokens before `cu[0]` and after `cu[N]` form
two gap segments (empty unless `cu_seqlens` does not span [0, T]): chunks that
belong to no sequence and whose outputs are zero. A launch parallel over
chunks has `num_slots(T, N, chunk)` programs, a static bound on the number of
chunks of all segments; slots past the last chunk have no tokens.

The `cu_seqlens` contract (both paths apply it, `normalize_cu_seqlens`):
entries are clamped to [0, T] and made nondecreasing (running maximum), so a
sequence whose bounds go past T or backwards covers fewer (or no) tokens, and
tokens no sequence covers get a zero output.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gdn_decode.triton import log_decay, sigmoid

# fp32 dots of the small blocks of the triangular inverse: exact fp32 FMA (a
# plain fp32 dot compiles to tf32 tensor-core instructions on sm_90a, which
# interpret mode would not reproduce).
_F32_DOT = lax.DotAlgorithmPreset.F32_F32_F32


def normalize_cu_seqlens(cu_seqlens: jax.Array, total: int) -> jax.Array:
  """int32 `cu_seqlens` clamped to [0, total] and made nondecreasing."""
  cu = jnp.clip(cu_seqlens.astype(jnp.int32), 0, total)
  return lax.cummax(cu, axis=0) if cu.shape[0] else cu


def num_slots(total: int, num_seqs: int, chunk: int) -> int:
  """Programs of a launch parallel over chunks: sum of ceil(len / chunk) over
  the N sequences and 2 gap segments, whose lengths add up to `total`, is at
  most total // chunk + N + 2."""
  return total // chunk + num_seqs + 2


class ChunkTable(NamedTuple):
  """Per slot: first token, end of its segment (exclusive), whether it is a
  chunk of a sequence (1) or of a gap / unused (0); per sequence: its first
  slot; and the normalized `cu` [N + 1]."""

  slot_start: jax.Array
  slot_end: jax.Array
  slot_real: jax.Array
  seq_first_slot: jax.Array
  cu: jax.Array


def chunk_table(cu_seqlens: jax.Array, total: int, chunk: int) -> ChunkTable:
  """The slots of `num_slots(total, N, chunk)` programs (XLA, jit-friendly)."""
  cu = normalize_cu_seqlens(cu_seqlens, total)
  n = cu.shape[0] - 1
  slots = num_slots(total, n, chunk)
  zero, end = jnp.zeros((1,), jnp.int32), jnp.full((1,), total, jnp.int32)
  bounds = jnp.concatenate([zero, cu, end])  # N + 2 segments
  seg_chunks = (bounds[1:] - bounds[:-1] + chunk - 1) // chunk
  first = jnp.concatenate([zero, jnp.cumsum(seg_chunks)[:-1].astype(jnp.int32)])
  slot = jnp.arange(slots, dtype=jnp.int32)
  # The last segment starting at or before the slot: empty segments share
  # their first slot with the next one and are skipped.
  seg = jnp.searchsorted(first, slot, side="right").astype(jnp.int32) - 1
  used = slot < jnp.sum(seg_chunks)
  start = jnp.where(used, bounds[seg] + (slot - first[seg]) * chunk, 0)
  stop = jnp.where(used, bounds[seg + 1], 0)
  real = (used & (seg >= 1) & (seg <= n)).astype(jnp.int32)
  return ChunkTable(start, stop, real, first[1 : n + 1], cu)


def chunk_rows(t0, end, chunk: int):
  """(tokens, valid) of the chunk of `chunk` rows from token `t0` of a
  segment ending at `end` (exclusive): rows past the end are not valid."""
  return pl.ds(t0, chunk), t0 + jnp.arange(chunk) < end


def covered_tokens(cu: jax.Array, total: int) -> jax.Array:
  """[total] bool: the tokens some sequence covers (normalized `cu`)."""
  token = jnp.arange(total)
  return (token >= cu[0]) & (token < cu[-1])


# ------------------------------------------------------------------- dots


def split_bf16(x):
  """fp32 -> (hi, lo) bf16 with hi + lo ~ x to about 16 mantissa bits; a
  bf16 operand has no low part."""
  if x.dtype == jnp.bfloat16:
    return x, None
  hi = x.astype(jnp.bfloat16)
  return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def mm(x, y, contract: tuple[int, int], precision: str):
  """Tensor-core `dot_general` contracting `x` dim `contract[0]` with `y` dim
  `contract[1]`, fp32 accumulation; fp32 operands are split into bf16 parts
  (`bf16x3`: hi*hi + hi*lo + lo*hi; `bf16`: hi*hi). Every bf16 product is
  exact, so interpret mode computes what the GPU does up to summation order."""
  dims = (((contract[0],), (contract[1],)), ((), ()))

  def dot(p, r):
    return lax.dot_general(p, r, dims, preferred_element_type=jnp.float32)

  x_hi, x_lo = split_bf16(x)
  y_hi, y_lo = split_bf16(y)
  acc = dot(x_hi, y_hi)
  if precision == "bf16x3":
    if x_lo is not None:
      acc = acc + dot(x_lo, y_hi)
    if y_lo is not None:
      acc = acc + dot(x_hi, y_lo)
  return acc


def _f32_dot(x, y):
  return lax.dot_general(x, y, (((1,), (0,)), ((), ())), precision=_F32_DOT, preferred_element_type=jnp.float32)


# ------------------------------------------------------ triangular inverse


def _concat(parts: list, axis: int):
  """Concatenation of equal power-of-two blocks along axis 0 or 1 by pairs
  (stack on a new last axis, transpose, reshape: what the Triton lowering
  supports; `jnp.concatenate` is not)."""
  while len(parts) > 1:
    joined = []
    for x, y in zip(parts[::2], parts[1::2]):
      s = jnp.stack([x, y], axis=-1)  # [r, c, 2]
      s = jnp.transpose(s, (2, 0, 1) if axis == 0 else (0, 2, 1))
      rows, cols = x.shape
      joined.append(s.reshape((2 * rows, cols) if axis == 0 else (rows, 2 * cols)))
    parts = joined
  return parts[0]


def _blocks(x, n: int):
  """`x` [n*b, n*b] as blocks[i][j] [b, b] (equal splits lower on Triton)."""
  if n == 1:
    return [[x]]
  return [jnp.split(r, n, axis=1) for r in jnp.split(x, n, axis=0)]


def _diagonal_inverse(a):
  """(I + a)^-1 of one strictly lower [b, b] block by doubling: with t the
  inverse for diagonal sub-blocks of size s, merging pairs of them is
  t - t l t (l: a's entries between the two halves of each 2s block), exact
  fp32 dots."""
  size = a.shape[0]
  rows = lax.broadcasted_iota(jnp.int32, a.shape, 0)
  cols = lax.broadcasted_iota(jnp.int32, a.shape, 1)
  t = (rows == cols).astype(jnp.float32)
  s = 1
  while s < size:
    between = (rows // (2 * s) == cols // (2 * s)) & ((rows // s) % 2 == 1) & ((cols // s) % 2 == 0)
    t = t - _f32_dot(_f32_dot(t, jnp.where(between, a, 0.0)), t)
    s *= 2
  return t


def unit_lower_inverse(a, block: int):
  """(I + a)^-1 for strictly lower-triangular `a` [C, C] (fp32), in blocks of
  `block` x `block`: the diagonal blocks by doubling, then block forward
  substitution T_ij = -T_ii sum_{j<=m<i} A_im T_mj, all with exact fp32 dots
  of `block`^3 (CUDA cores: cheap at 16^3, and no rounding beyond fp32)."""
  n = a.shape[0] // block
  a_blocks = _blocks(a, n)
  t = {(i, i): _diagonal_inverse(a_blocks[i][i]) for i in range(n)}
  for i in range(n):
    for j in range(i - 1, -1, -1):
      acc = _f32_dot(a_blocks[i][j], t[j, j])
      for m in range(j + 1, i):
        acc = acc + _f32_dot(a_blocks[i][m], t[m, j])
      t[i, j] = -_f32_dot(t[i, i], acc)
  if n == 1:
    return t[0, 0]
  zero = jnp.zeros((block, block), jnp.float32)
  return _concat([_concat([t.get((i, j), zero) for j in range(n)], axis=1) for i in range(n)], axis=0)


# ------------------------------------------------------------ chunk gates


def chunk_log_decay(a_ref, tokens, valid, a_log, dt_bias):
  """Per token of a chunk: the log-decay gamma <= 0, 0 on rows past the
  segment's end (so that they change nothing)."""
  gate_a = plgpu.load(a_ref.at[tokens], mask=valid, other=0.0)
  return jnp.where(valid, log_decay(gate_a, a_log, dt_bias), 0.0)


def chunk_gates(a_ref, b_ref, tokens, valid, a_log, dt_bias):
  """Per token of a chunk: (log-decay gamma <= 0, beta), both 0 on rows past
  the segment's end."""
  gate_b = plgpu.load(b_ref.at[tokens], mask=valid, other=0.0)
  return chunk_log_decay(a_ref, tokens, valid, a_log, dt_bias), jnp.where(valid, sigmoid(gate_b), 0.0)


def _lower(shape, strict: bool):
  rows = lax.broadcasted_iota(jnp.int32, shape, 0)
  cols = lax.broadcasted_iota(jnp.int32, shape, 1)
  return cols < rows if strict else cols <= rows


def strictly_lower(x):
  return jnp.where(_lower(x.shape, True), x, 0.0)


def decay_matrix(cum):
  """D_ij = exp(G_i - G_j) for j <= i, else 0; every entry <= 1 since G (the
  cumulative log-decay) is nonincreasing."""
  keep = _lower((cum.shape[0],) * 2, False)
  diff = cum[:, None] - cum[None, :]
  return jnp.where(keep, jnp.exp(jnp.where(keep, diff, 0.0)), 0.0)


def load_rows(ref, tokens, valid, cols=None):
  """Rows `tokens` of a [T, ...] ref (columns `cols`), zero past the segment."""
  if ref.ndim == 1:
    return plgpu.load(ref.at[tokens], mask=valid, other=0.0)
  index = (tokens, slice(None) if cols is None else cols)
  return plgpu.load(ref.at[index], mask=valid[:, None], other=0.0)


def store_rows(ref, tokens, valid, value, cols=None):
  if ref.ndim == 1:
    plgpu.store(ref.at[tokens], value.astype(ref.dtype), mask=valid)
    return
  index = (tokens, slice(None) if cols is None else cols)
  plgpu.store(ref.at[index], value.astype(ref.dtype), mask=valid[:, None])


def decayed_scores(q_ref, k_ref, g_ref, tokens, valid, precision: str):
  """A chunk's `(G, Q, M)`: the cumulative log-decay G [C] (rows past the
  segment's end continue at its last G, not at 0: exp(0 - G_j) would
  overflow), its queries Q [C, K], and M = D * (Q K^T) [C, C] with D the
  `decay_matrix` of G. What the output (forward launch 3) and the dV pass
  (backward launch 1) both start from."""
  cum = load_rows(g_ref, tokens, valid)
  cum = jnp.where(valid, cum, jnp.min(cum))
  q = load_rows(q_ref, tokens, valid)
  return cum, q, decay_matrix(cum) * mm(q, load_rows(k_ref, tokens, valid), (1, 1), precision)
