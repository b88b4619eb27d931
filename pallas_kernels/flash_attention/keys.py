"""The key side of the flash attention kernels (forward, dQ and dK/dV): which
keys a query sees, how a query block walks its key blocks, and the tables of
blocks to visit that XLA computes before a launch.

Key j (of batch row b) is visible to query i when it is in bounds, not
hidden by `key_valid[b, j]`, with `segment_ids` (queries and keys are
the same tokens) `segment_ids[b, j] <= segment_ids[b, i]`, and with a band
(`Window`: causal, sliding-window and packed-sequence attention) in query
i's key interval `lo_i <= j <= hi_i`. Prefix keys are visible to every
query. Hidden keys are selected away, never multiplied by a 0/1 mask:
their scores become -inf (probability exactly 0) and their key and value
rows 0 before any dot (`online_softmax.hide_keys`), so a NaN or Inf a
caller left in a hidden key reaches neither the output nor a gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.shared.common import cdiv
from pallas_kernels.shared.online_softmax import LN_2, LOG2_E, hide_keys

# Padded key rows get this segment id so that no query sees them.
INVISIBLE_SEGMENT = jnp.iinfo(jnp.int32).max


def check_attention_inputs(q, k, v, key_valid=None, k_prefix=None, v_prefix=None, segment_ids=None) -> None:
  """Raises unless the operands of a flash attention forward agree: q
  `[B, Nq, H, D]`, k and v `[B, Nk, Hkv, D]` (grouped heads: Hkv divides
  H) and the prefix `[B, Np, Hkv, D]` of q's dtype, `key_valid [B, Nk]`,
  `segment_ids [B, Nq]` with Nk == Nq."""
  batch, q_len, num_heads, head_dim = q.shape
  kv_len = k.shape[1]
  kv_heads = k.shape[2] if k.ndim == 4 else 0
  if k.shape != (batch, kv_len, kv_heads, head_dim) or v.shape != k.shape or not kv_heads or num_heads % kv_heads:
    raise ValueError(f"k {k.shape} / v {v.shape} do not match q {q.shape} (their heads must divide q's)")
  if not (k.dtype == v.dtype == q.dtype):
    raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
  if (k_prefix is None) != (v_prefix is None):
    raise ValueError("k_prefix and v_prefix go together")
  if k_prefix is not None and v_prefix is not None:  # both or neither, as checked above
    expected = (batch, k_prefix.shape[1], kv_heads, head_dim)
    if k_prefix.shape != expected or v_prefix.shape != expected:
      raise ValueError(f"prefix shapes {k_prefix.shape}/{v_prefix.shape} != {expected}")
    if not (k_prefix.dtype == v_prefix.dtype == q.dtype):
      raise ValueError("prefix dtype differs from q")
  if key_valid is not None and key_valid.shape != (batch, kv_len):
    raise ValueError(f"key_valid {key_valid.shape} != {(batch, kv_len)}")
  if segment_ids is not None:
    if kv_len != q_len or segment_ids.shape != (batch, q_len):
      raise ValueError(f"segment_ids {segment_ids.shape} need Nk == Nq == {q_len}")


def kv_head_map(group: int):
  """Query head -> its key/value head (grouped heads: `group` query heads
  share one, `h // group`); the identity without groups."""
  return (lambda h: h) if group == 1 else (lambda h: h // group)


def unpack_sequences(q, k, v, key_valid, cu_seqlens_q, cu_seqlens_k):
  """Packed (varlen) operands as one batch row: q `[T, H, D]`, k and v
  `[Tk, Hkv, D]`, key_valid `[Tk]` become `[1, ...]`; raises unless the
  packed shapes agree and `cu_seqlens_q`, `cu_seqlens_k` are both given,
  `[S + 1]` integers each. Without cu_seqlens, the operands unchanged."""
  if cu_seqlens_q is None and cu_seqlens_k is None:
    return q, k, v, key_valid
  if cu_seqlens_q is None or cu_seqlens_k is None:
    raise ValueError("cu_seqlens_q and cu_seqlens_k go together")
  if cu_seqlens_q.ndim != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape:
    raise ValueError(f"cu_seqlens_q {cu_seqlens_q.shape} / cu_seqlens_k {cu_seqlens_k.shape} must be [S + 1] each")
  if not (jnp.issubdtype(cu_seqlens_q.dtype, jnp.integer) and jnp.issubdtype(cu_seqlens_k.dtype, jnp.integer)):
    raise ValueError("cu_seqlens_q and cu_seqlens_k must be integers")
  if q.ndim != 3 or k.ndim != 3:
    raise ValueError(f"packed sequences take q [T, H, D] and k, v [Tk, Hkv, D], got {q.shape} and {k.shape}")
  if key_valid is not None and key_valid.shape != k.shape[:1]:
    raise ValueError(f"key_valid {key_valid.shape} != {k.shape[:1]}")
  return q[None], k[None], v[None], None if key_valid is None else key_valid[None]


def check_band_arguments(causal, window, softcap, *, has_prefix: bool, packed: bool) -> None:
  """Raises ValueError for band and soft-cap arguments a flash attention
  launcher does not take: `window` not None or a pair of ints >= 0 (or
  None), `softcap` not None or a positive number, or a band (causal, a
  window, packed sequences) with prefix keys."""
  if window is not None:
    if not (isinstance(window, tuple) and len(window) == 2):
      raise ValueError(f"window must be None or a (left, right) pair, got {window!r}")
    for side in window:
      if side is not None and (isinstance(side, bool) or not isinstance(side, int) or side < 0):
        raise ValueError(f"window sides must be None or ints >= 0, got {window!r}")
  if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
    raise ValueError(f"softcap must be None or a positive number, got {softcap!r}")
  if has_prefix and (causal or window is not None or packed):
    raise ValueError("causal, window and packed sequences do not combine with prefix keys")


def packed_outputs(o, lse, *, packed: bool, return_lse: bool, natural: bool = True):
  """A launcher's outputs from one launch's `o [B, Nq, H, D]` and base-2
  `lse [B, H, Nq]` (`unpack_sequences` made packed sequences one batch row:
  back to `[T, H, D]` and `[H, T]`): o, or with `return_lse` `(o, lse)`,
  the lse in natural log unless `natural` is False."""
  if packed:
    o, lse = o[0], None if lse is None else lse[0]
  if not return_lse:
    return o
  assert lse is not None
  return o, (lse * LN_2 if natural else lse)


def checked_operands(
  q, k, v, *, key_valid, k_prefix, v_prefix, segment_ids, causal, window, softcap, cu_seqlens_q, cu_seqlens_k
):
  """A launcher's start, the same on every backend: packed sequences as one
  batch row (`unpack_sequences`), the operands and the band arguments
  checked, the key sources resolved (`key_sources`). Returns `(q, k, v,
  k_prefix, v_prefix, key_valid, packed)`."""
  packed = cu_seqlens_q is not None or cu_seqlens_k is not None
  q, k, v, key_valid = unpack_sequences(q, k, v, key_valid, cu_seqlens_q, cu_seqlens_k)
  check_attention_inputs(q, k, v, key_valid, k_prefix, v_prefix, segment_ids)
  has_prefix = k_prefix is not None and k_prefix.shape[1] > 0
  check_band_arguments(causal, window, softcap, has_prefix=has_prefix, packed=packed)
  k, v, k_prefix, v_prefix, key_valid = key_sources(k, v, k_prefix, v_prefix, key_valid)
  return q, k, v, k_prefix, v_prefix, key_valid, packed


def band_window(causal: bool, window: tuple[int | None, int | None] | None, packed: bool) -> Window | None:
  """The `Window` of a call's `causal`, `window=(left, right)` (None: no
  window; a None side: unbounded) and packed sequences; None when every
  query sees every key (no band). Causal is `right = 0` (a wider right
  side is cut to it, as FlashAttention-2 does)."""
  left, right = window if window is not None else (None, None)
  if causal:
    right = 0
  if left is None and right is None and not packed:
    return None
  return Window(left, right, packed)


class Logits(NamedTuple):
  """How a kernel turns a raw dot `q . k` into the base-2 score its online
  softmax takes: `dot * sm_scale * log2(e)`, or with a logit soft cap `c`
  `c * tanh(dot * sm_scale / c) * log2(e)` (Gemma 2, FlashAttention-2's
  `softcap`: the cap applies to the scaled score, before masks).
  `of(sm_scale, softcap)` in a kernel, outside its key loop."""

  into: Any  # what the dot is multiplied by first
  cap: float | None  # None: no soft cap

  @classmethod
  def of(cls, sm_scale, softcap: float | None) -> Logits:
    return cls(sm_scale * LOG2_E, None) if softcap is None else cls(sm_scale / softcap, softcap)

  def scores(self, dot):
    """`(s, slope)`: base-2 scores and `d score / d (dot * sm_scale)`
    (`1 - tanh**2` with a cap, None without: the backward's factor)."""
    if self.cap is None:
      return dot * self.into, None
    t = jnp.tanh(dot * self.into)
    return t * (self.cap * LOG2_E), 1.0 - t * t


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


def load_rows(ref, start, block: int, valid, other: Any, masked: bool, head=None):
  """Rows `[start, start + block)` of `ref` (`[N]` or `[N, D]`; with `head`,
  of that head of a `[N, G, D]` or `[G, N]` ref: one indexer, which the
  Triton lowering needs); with `masked`, `other` from row `valid` on (a
  traced start: the slice may overhang the ref)."""
  rows = pl.ds(start, block)
  if head is None:
    index, vector = (rows if len(ref.shape) == 1 else (rows, slice(None))), len(ref.shape) == 1
  else:
    index, vector = ((rows, head, slice(None)) if len(ref.shape) == 3 else (head, rows)), len(ref.shape) == 2
  if not masked:
    return ref[index]
  in_bounds = start + jnp.arange(block) < valid
  return plgpu.load(ref.at[index], mask=in_bounds if vector else in_bounds[:, None], other=other)


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

  def visible(self, start, in_bounds, k, v, q_segments, band=None):
    """A masked block of main keys from `start`: `(k, v, visible)` with
    hidden rows of k and v zeroed and `visible` `[1 or rows, block_k]`
    (`band`: the query block's `RowBand`)."""
    keys = pl.ds(start, self.block_k)
    visible = in_bounds
    if self.key_valid is not None:
      visible &= plgpu.load(self.key_valid.at[keys], mask=in_bounds, other=0) != 0
      k, v = hide_keys(k, visible), hide_keys(v, visible)
    visible = visible[None, :]
    if self.segment_ids is not None:
      k_segments = plgpu.load(self.segment_ids.at[keys], mask=in_bounds, other=INVISIBLE_SEGMENT)
      visible = visible & (k_segments[None, :] <= q_segments[:, None])
    if band is not None:
      visible = visible & in_interval(start + jnp.arange(self.block_k)[None, :], band.lo[:, None], band.hi[:, None])
    return k, v, visible


def walk_keys(step: Callable[..., Any], carry: Any, keys: Keys, q_segments=None, band: RowBand | None = None) -> Any:
  """Folds `step(k, v, visible, carry)` over every key block a query block
  sees, in order: prefix blocks (only the ragged last one masked), then the
  main keys' blocks `[0, n_unmasked)` seen whole by every row (`visible`
  None: no mask, no empty row), then `[n_unmasked, n_blocks)` masked; later
  blocks are skipped. `q_segments`: the block's query segment ids (with
  segments). With a `band` (the query block's `RowBand`) only its key blocks
  are visited: masked ones before and after the blocks every row sees whole.
  Edge blocks run as loops with a traced index: their slices may extend past
  the ref, which a static index would reject; the masks cover it."""
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
    return step(*keys.visible(start, in_bounds, k, v, q_segments, band), carry)

  if band is None:
    if keys.kv_len >= block_k:  # Otherwise no whole block exists (n_unmasked = 0).
      carry = lax.fori_loop(0, n_unmasked, unmasked_body(keys.k, keys.v), carry)
    return lax.fori_loop(n_unmasked, n_blocks, masked_body, carry)
  first, full_first, full_end, end = band.blocks(n_unmasked, n_blocks)
  carry = lax.fori_loop(first, full_first, masked_body, carry)
  if keys.kv_len >= block_k:
    carry = lax.fori_loop(full_first, full_end, unmasked_body(keys.k, keys.v), carry)
  return lax.fori_loop(full_end, end, masked_body, carry)


# ---------------------------------------------------------------------------
# Bands: causal, sliding-window and packed-sequence visibility.


@dataclasses.dataclass(frozen=True)
class Window:
  """The static side of a band: query row i sees keys `lo_i <= j <= hi_i`.

  Without `packed`, the interval comes from the row's index (masks from
  program ids and iotas): query i is aligned to key `a_i = i + Nk - Nq`
  (bottom-right: the last query on the last key) and sees `a_i - left <= j
  <= a_i + right` within `[0, Nk)`; None leaves that side unbounded, and
  causal attention is `right = 0`. With `packed` (varlen: sequences packed
  along the tokens), the intervals are per-row arrays `[Nq]` int32 computed
  before the launch (`packed_intervals`)."""

  left: int | None = None
  right: int | None = None
  packed: bool = False


def window_intervals(i, window: Window, *, q_len: int, kv_len: int):
  """`(lo, hi)` of query rows `i` (int32, any shape) under an unpacked
  window: `i + Nk - Nq - left <= j <= i + Nk - Nq + right` within
  `[0, Nk)`; rows past Nq see nothing (`hi = -1`)."""
  aligned = i + (kv_len - q_len)
  lo = jnp.zeros_like(i) if window.left is None else jnp.maximum(aligned - window.left, 0)
  hi = jnp.full_like(i, kv_len - 1) if window.right is None else jnp.minimum(aligned + window.right, kv_len - 1)
  return lo, jnp.where(i < q_len, hi, -1)


def band_intervals(window: Window, cu_seqlens_q, cu_seqlens_k, *, q_len: int, kv_len: int):
  """`(lo, hi)` `[q_len]` int32 of every query row, computed by XLA before a
  launch (the Mosaic GPU kernel loads them with Q): `packed_intervals`
  for packed sequences, else `window_intervals`."""
  if window.packed:
    return packed_intervals(cu_seqlens_q, cu_seqlens_k, window, q_len=q_len, kv_len=kv_len)
  return window_intervals(jnp.arange(q_len, dtype=jnp.int32), window, q_len=q_len, kv_len=kv_len)


def in_interval(j, lo, hi):
  """`lo <= j <= hi` elementwise (broadcasting)."""
  return (j >= lo) & (j <= hi)


class RowBand(NamedTuple):
  """The band of one query block: each row's key interval `[lo, hi]`
  (`[rows]` int32; a row past Nq or that sees no key has `lo > hi`), and
  the key blocks to visit: every key some row sees lies in blocks
  `[first, end)`; blocks `[full_first, full_end)` hold only keys every row
  of the block sees (they need no band mask)."""

  lo: Any
  hi: Any
  first: Any
  full_first: Any
  full_end: Any
  end: Any

  @classmethod
  def of(cls, lo, hi, start, *, q_len: int, kv_len: int, block_k: int) -> RowBand:
    """The band of query rows `[start, start + len(lo))` with key intervals
    `[lo, hi]`, over key blocks of `block_k` (exact for any intervals:
    reductions over the rows)."""
    sees = lo <= hi
    first_key = jnp.min(jnp.where(sees, lo, kv_len))
    end_key = jnp.max(jnp.where(sees, hi + 1, 0))
    in_rows = start + jnp.arange(lo.shape[0]) < q_len
    # Keys every row sees: [max lo, min hi] over the rows (a row that sees
    # nothing makes it empty).
    full_lo = jnp.max(jnp.where(in_rows, lo, 0))
    full_end_key = jnp.min(jnp.where(in_rows, hi + 1, kv_len))
    first = first_key // block_k
    end = jnp.maximum((end_key + block_k - 1) // block_k, first)
    full_first = jnp.clip((full_lo + block_k - 1) // block_k, first, end)
    full_end = jnp.clip(full_end_key // block_k, full_first, end)
    return cls(lo, hi, first, full_first, full_end, end)

  def blocks(self, n_unmasked, n_blocks):
    """`(first, full_first, full_end, end)` merged with another rule's
    limits (keys `[0, n_unmasked)` blocks need no mask, none from
    `n_blocks` on), each range inside the previous one's end."""
    end = jnp.maximum(jnp.minimum(self.end, n_blocks), self.first)
    full_first = jnp.clip(self.full_first, self.first, end)
    full_end = jnp.clip(jnp.minimum(self.full_end, n_unmasked), full_first, end)
    return self.first, full_first, full_end, end


@dataclasses.dataclass(frozen=True)
class Band:
  """A `Window` in a kernel, for one (batch row, head): `q_len`, `kv_len`
  the sequence lengths (packed: the total tokens); `lo`, `hi` the refs of
  the per-row intervals (`[Nq]` int32) when packed."""

  window: Window
  q_len: int
  kv_len: int
  lo: Any = None
  hi: Any = None

  def intervals(self, start, rows: int):
    """`(lo, hi)` `[rows]` int32 of query rows `[start, start + rows)`;
    rows past Nq see nothing (`lo > hi`)."""
    i = start + jnp.arange(rows)
    if self.window.packed:
      masked = self.q_len % rows != 0
      lo = load_rows(self.lo, start, rows, self.q_len, self.kv_len, masked)
      hi = load_rows(self.hi, start, rows, self.q_len, -1, masked)
      return lo, hi
    return window_intervals(i, self.window, q_len=self.q_len, kv_len=self.kv_len)

  def rows(self, start, rows: int, block_k: int) -> RowBand:
    """The `RowBand` of query rows `[start, start + rows)` over key blocks
    of `block_k`."""
    lo, hi = self.intervals(start, rows)
    return RowBand.of(lo, hi, start, q_len=self.q_len, kv_len=self.kv_len, block_k=block_k)

  def query_blocks(self, k_start, block_k: int, block_q: int):
    """Unpacked bands only: `(first, end)` query blocks outside of which no
    query sees a key of `[k_start, k_start + block_k)` (the dK/dV walk):
    key j is seen by queries `j - offset - right <= i <= j - offset + left`."""
    offset = self.kv_len - self.q_len
    left, right = self.window.left, self.window.right
    last_key = jnp.minimum(k_start + block_k, self.kv_len) - 1
    first_q = 0 if right is None else jnp.maximum(k_start - offset - right, 0)
    end_q = self.q_len if left is None else jnp.minimum(last_key - offset + left + 1, self.q_len)
    first = first_q // block_q
    return first, jnp.maximum((end_q + block_q - 1) // block_q, first)


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


def packed_intervals(cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array, window: Window, *, q_len: int, kv_len: int):
  """`(lo, hi)` `[q_len]` int32: the key interval of each packed query token
  (a packed `Band`'s rows).

  Sequence s holds query tokens `[cu_seqlens_q[s], cu_seqlens_q[s+1])` and
  keys `[cu_seqlens_k[s], cu_seqlens_k[s+1])`; token t belongs to sequence
  `s = #{0 < s' < S : cu_seqlens_q[s'] <= t}` when `cu_seqlens_q[0] <= t <
  cu_seqlens_q[S]` (else to none: it sees nothing). Within its sequence it
  is aligned bottom-right, to key `a_t = t + cu_seqlens_k[s+1] -
  cu_seqlens_q[s+1]`, and sees the sequence's keys in `[a_t - left, a_t +
  right]` (None: unbounded). The same rule for any cu_seqlens (checked mode
  validates them), computed in O(Nq + S)."""
  num_seqs = cu_seqlens_q.shape[0] - 1
  t = jnp.arange(q_len, dtype=jnp.int32)
  if num_seqs < 1:
    return jnp.full((q_len,), kv_len, jnp.int32), jnp.full((q_len,), -1, jnp.int32)
  cu_q, cu_k = cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32)
  # Each later sequence start at or before t adds one (a scatter and a cumsum,
  # not a search per token); starts past the tokens drop out.
  starts = jnp.zeros((q_len + 1,), jnp.int32).at[jnp.clip(cu_q[1:-1], 0, q_len)].add(1)
  seq = jnp.cumsum(starts)[:q_len]
  in_seq = (t >= cu_q[0]) & (t < cu_q[num_seqs])
  seq_start_k, seq_end_k = cu_k[seq], cu_k[seq + 1]
  aligned = t + seq_end_k - cu_q[seq + 1]
  lo = seq_start_k if window.left is None else jnp.maximum(seq_start_k, aligned - window.left)
  hi = seq_end_k - 1 if window.right is None else jnp.minimum(seq_end_k - 1, aligned + window.right)
  lo, hi = jnp.maximum(lo, 0), jnp.minimum(hi, kv_len - 1)
  return jnp.where(in_seq, lo, kv_len), jnp.where(in_seq & (lo <= hi), hi, -1)


def band_query_block_limits(lo: jax.Array, hi: jax.Array, *, kv_len: int, block_q: int, block_k: int) -> jax.Array:
  """Per key block: `[first, end)` query blocks outside of which no query
  sees a key of the block, for per-row intervals `lo`, `hi` `[Nq]` (a
  packed band's; the dK/dV walk). Exact for any intervals: rows before the
  first whose running max of `hi` reaches the block see none of it, and so
  do rows from the last whose suffix min of `lo` is below its end (both
  helper sequences are nondecreasing: each bound is one fused count).
  Returns int32 `[cdiv(kv_len, block_k), 2]`."""
  num_k_blocks = cdiv(kv_len, block_k)
  sees = lo <= hi
  running_hi = lax.cummax(jnp.where(sees, hi, -1), axis=0)
  suffix_lo = lax.cummin(jnp.where(sees, lo, kv_len), axis=0, reverse=True)
  k_start = jnp.arange(num_k_blocks, dtype=jnp.int32) * block_k
  k_end = jnp.minimum(k_start + block_k, kv_len)
  first_q = jnp.sum(running_hi[None, :] < k_start[:, None], axis=1, dtype=jnp.int32)
  end_q = jnp.sum(suffix_lo[None, :] < k_end[:, None], axis=1, dtype=jnp.int32)
  first = first_q // block_q
  return jnp.stack([first, jnp.maximum((end_q + block_q - 1) // block_q, first)], axis=-1)
