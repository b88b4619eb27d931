"""The key side of the flash attention kernels (forward, dQ and dK/dV): which
keys a query sees, how a query block walks its key blocks, and the tables of
blocks to visit that XLA computes before a launch.

Key j (of batch row b) is visible to query i when it is in bounds, not
hidden by `key_valid[b, j]`, and, with `segment_ids` (queries and keys are
the same tokens), `segment_ids[b, j] <= segment_ids[b, i]`. Prefix keys are
visible to every query. Hidden keys are selected away, never multiplied by a
0/1 mask: their scores become -inf (probability exactly 0) and their key
and value rows 0 before any dot (`online_softmax.hide_keys`), so a NaN or
Inf a caller left in a hidden key reaches neither the output nor a
gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.shared.common import cdiv
from pallas_kernels.shared.online_softmax import hide_keys

# Padded key rows get this segment id so that no query sees them.
INVISIBLE_SEGMENT = jnp.iinfo(jnp.int32).max


def check_attention_inputs(q, k, v, key_valid=None, k_prefix=None, v_prefix=None, segment_ids=None) -> None:
  """Raises unless the operands of a flash attention forward agree: q
  `[B, Nq, H, D]`, k and v `[B, Nk, H, D]` and the prefix `[B, Np, H, D]`
  of q's dtype, `key_valid [B, Nk]`, `segment_ids [B, Nq]` with Nk == Nq."""
  batch, q_len, num_heads, head_dim = q.shape
  kv_len = k.shape[1]
  if k.shape != (batch, kv_len, num_heads, head_dim) or v.shape != k.shape:
    raise ValueError(f"k {k.shape} / v {v.shape} do not match q {q.shape}")
  if not (k.dtype == v.dtype == q.dtype):
    raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
  if (k_prefix is None) != (v_prefix is None):
    raise ValueError("k_prefix and v_prefix go together")
  if k_prefix is not None and v_prefix is not None:  # both or neither, as checked above
    expected = (batch, k_prefix.shape[1], num_heads, head_dim)
    if k_prefix.shape != expected or v_prefix.shape != expected:
      raise ValueError(f"prefix shapes {k_prefix.shape}/{v_prefix.shape} != {expected}")
    if not (k_prefix.dtype == v_prefix.dtype == q.dtype):
      raise ValueError("prefix dtype differs from q")
  if key_valid is not None and key_valid.shape != (batch, kv_len):
    raise ValueError(f"key_valid {key_valid.shape} != {(batch, kv_len)}")
  if segment_ids is not None:
    if kv_len != q_len or segment_ids.shape != (batch, q_len):
      raise ValueError(f"segment_ids {segment_ids.shape} need Nk == Nq == {q_len}")


def key_sources(
  k: jax.Array, v: jax.Array, k_prefix: jax.Array | None, v_prefix: jax.Array | None, key_valid: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
  """`(k, v, k_prefix, v_prefix, key_valid)` with an empty prefix dropped
  (None) and, when there are no keys but a prefix, the prefix as the keys
  (the prefix pair is both or neither: `check_attention_inputs`)."""
  if k_prefix is None or v_prefix is None or not k_prefix.shape[1]:
    return k, v, None, None, key_valid
  if not k.shape[1]:
    return k_prefix, v_prefix, None, None, None
  return k, v, k_prefix, v_prefix, key_valid


def load_rows(ref, start, block: int, valid, other: Any, masked: bool):
  """Rows `[start, start + block)` of `ref` (`[N]` or `[N, D]`); with
  `masked`, `other` from row `valid` on (a traced start: the slice may
  overhang the ref)."""
  rows = pl.ds(start, block)
  index = rows if len(ref.shape) == 1 else (rows, slice(None))
  if not masked:
    return ref[index]
  in_bounds = start + jnp.arange(block) < valid
  return plgpu.load(ref.at[index], mask=in_bounds if len(ref.shape) == 1 else in_bounds[:, None], other=other)


def store_rows(ref, x, valid, masked: bool) -> None:
  """Stores `x` into the block `ref` (`[rows]` or `[rows, D]`); with
  `masked`, only its first `valid` rows."""
  if not masked:
    ref[...] = x
    return
  in_bounds = jnp.arange(x.shape[0]) < valid
  plgpu.store(ref, x, mask=in_bounds if x.ndim == 1 else in_bounds[:, None])


def load_key_block(k_ref, v_ref, start, length: int, block_k: int):
  """K and V rows `[start, start + block_k)`, zeros past `length` (a 0
  probability times garbage could be NaN), and the in-bounds mask."""
  in_bounds = start + jnp.arange(block_k) < length
  keys = pl.ds(start, block_k)
  k = plgpu.load(k_ref.at[keys, :], mask=in_bounds[:, None], other=0.0)
  v = plgpu.load(v_ref.at[keys, :], mask=in_bounds[:, None], other=0.0)
  return k, v, in_bounds


@dataclasses.dataclass(frozen=True)
class Keys:
  """The key refs of one (batch row, head) in a kernel: `k`, `v` `[Nk, D]`;
  optional prefix `[Np, D]`, `key_valid [Nk]` int8, `segment_ids [N]` int32
  (the queries' and keys' ids) and `block_limits [2]` int32 (the query
  block's `key_block_limits` entry)."""

  k: Any
  v: Any
  kv_len: int
  block_k: int
  k_prefix: Any = None
  v_prefix: Any = None
  prefix_len: int = 0
  key_valid: Any = None
  segment_ids: Any = None
  block_limits: Any = None

  def visible(self, start, in_bounds, k, v, q_segments):
    """A masked block of main keys from `start`: `(k, v, visible)` with
    hidden rows of k and v zeroed and `visible` `[1 or rows, block_k]`."""
    keys = pl.ds(start, self.block_k)
    visible = in_bounds
    if self.key_valid is not None:
      visible &= plgpu.load(self.key_valid.at[keys], mask=in_bounds, other=0) != 0
      k, v = hide_keys(k, visible), hide_keys(v, visible)
    visible = visible[None, :]
    if self.segment_ids is not None:
      k_segments = plgpu.load(self.segment_ids.at[keys], mask=in_bounds, other=INVISIBLE_SEGMENT)
      visible = visible & (k_segments[None, :] <= q_segments[:, None])
    return k, v, visible


def walk_keys(step: Callable[..., Any], carry: Any, keys: Keys, q_segments=None) -> Any:
  """Folds `step(k, v, visible, carry)` over every key block a query block
  sees, in order: prefix blocks (only the ragged last one masked), then the
  main keys' blocks `[0, n_unmasked)` seen whole by every row (`visible`
  None: no mask, no empty row), then `[n_unmasked, n_blocks)` masked; later
  blocks are skipped. `q_segments`: the block's query segment ids (with
  segments). Edge blocks run as loops with a traced index: their slices may
  extend past the ref, which a static index would reject; the masks cover
  it."""
  block_k = keys.block_k

  def unmasked_body(k_ref, v_ref):
    def body(block, carry):
      rows = pl.ds(block * block_k, block_k)
      return step(k_ref[rows, :], v_ref[rows, :], None, carry)

    return body

  if keys.prefix_len:
    if keys.prefix_len >= block_k:
      carry = lax.fori_loop(0, keys.prefix_len // block_k, unmasked_body(keys.k_prefix, keys.v_prefix), carry)

    def prefix_edge_body(block, carry):
      k, v, in_bounds = load_key_block(keys.k_prefix, keys.v_prefix, block * block_k, keys.prefix_len, block_k)
      return step(k, v, in_bounds[None, :], carry)

    carry = lax.fori_loop(keys.prefix_len // block_k, cdiv(keys.prefix_len, block_k), prefix_edge_body, carry)

  if keys.block_limits is not None:
    n_unmasked, n_blocks = keys.block_limits[0], keys.block_limits[1]
  else:
    n_unmasked, n_blocks = keys.kv_len // block_k, cdiv(keys.kv_len, block_k)

  def masked_body(block, carry):
    start = block * block_k
    k, v, in_bounds = load_key_block(keys.k, keys.v, start, keys.kv_len, block_k)
    return step(*keys.visible(start, in_bounds, k, v, q_segments), carry)

  if keys.kv_len >= block_k:  # Otherwise no whole block exists (n_unmasked = 0).
    carry = lax.fori_loop(0, n_unmasked, unmasked_body(keys.k, keys.v), carry)
  return lax.fori_loop(n_unmasked, n_blocks, masked_body, carry)


# ---------------------------------------------------------------------------
# Tables computed by XLA before a launch.


def _count_le(sorted_seq, values):  # [B, N], [B, Q] -> [B, Q]
  """Entries of each nondecreasing row `<=` each value: a right-sided
  search as one fused compare-and-sum (jnp.searchsorted lowers to a while
  loop before the launch)."""
  return jnp.sum(sorted_seq[:, None, :] <= values[:, :, None], axis=2, dtype=jnp.int32)


def key_block_limits(
  key_valid: jax.Array | None,
  segment_ids: jax.Array | None,
  *,
  batch: int,
  q_len: int,
  kv_len: int,
  block_q: int,
  block_k: int,
) -> jax.Array:
  """Per (batch row, query block): `[n_unmasked, n_blocks]` key blocks.

  Keys `[0, full)` are visible to every query row of the block and keys from
  `end` on to none of them; `n_unmasked = full // block_k` and
  `n_blocks = cdiv(end, block_k)`. Exact for any mask, tight for the recorded
  ones (a valid prefix of padded text keys, nondecreasing segment ids).
  Returns int32 `[B, cdiv(q_len, block_q), 2]`.
  """
  num_q_blocks = cdiv(q_len, block_q)
  full = jnp.full((batch, num_q_blocks), kv_len, jnp.int32)
  end = jnp.full((batch, num_q_blocks), kv_len, jnp.int32)
  if key_valid is not None:
    valid = key_valid.astype(bool)
    first_invalid = jnp.where(jnp.all(valid, axis=1), kv_len, jnp.argmin(valid, axis=1))
    last_valid_end = jnp.where(jnp.any(valid, axis=1), kv_len - jnp.argmax(valid[:, ::-1], axis=1), 0)
    full = jnp.minimum(full, first_invalid.astype(jnp.int32)[:, None])
    end = jnp.minimum(end, last_valid_end.astype(jnp.int32)[:, None])
  if segment_ids is not None:
    seg = segment_ids.astype(jnp.int32)
    # Per query block: the smallest and largest segment among its valid rows
    # (edge padding repeats the last row).
    padded = jnp.pad(seg, ((0, 0), (0, num_q_blocks * block_q - q_len)), mode="edge")
    blocks = padded.reshape(batch, num_q_blocks, block_q)
    seg_lo, seg_hi = blocks.min(axis=2), blocks.max(axis=2)
    # Key j is visible to all rows iff seg[j] <= seg_lo; the leading run of
    # such keys ends where the running max first exceeds seg_lo. The last key
    # some row sees is the last j with seg[j] <= seg_hi, found on the suffix
    # minimum. Both helper sequences are nondecreasing.
    full = jnp.minimum(full, _count_le(lax.cummax(seg, axis=1), seg_lo))
    end = jnp.minimum(end, _count_le(lax.cummin(seg, axis=1, reverse=True), seg_hi))
  n_blocks = (end + block_k - 1) // block_k
  n_unmasked = jnp.minimum(full // block_k, n_blocks)
  return jnp.stack([n_unmasked, n_blocks], axis=-1)


def query_block_limits(
  key_valid: jax.Array | None,
  segment_ids: jax.Array | None,
  *,
  batch: int,
  q_len: int,
  kv_len: int,
  block_q: int,
  block_k: int,
) -> jax.Array:
  """Per (batch row, key block): `[first, end)` query blocks, outside of
  which no query sees a key of the block (the dK/dV kernel's walk).

  With segments (Nk == Nq), query i sees some key of the block iff
  `seg[i] >= lo`, `lo` the smallest id among the block's visible keys; the
  first such i is where the running max of the ids reaches `lo` and the
  last where the suffix max still does. A block without a visible key
  (every key hidden by `key_valid`) visits no query block. Exact for any
  mask. Returns int32 `[B, cdiv(kv_len, block_k), 2]`.
  """
  num_q_blocks, num_k_blocks = cdiv(q_len, block_q), cdiv(kv_len, block_k)
  pad = num_k_blocks * block_k - kv_len
  valid = jnp.ones((batch, kv_len), bool) if key_valid is None else key_valid.astype(bool)
  block_valid = jnp.pad(valid, ((0, 0), (0, pad))).reshape(batch, num_k_blocks, block_k)
  any_visible = jnp.any(block_valid, axis=2)
  first = jnp.zeros((batch, num_k_blocks), jnp.int32)
  last_end = jnp.full((batch, num_k_blocks), q_len, jnp.int32)  # one past the last query that sees the block
  if segment_ids is not None:
    seg = segment_ids.astype(jnp.int32)
    block_seg = jnp.pad(seg, ((0, 0), (0, pad))).reshape(batch, num_k_blocks, block_k)
    lo = jnp.min(jnp.where(block_valid, block_seg, INVISIBLE_SEGMENT), axis=2)
    # Queries before `first` have a running max below lo (it is
    # nondecreasing); from `last_end` on, the suffix max is (it is
    # nonincreasing): each is one fused count.
    first = jnp.sum(lax.cummax(seg, axis=1)[:, None, :] < lo[:, :, None], axis=2, dtype=jnp.int32)
    last_end = jnp.sum(lax.cummax(seg, axis=1, reverse=True)[:, None, :] >= lo[:, :, None], axis=2, dtype=jnp.int32)
  first_block = jnp.where(any_visible, first // block_q, 0)
  end_block = jnp.where(any_visible, jnp.minimum((last_end + block_q - 1) // block_q, num_q_blocks), 0)
  return jnp.stack([first_block, jnp.maximum(end_block, first_block)], axis=-1)
