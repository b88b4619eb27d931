"""Dense attention definitions (SPEC 4.4-4.6), one flash kernel for all four.

* `noncausal_dense_attention_h32_d{64,128}`: softmax over the keys with
  `key_valid` true (LTX-2.5 self- and cross-attention; text cross-attention,
  variants `attn2` / `audio_attn2`, pads its 1024 keys).
* `prefix_cached_block_causal_h32_d128`: target queries see every cached
  prefix key and every target key (Qwen-Image-2.1).
* `prefix_cached_block_causal_h32_d128_prefix0` *(inferred)*: the prefix pass,
  block-causal over segments (`segment_ids[j] <= segment_ids[i]`).

Scale `D**-0.5`, fp32 scores and softmax, one rounding to bf16; a lonely row
(no visible key) is 0. Kernel: `pallas_kernels.flash_attention`.

The ops (contracts in their docstrings) take `sm_scale` as a Python float or
a traced scalar, and are differentiable in q, k, v, the prefix and
`sm_scale` (Pallas: FlashAttention-2 backward kernels), hidden keys getting
gradient 0 (a NaN or Inf in them reaches no gradient either).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkern import dispatch, roofline
from jaxkern.contract import Checks, public_op
from jaxkern.family import OpImpl, Precondition, cdiv, varying_like
from jaxkern.spmd import CONTRACTION, Split
from pallas_kernels.flash_attention import KERNELS

# Variants whose keys are padded text tokens (cross-attention to the prompt).
_PADDED_TEXT_VARIANTS = frozenset({"attn2", "audio_attn2"})

# cpu_axes budget: B * Nq * (keys per query), H kept at 32: a shrunk
# recorded workload interprets in a second or two (measurements:
# docs/perf/cpu_budgets.md).
_CPU_PAIR_BUDGET = 160_000
# Sequence lengths up to this are kept as recorded at CPU scale (51, 126, the
# 25-32 token prefixes); longer ones shrink but stay longer than these.
_CPU_KEEP_LEN = 64


# ---------------------------------------------------------------------------
# References (plain jnp, fp32, bounded memory).


def attention_reference(
  q,
  k,
  v,
  *,
  key_valid=None,
  k_prefix=None,
  v_prefix=None,
  segment_ids=None,
  sm_scale=None,
  causal: bool = False,
  window: tuple[int | None, int | None] | None = None,
  softcap: float | None = None,
  cu_seqlens_q=None,
  cu_seqlens_k=None,
  return_lse: bool = False,
  q_chunk: int = 1024,
  k_chunk: int = 4096,
) -> Any:
  """Attention of q [B, Nq, H, D] over the visible keys of k, v
  [B, Nk, Hkv, D] (Hkv divides H: query head h reads key/value head
  h // (H / Hkv)), after the prefix k_prefix, v_prefix [B, Np, Hkv, D],
  every prefix key visible: key j visible to query i unless
  `key_valid[b, j]` is False, with `segment_ids` (Nk == Nq) unless
  `segment_ids[j] > segment_ids[i]`, and with a band unless j lies outside
  query i's key interval (`_key_intervals`: `causal`, `window=(left,
  right)`, bottom-right aligned; packed sequences `cu_seqlens_q`,
  `cu_seqlens_k`, q [T, H, D] and k, v [Tk, Hkv, D], each sequence on its
  own keys). Scores `q.k * sm_scale` (default D**-0.5), with `softcap` c
  `c * tanh(score / c)`, before masks.

  fp32 scores and softmax at HIGHEST matmul precision, one rounding at the
  end, lonely rows 0. Returns o like q, and with `return_lse` also lse
  [B, H, Nq] (packed: [H, T]) f32, the natural log of each row's softmax
  denominator, +inf for a lonely row. Memory stays bounded: one query head
  and `q_chunk` query rows at a time (`lax.map` over key/value heads, their
  query heads and query chunks), and the keys in `k_chunk` steps of an
  online softmax (`lax.scan`): `[B, q_chunk, k_chunk]` fp32 scores (64 MiB
  at B=4); with Nk <= k_chunk one step, the plain softmax.

  Hidden keys are selected away, never multiplied by zero: their keys and
  values by `where` (key_valid), their scores by `where`, and under
  segments or a band each query's sum takes only its visible values
  (`_visible_values_sum`): a NaN or Inf a query cannot see reaches neither
  its output nor a gradient, and gradients of hidden keys are exactly 0.
  Differentiable (plain JAX autodiff; the softmax max is a constant of the
  gradient, as it is mathematically).
  """
  packed = cu_seqlens_q is not None
  if packed:
    q, k, v = q[None], k[None], v[None]
    key_valid = None if key_valid is None else key_valid[None]
  batch, q_len, num_heads, head_dim = q.shape
  kv_heads = k.shape[2]
  group = num_heads // kv_heads
  kv_len = k.shape[1]
  banded = causal or window is not None or packed
  if banded and k_prefix is not None and k_prefix.shape[1]:
    raise ValueError("attention_reference: causal, window and packed sequences take no prefix keys")

  def finish(o, lse):  # packed: back to [T, H, D] and [H, T]
    o, lse = (o[0], lse[0]) if packed else (o, lse)
    return (o, lse) if return_lse else o

  if q_len == 0:
    return finish(jnp.zeros(q.shape, q.dtype), jnp.zeros((batch, num_heads, 0), jnp.float32))
  sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
  key_visible = jnp.ones((batch, kv_len), bool) if key_valid is None else key_valid.astype(bool)
  q_segments = jnp.zeros((batch, q_len), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  k_segments = q_segments if segment_ids is not None else jnp.zeros((batch, kv_len), jnp.int32)
  # Each query row's key interval [first, end) and band around `aligned`.
  first, end, aligned = _key_intervals(q_len, kv_len, cu_seqlens_q, cu_seqlens_k)
  left, right = window if window is not None else (None, None)
  right = 0 if causal else right
  if k_prefix is not None and k_prefix.shape[1]:
    if v_prefix is None:
      raise ValueError("attention_reference: k_prefix needs v_prefix")
    prefix_len = k_prefix.shape[1]
    k = jnp.concatenate([k_prefix, k], axis=1)
    v = jnp.concatenate([v_prefix, v], axis=1)
    key_visible = jnp.concatenate([jnp.ones((batch, prefix_len), bool), key_visible], axis=1)
    # The smallest segment id: every query sees the prefix.
    k_segments = jnp.concatenate(
      [jnp.full((batch, prefix_len), jnp.iinfo(jnp.int32).min, jnp.int32), k_segments], axis=1
    )
  num_keys = k.shape[1]
  if not num_keys:  # no key: every row lonely
    return finish(jnp.zeros(q.shape, q.dtype), jnp.full((batch, num_heads, q_len), jnp.inf, jnp.float32))
  hidden = ~key_visible[:, :, None, None]
  k, v = jnp.where(hidden, jnp.zeros_like(k), k), jnp.where(hidden, jnp.zeros_like(v), v)

  # Query chunks: [Hkv, G, chunks, B, chunk, D] queries, [chunks, ...] row data.
  chunk = min(q_chunk, q_len)
  num_chunks = cdiv(q_len, chunk)
  pad = num_chunks * chunk - q_len

  def by_chunk(x):  # [B, Nq] -> [chunks, B, chunk] (padding rows: any values, sliced off)
    return jnp.pad(x, ((0, 0), (0, pad))).reshape(x.shape[0], num_chunks, chunk).transpose(1, 0, 2)

  q_chunks = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  q_chunks = q_chunks.reshape(batch, num_chunks, chunk, kv_heads, group, head_dim).transpose(3, 4, 1, 0, 2, 5)
  rows = (by_chunk(q_segments), *(by_chunk(jnp.broadcast_to(x, (batch, q_len))) for x in (first, end, aligned)))

  # Key chunks: [key chunks, B, k_chunk] positions, visibility, segments (padding keys hidden).
  key_step = min(k_chunk, num_keys)
  num_key_chunks = cdiv(num_keys, key_step)
  key_pad = num_key_chunks * key_step - num_keys

  def by_key_chunk(x, fill):  # [B, Nk, ...] -> [key chunks, B, key_step, ...]
    x = jnp.pad(x, [(0, 0), (0, key_pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return x.reshape(batch, num_key_chunks, key_step, *x.shape[2:]).swapaxes(0, 1)

  positions = jnp.broadcast_to(jnp.arange(num_keys, dtype=jnp.int32), (batch, num_keys))  # (a band has no prefix)
  key_rows = (
    by_key_chunk(positions, 0),
    by_key_chunk(key_visible, False),
    by_key_chunk(k_segments, 0),
  )
  k_by_head = by_key_chunk(k, 0).transpose(3, 0, 1, 2, 4)  # [Hkv, key chunks, B, key_step, D]
  v_by_head = by_key_chunk(v, 0).transpose(3, 0, 1, 2, 4)

  def one_kv_head(args):
    q_h, k_h, v_h = args  # [G, chunks, B, c, D], [key chunks, B, key_step, D] x2
    k_h, v_h = k_h.astype(jnp.float32), v_h.astype(jnp.float32)

    def one_chunk(args):
      q_c, (seg_c, first_c, end_c, aligned_c) = args  # [B, c, D], [B, c] x4
      q_c = q_c.astype(jnp.float32)

      def one_key_chunk(carry, args):
        m, l, acc = carry  # [B, c, 1], [B, c, 1], [B, c, D]
        k_c, v_c, (pos, key_vis, key_seg) = args  # [B, key_step, D] x2, [B, key_step] x3
        s = jnp.einsum("bqd,bkd->bqk", q_c, k_c, precision=lax.Precision.HIGHEST) * sm_scale
        if softcap is not None:
          s = softcap * jnp.tanh(s / softcap)
        visible = key_vis[:, None, :] & (key_seg[:, None, :] <= seg_c[:, :, None])
        if banded:
          j, a = pos[:, None, :], aligned_c[:, :, None]
          in_band = (j >= first_c[:, :, None]) & (j < end_c[:, :, None])
          if left is not None:
            in_band &= j >= a - left
          if right is not None:
            in_band &= j <= a + right
          visible &= in_band
        s = jnp.where(visible, s, -jnp.inf)
        m_next = lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.exp(s - m_safe)  # 0 where not visible
        correction = jnp.exp(m - m_safe)
        if segment_ids is None and not banded:  # hidden values are already 0
          pv = jnp.einsum("bqk,bkd->bqd", p, v_c, precision=lax.Precision.HIGHEST)
        else:
          pv = _visible_values_sum(p, visible, v_c)
        return (m_next, correction * l + jnp.sum(p, axis=-1, keepdims=True), correction * acc + pv), None

      start = (
        jnp.full((batch, chunk, 1), -jnp.inf, jnp.float32),
        jnp.zeros((batch, chunk, 1), jnp.float32),
        jnp.zeros((batch, chunk, head_dim), jnp.float32),
      )
      start = varying_like(start, q_c, k_h, v_h)  # inside a shard_map: the body's types
      (m, l, acc), _ = lax.scan(one_key_chunk, start, (k_h, v_h, key_rows))
      seen = l > 0
      o = jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0).astype(q.dtype)
      lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)[..., 0]
      return o, lse

    return lax.map(lambda q_g: lax.map(one_chunk, (q_g, rows)), q_h)  # [G, chunks, B, c, D], [G, chunks, B, c]

  o, lse = lax.map(one_kv_head, (q_chunks, k_by_head, v_by_head))
  o = o.reshape(num_heads, num_chunks, batch, chunk, head_dim).transpose(2, 1, 3, 0, 4)
  o = o.reshape(batch, num_chunks * chunk, num_heads, head_dim)[:, :q_len]
  lse = lse.reshape(num_heads, num_chunks, batch, chunk).transpose(2, 0, 1, 3)
  lse = lse.reshape(batch, num_heads, num_chunks * chunk)
  return finish(o, lse[..., :q_len])


def _key_intervals(q_len: int, kv_len: int, cu_seqlens_q=None, cu_seqlens_k=None):
  """`(first, end, aligned)` `[1, Nq]` int32: query i sees only keys
  `first <= j < end` and is aligned to key `aligned` (the band's centre:
  bottom-right, the last query of a sequence on its last key).

  Unpacked: every key, `aligned = i + Nk - Nq`. Packed: query token t is in
  sequence s when `cu_seqlens_q[s] <= t < cu_seqlens_q[s + 1]` (the last
  such s; tokens before `cu_seqlens_q[0]` or from `cu_seqlens_q[S]` on are
  in none and see nothing), sees the keys `[cu_seqlens_k[s],
  cu_seqlens_k[s + 1])` and is aligned to `t + cu_seqlens_k[s + 1] -
  cu_seqlens_q[s + 1]`."""
  t = jnp.arange(q_len, dtype=jnp.int32)
  if cu_seqlens_q is None or cu_seqlens_k is None:
    return (jnp.zeros((1, q_len), jnp.int32), jnp.full((1, q_len), kv_len, jnp.int32), (t + kv_len - q_len)[None])
  cu_q, cu_k = cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32)
  num_seqs = cu_q.shape[0] - 1
  if num_seqs < 1:
    return jnp.zeros((1, q_len), jnp.int32), jnp.zeros((1, q_len), jnp.int32), t[None]
  seq = jnp.sum(cu_q[None, 1:num_seqs] <= t[:, None], axis=1)  # the later sequences started by t
  in_seq = (t >= cu_q[0]) & (t < cu_q[num_seqs])
  first = jnp.where(in_seq, cu_k[seq], 0)
  end = jnp.where(in_seq, cu_k[seq + 1], 0)
  return first[None], end[None], (t + cu_k[seq + 1] - cu_q[seq + 1])[None]


def _visible_values_sum(p: jax.Array, visible: jax.Array, v: jax.Array) -> jax.Array:
  """sum_k p[b,q,k] v[b,k,:] over the keys visible to each query: `[B, c, D]`.

  Where a query hides a key its neighbours see (segments), p = 0 there but
  0 * NaN is NaN: when some value is not finite the sum selects per query
  (`where`, one query row at a time: `[B, Nk, D]` memory); otherwise the
  matmul is exact (0 * finite = 0)."""

  def matmul():
    return jnp.einsum("bqk,bkd->bqd", p, v, precision=lax.Precision.HIGHEST)

  def selected():
    def one_query(args):
      p_q, visible_q = args  # [B, Nk] each
      return jnp.sum(jnp.where(visible_q[..., None], p_q[..., None] * v, 0.0), axis=1)

    return lax.map(one_query, (p.transpose(1, 0, 2), visible.transpose(1, 0, 2))).transpose(1, 0, 2)

  return lax.cond(jnp.all(jnp.isfinite(v)), matmul, selected)


def noncausal_attention_reference(q, k, v, key_valid=None, *, sm_scale=None) -> jax.Array:
  """softmax(q k^T * sm_scale) v over the keys with key_valid (all without)."""
  return attention_reference(q, k, v, key_valid=key_valid, sm_scale=sm_scale)


def prefix_cached_attention_reference(q, k, v, k_prefix, v_prefix, *, sm_scale=None) -> jax.Array:
  """Attention of q over the keys concat(k_prefix, k), all visible."""
  return attention_reference(q, k, v, k_prefix=k_prefix, v_prefix=v_prefix, sm_scale=sm_scale)


def block_causal_attention_reference(q, k, v, segment_ids, *, sm_scale=None) -> jax.Array:
  """Key j visible to query i iff segment_ids[j] <= segment_ids[i]."""
  return attention_reference(q, k, v, segment_ids=segment_ids, sm_scale=sm_scale)


# ---------------------------------------------------------------------------
# Input synthesis.


def _normal_bf16(key: jax.Array, *shapes) -> list[jax.Array]:
  """Independent N(0, 1) bf16 arrays. q, k, v are post-norm / post-RoPE
  activations: unit-variance entries give q.k/sqrt(D) unit variance, so the
  softmax is neither flat nor one-hot."""
  keys = jax.random.split(key, len(shapes))
  return [jax.random.normal(k, shape, jnp.bfloat16) for k, shape in zip(keys, shapes)]


def padded_text_key_valid(key: jax.Array, batch: int, kv_len: int) -> jax.Array:
  """`[B, Nk]` bool: batch row b sees its first `len_b` keys, `len_b` uniform
  in `[ceil(Nk/8), Nk]` (a prompt padded to Nk text tokens)."""
  lengths = jax.random.randint(key, (batch,), max(1, cdiv(kv_len, 8)), kv_len + 1)
  return jnp.arange(kv_len)[None, :] < lengths[:, None]


def segment_ends(prefix_segments, q_len: int) -> list[int]:
  """Segment end offsets for `q_len` tokens from a record's `prefix_segments`
  (`[[start, end, flag], ...]` in order, covering `[0, last end)`).

  Ends are rescaled by `q_len / last end` when the run's length differs from
  the record's, keeping every segment non-empty and the last end = `q_len`.
  With more segments than tokens only the first `q_len` segments remain.
  """
  recorded_ends = [int(seg[1]) for seg in prefix_segments]
  recorded_len = recorded_ends[-1]
  count = min(len(recorded_ends), q_len)
  ends = [round(end * q_len / recorded_len) for end in recorded_ends[:count]]
  ends[-1] = q_len
  for i in range(count):
    lower = ends[i - 1] + 1 if i else 1
    ends[i] = min(max(ends[i], lower), q_len - (count - 1 - i))
  return ends


def segment_ids_from_ends(ends: list[int], batch: int, q_len: int) -> jax.Array:
  """`[B, Nq]` int32: token t gets the index of the segment containing it."""
  ids = jnp.searchsorted(jnp.asarray(ends, jnp.int32), jnp.arange(q_len, dtype=jnp.int32), side="right").astype(
    jnp.int32
  )
  return jnp.broadcast_to(ids, (batch, q_len))


def make_noncausal_inputs(axes: Mapping[str, int], key: jax.Array, record: dict | None = None) -> dict[str, jax.Array]:
  """q, k, v ~ N(0, 1) bf16. key_valid: a valid prefix of random length per
  batch row for the padded-text variants (`attn2`, `audio_attn2`), else all
  true; all true without a record. Lengths come from `axes`, so a scaled run
  pads its own (smaller) key count the same way."""
  b, nq, nk, h, d = (int(axes[n]) for n in ("B", "Nq", "Nk", "H", "D"))
  key_qkv, key_valid_len = jax.random.split(key)
  q, k, v = _normal_bf16(key_qkv, (b, nq, h, d), (b, nk, h, d), (b, nk, h, d))
  if record is not None and record.get("variant") in _PADDED_TEXT_VARIANTS:
    key_valid = padded_text_key_valid(key_valid_len, b, nk)
  else:
    key_valid = jnp.ones((b, nk), bool)
  return {"q": q, "k": k, "v": v, "key_valid": key_valid}


def make_prefix_cached_inputs(
  axes: Mapping[str, int], key: jax.Array, record: dict | None = None
) -> dict[str, jax.Array]:
  """q, k, v, k_prefix, v_prefix ~ N(0, 1) bf16. No mask input, so the
  record's `prefix_segments` (the prefix's own structure) are not needed."""
  del record
  b, nq, np_, h, d = (int(axes[n]) for n in ("B", "Nq", "Np", "H", "D"))
  q, k, v, k_prefix, v_prefix = _normal_bf16(key, *[(b, nq, h, d)] * 3, *[(b, np_, h, d)] * 2)
  return {"q": q, "k": k, "v": v, "k_prefix": k_prefix, "v_prefix": v_prefix}


def make_block_causal_inputs(
  axes: Mapping[str, int], key: jax.Array, record: dict | None = None
) -> dict[str, jax.Array]:
  """q, k, v ~ N(0, 1) bf16; segment_ids from the record's `prefix_segments`
  (rescaled to `axes['Nq']`, see `segment_ends`). Without a record (or
  without `prefix_segments`) all tokens form one segment: plain non-causal
  attention, the 25-32 token text-only records' structure."""
  b, nq, h, d = (int(axes[n]) for n in ("B", "Nq", "H", "D"))
  q, k, v = _normal_bf16(key, *[(b, nq, h, d)] * 3)
  segments = (record or {}).get("prefix_segments") or [[0, nq, False]]
  ids = segment_ids_from_ends(segment_ends(segments, nq), b, nq)
  return {"q": q, "k": k, "v": v, "segment_ids": ids}


# ---------------------------------------------------------------------------
# CPU scale.


def _shrink_length(n: int, factor: float) -> int:
  """About `n / factor`, but short lengths stay as recorded and long ones stay
  longer than every kept short one. Multiples of 128 (1024, 2560, 4096) stay
  multiples of 128; other lengths keep their residue mod 64 (2352 -> 48,
  1120 -> 32, 4125 -> 29), so they stay ragged for every block size the
  kernel uses."""
  if n <= _CPU_KEEP_LEN or factor <= 1:
    return n
  target = n / factor
  if n % 128 == 0:
    return 128 * max(1, round(target / 128))
  residue = n % 64
  return 64 * max(1, round((target - residue) / 64)) + residue


def _keys_per_query(axes: Mapping[str, int]) -> int:
  if "Nk" in axes:
    return axes["Nk"]
  return axes["Nq"] + axes.get("Np", 0)


def cpu_axes(axes: Mapping[str, int]) -> dict[str, int]:
  """B capped at 2; Nq, Nk, Np shrunk by one common factor until
  B * Nq * keys fits `_CPU_PAIR_BUDGET` (see `_shrink_length`); H and D kept.
  If Nq and Nk differed they still differ (interpret-mode time at these
  sizes: docs/perf/cpu_budgets.md)."""
  out = dict(axes)
  out["B"] = min(int(axes["B"]), 2)
  lengths = [n for n in ("Nq", "Nk", "Np") if n in axes]
  factor = 1.0
  while True:
    for n in lengths:
      out[n] = _shrink_length(int(axes[n]), factor)
    if out["B"] * out["Nq"] * _keys_per_query(out) <= _CPU_PAIR_BUDGET:
      break
    factor *= 1.1
  if "Nk" in axes and axes["Nq"] != axes["Nk"] and out["Nq"] == out["Nk"]:
    longer = "Nq" if axes["Nq"] > axes["Nk"] else "Nk"
    out[longer] += 128 if axes[longer] % 128 == 0 else 64
  return out


# ---------------------------------------------------------------------------
# Roofline cost (`OpImpl.cost`, see `jaxkern.roofline`).


def noncausal_attention_cost(definition, axes, *, inputs=None, record=None, config=None):
  """Non-causal attention over the visible keys: FLOPs 4 H Nq D times the
  keys `key_valid` keeps, summed over batch rows (QK^T and PV; padded text
  keys are never scored). With the run's `key_valid` that count is exact;
  without it every key is counted (B Nk, a bound). Bytes: q, key_valid read
  and o written once; of k and v only the visible rows (K/V read once per
  batch row, not once per query block)."""
  b, nk = axes["B"], axes["Nk"]
  key_valid = None if inputs is None else inputs.get("key_valid")
  keys = b * nk if key_valid is None else int(np.count_nonzero(roofline.host(key_valid)))
  kv_row = (roofline.tensor_bytes(definition, "k", axes) + roofline.tensor_bytes(definition, "v", axes)) // max(
    b * nk, 1
  )
  nbytes = roofline.io_bytes(definition, axes, skip=("k", "v")) + keys * kv_row
  return roofline.Work(
    4 * axes["H"] * axes["Nq"] * axes["D"] * keys,
    nbytes,
    "bf16",
    counted_from="axes" if key_valid is None else "inputs",
  )


def prefix_cached_attention_cost(definition, axes, *, inputs=None, record=None, config=None):
  """Every target query sees Np prefix keys and Nq target keys: FLOPs
  4 B H Nq (Nq + Np) D. Bytes: q, k, v, k_prefix, v_prefix read and o
  written once."""
  flops = 4 * axes["B"] * axes["H"] * axes["Nq"] * (axes["Nq"] + axes["Np"]) * axes["D"]
  return roofline.Work(flops, roofline.io_bytes(definition, axes), "bf16")


def block_causal_pairs(segment_ends: list[int]) -> int:
  """Visible (query, key) pairs of a block-causal mask over segments ending
  at `segment_ends`: a query of segment s sees every key up to the end of s,
  so sum_s len(s) * end(s)."""
  pairs, start = 0, 0
  for end in segment_ends:
    pairs += (end - start) * end
    start = end
  return pairs


def visible_pairs(segment_ids: np.ndarray) -> int:
  """Visible (query, key) pairs of the block-causal masks of `segment_ids`
  [B, Nq]: query i sees key j iff segment_ids[j] <= segment_ids[i] (any
  order of ids)."""
  pairs = 0
  for row in np.asarray(segment_ids).reshape(-1, np.shape(segment_ids)[-1]):
    pairs += int(np.searchsorted(np.sort(row), row, side="right").sum())
  return pairs


def block_causal_attention_cost(definition, axes, *, inputs=None, record=None, config=None):
  """Block-causal over segments: only visible pairs are counted, FLOPs
  4 H D * pairs. The pairs come from the run's `segment_ids`
  (`visible_pairs`); without inputs, from the record's `prefix_segments`
  rescaled to Nq as the replay synthesizes them (B times
  `block_causal_pairs(ends)`); without either, one segment (B Nq^2, a
  bound). Bytes: q, k, v, segment_ids read and o written once."""
  b, nq = axes["B"], axes["Nq"]
  segment_ids = None if inputs is None else inputs.get("segment_ids")
  if segment_ids is not None:
    pairs, source = visible_pairs(roofline.host(segment_ids)), "inputs"
  else:
    segments = (record or {}).get("prefix_segments")
    pairs, source = b * block_causal_pairs(segment_ends(segments, nq) if segments else [nq]), "axes"
  return roofline.Work(
    4 * axes["H"] * axes["D"] * pairs, roofline.io_bytes(definition, axes), "bf16", counted_from=source
  )


# ---------------------------------------------------------------------------
# One flash kernel serves all four definitions: its optional key sources and
# masks are keyword arguments named like the definitions' inputs.


def segment_preconditions(inputs: Mapping[str, jax.Array]) -> list[Precondition]:
  """Checked mode: segment ids nondecreasing along the tokens of each row."""
  ids = inputs["segment_ids"]
  rises = jnp.concatenate(
    [jnp.ones(ids.shape[:-1] + (min(ids.shape[-1], 1),), bool), ids[..., 1:] >= ids[..., :-1]], axis=-1
  )
  return [Precondition("segment_ids", rises, "nondecreasing along Nq (segment_ids[b, i] >= segment_ids[b, i-1])")]


def _impl(reference, make_inputs, cost, split, preconditions=None) -> OpImpl:
  return OpImpl(
    reference=reference,
    kernels=KERNELS,
    make_inputs=make_inputs,
    cpu_axes=cpu_axes,
    cost=cost,
    split=split,
    preconditions=preconditions,
  )


# How the ops split across devices (`jaxkern.spmd`): batch, heads and, where
# every query sees the same keys, queries; a softmax runs over all keys.
_KEYS = "each query's softmax runs over all keys"
_REASONS = {"t": _KEYS, "p": _KEYS, "d": CONTRACTION}
_QKV = {"q": "b s h d", "k": "b t h d", "v": "b t h d"}
NONCAUSAL_SPLIT = Split(
  inputs={**_QKV, "key_valid": "b t"}, outputs=("b s h d",), independent="b s h", reasons=_REASONS
)
PREFIX_CACHED_SPLIT = Split(
  inputs={**_QKV, "k_prefix": "b p h d", "v_prefix": "b p h d"},
  outputs=("b s h d",),
  independent="b s h",
  reasons=_REASONS,
)
# Block-causal: queries and keys are the same tokens (one name, `s`).
BLOCK_CAUSAL_SPLIT = Split(
  inputs={"q": "b s h d", "k": "b s h d", "v": "b s h d", "segment_ids": "b s"},
  outputs=("b s h d",),
  independent="b h",
  reasons={**_REASONS, "s": _KEYS},
)
NONCAUSAL = _impl(noncausal_attention_reference, make_noncausal_inputs, noncausal_attention_cost, NONCAUSAL_SPLIT)
PREFIX_CACHED = _impl(
  prefix_cached_attention_reference, make_prefix_cached_inputs, prefix_cached_attention_cost, PREFIX_CACHED_SPLIT
)
BLOCK_CAUSAL = _impl(
  block_causal_attention_reference,
  make_block_causal_inputs,
  block_causal_attention_cost,
  BLOCK_CAUSAL_SPLIT,
  segment_preconditions,
)
IMPLS = (NONCAUSAL, PREFIX_CACHED, BLOCK_CAUSAL)


# ---------------------------------------------------------------------------
# Public ops (`jaxkern.ops`), dispatched by `jaxkern.dispatch`.


def _check_qkv(c: Checks, q, k, v, *, self_attention: bool) -> None:
  """q [B, Nq, H, D]; k, v [B, Nk, H, D] (Nk = Nq for self-attention) in q's float dtype."""
  c.rank("q", q, "[B, Nq, H, D]", 4)
  batch, q_len, heads, head_dim = q.shape
  why = "B, N, H, D from q" if self_attention else "B, H, D from q"
  c.shape("k", k, (batch, q_len if self_attention else None, heads, head_dim), "[B, Nk, H, D]", why)
  c.shape("v", v, k.shape, "[B, Nk, H, D]", "k's shape")
  c.floating("q", q)
  c.same_dtype("k", k, "q", q)
  c.same_dtype("v", v, "q", q)


def _check_grouped_kv(c: Checks, q, k, v, *, packed: bool) -> None:
  """k, v [B, Nk, Hkv, D] (packed: [Tk, Hkv, D]) in q's dtype, Hkv dividing q's H."""
  layout = "[Tk, Hkv, D]" if packed else "[B, Nk, Hkv, D]"
  c.rank("k", k, layout, 3 if packed else 4)
  heads, head_dim = q.shape[-2:]
  expected = (None, None, head_dim) if packed else (q.shape[0], None, None, head_dim)
  c.shape("k", k, expected, layout, "D from q" if packed else "B, D from q")
  kv_heads = k.shape[-2]
  if not kv_heads or heads % kv_heads:
    c.fail("k", f"{layout} with Hkv dividing H = {heads} (q's heads)", f"shape {tuple(k.shape)}")
  c.shape("v", v, k.shape, layout, "k's shape")
  c.floating("q", q)
  c.same_dtype("k", k, "q", q)
  c.same_dtype("v", v, "q", q)


def _check_flag(c: Checks, name: str, value: Any) -> None:
  if not isinstance(value, (bool, np.bool_)):
    c.fail(name, "a Python bool", repr(value))


def validate_attention(
  q,
  k,
  v,
  key_valid=None,
  *,
  causal=False,
  window=None,
  softcap=None,
  sm_scale=None,
  return_lse=False,
  cu_seqlens_q=None,
  cu_seqlens_k=None,
  **_,
) -> None:
  """The contract of `attention` (`jaxkern.contract`)."""
  c = Checks("attention")
  packed = cu_seqlens_q is not None or cu_seqlens_k is not None
  if packed:
    if cu_seqlens_q is None or cu_seqlens_k is None:
      missing = "cu_seqlens_q" if cu_seqlens_q is None else "cu_seqlens_k"
      return c.fail(missing, "an int32 array [S + 1] (cu_seqlens_q and cu_seqlens_k go together)", "None")
    c.rank("cu_seqlens_q", cu_seqlens_q, "[S + 1]", 1)
    c.shape("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape, "[S + 1]", "cu_seqlens_q's shape")
    if not cu_seqlens_q.shape[0]:
      c.fail("cu_seqlens_q", "[S + 1] with S >= 0 (at least the leading 0)", "shape (0,)")
    c.dtype("cu_seqlens_q", cu_seqlens_q, [np.int32])
    c.dtype("cu_seqlens_k", cu_seqlens_k, [np.int32])
    c.rank("q", q, "[T, H, D] (packed sequences: cu_seqlens given)", 3)
  else:
    c.rank("q", q, "[B, Nq, H, D]", 4)
  _check_grouped_kv(c, q, k, v, packed=packed)
  if key_valid is not None:
    if packed:
      c.shape("key_valid", key_valid, k.shape[:1], "[Tk]", "Tk from k")
    else:
      c.shape("key_valid", key_valid, k.shape[:2], "[B, Nk]", "B, Nk from k")
    c.boolean_or_integer("key_valid", key_valid)
  _check_flag(c, "causal", causal)
  if window is not None:
    pair = isinstance(window, (tuple, list)) and len(window) == 2
    if not pair or any(
      side is not None and (isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)) or side < 0)
      for side in window
    ):
      c.fail("window", "None or a (left, right) pair, each None (unbounded) or an int >= 0", repr(window))
  if softcap is not None and (
    isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf")
  ):
    c.fail("softcap", "None or a positive finite Python number (compiled into the kernel)", repr(softcap))
  _check_flag(c, "return_lse", return_lse)
  c.scalar("sm_scale", sm_scale, optional=True)


@public_op(validate_attention)
def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  key_valid: jax.Array | None = None,
  *,
  causal: bool = False,
  window: tuple[int | None, int | None] | None = None,
  softcap: float | None = None,
  sm_scale: float | jax.Array | None = None,
  return_lse: bool = False,
  cu_seqlens_q: jax.Array | None = None,
  cu_seqlens_k: jax.Array | None = None,
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Softmax attention `softmax(q k^T * sm_scale) v` over the visible keys,
  [B, N, H, D] layout or packed sequences.

  Contract:

  * q [B, Nq, H, D]; k, v [B, Nk, Hkv, D], one float dtype (bf16), any B,
    Nq, Nk >= 0. Hkv divides H (grouped-query and multi-query attention):
    query head h reads key/value head `h // (H / Hkv)`; the kernels share
    the group's K/V, never copying it per head.
  * key_valid [B, Nk] bool (optional, all visible without) hides keys from
    every query of its batch row: a hidden key's k and v are never used,
    so NaN or Inf there changes nothing.
  * causal: query i sees keys `j <= i + Nk - Nq`, aligned bottom-right (the
    last query on the last key, as FlashAttention-2 and cuDNN align it for
    Nq != Nk; Nq > Nk leaves the first Nq - Nk rows without keys).
  * window=(left, right): query i sees keys `i' - left <= j <= i' + right`
    with `i' = i + Nk - Nq` (the same alignment); None on a side leaves it
    unbounded, sides are ints >= 0; with `causal` the right side is 0
    (`window=(left, None), causal=True` is a causal sliding window, as
    FlashAttention-2's `window_size=(left, 0)`). Key blocks outside every
    query's band are neither loaded nor computed.
  * softcap c (optional, a positive Python number): each score becomes
    `c * tanh(s / c)` with `s = q.k * sm_scale`, before masks and softmax
    (Gemma 2's logit soft cap, FlashAttention-2's `softcap`).
  * sm_scale: a float or a traced scalar, default D**-0.5.
  * Packed sequences (varlen): with `cu_seqlens_q`, `cu_seqlens_k` (int32
    [S + 1] each), q is [T, H, D], k and v [Tk, Hkv, D] and key_valid [Tk]
    (no batch axis, no padding): sequence s is the queries
    `[cu_seqlens_q[s], cu_seqlens_q[s+1])` over the keys
    `[cu_seqlens_k[s], cu_seqlens_k[s+1])`, each sequence attending only
    within itself, causal and window aligned per sequence. Valid:
    nondecreasing, first 0, last T (resp. Tk); `checks=True` reports the
    first entry that is not. Outside that, a token sees the keys of the
    sequence its index falls in by the same formulas (tokens before
    `cu_seqlens_q[0]` or from `cu_seqlens_q[S]` on see nothing), the same
    on every backend.
  * A row with no visible key (a lonely row: all keys hidden, Nq > Nk under
    causal, a window that holds none, a sequence without keys) is 0, its
    lse +inf. Non-finite values of visible keys reach the rows that see
    them. On the Pallas path a NaN or Inf value of a key that a band hides
    from one row but not from another row of the same kernel tile also
    reaches the first (0 x NaN in the tile's value product; the XLA path
    selects per row; docs/ops.md).
  * return_lse: also return lse [B, H, Nq] (packed: [H, T]) float32, the
    natural log of each row's softmax denominator `log sum_j exp(s_ij)`
    over its visible (soft-capped) scores, FlashAttention-2's layout.

  Returns o [B, Nq, H, D] (packed: [T, H, D]) in q's dtype, or `(o, lse)`.
  Differentiable in q, k, v, sm_scale and (with return_lse) through the
  lse (Pallas: FlashAttention-2 dQ and dK/dV kernels; grouped K/V get the
  sum over their query heads). `checks=True` validates cu_seqlens.

  Backends: `xla` (every feature), `triton` (every feature), `mosaic_gpu`
  (the forward, for bf16 with D 64 or 128 and `sm_scale` a Python float:
  causal, window, softcap, grouped heads, lse and packed sequences; its
  gradient is the Triton backward's); `backend="pallas"` falls back to
  Triton for other inputs."""
  packed = cu_seqlens_q is not None
  banded = causal or window is not None
  grouped = k.shape[-2] != q.shape[-2]
  if not (packed or banded or grouped or softcap is not None or return_lse):
    return dispatch.run(
      NONCAUSAL,
      {"q": q, "k": k, "v": v, "key_valid": key_valid},
      params={"sm_scale": sm_scale},
      config=config,
      backend=backend,
      checks=checks,
    )
  inputs = {"q": q, "k": k, "v": v, "key_valid": key_valid, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
  params = {
    "sm_scale": sm_scale,
    "causal": bool(causal),
    "window": None if window is None else tuple(None if w is None else int(w) for w in window),
    "softcap": None if softcap is None else float(softcap),
    "return_lse": bool(return_lse),
  }
  return dispatch.run(
    attention_impl(packed=packed, lse=bool(return_lse), banded=banded),
    inputs,
    params=params,
    config=config,
    backend=backend,
    checks=checks,
  )


def packed_preconditions(inputs: Mapping[str, jax.Array]) -> list[Precondition]:
  """Checked mode of packed attention: each cu_seqlens nondecreasing from 0
  to its token count."""
  rules = []
  for name, tokens in (("cu_seqlens_q", "q"), ("cu_seqlens_k", "k")):
    if name not in inputs:
      continue
    cu, total = inputs[name], inputs[tokens].shape[0]
    valid = jnp.concatenate([cu[:1] == 0, cu[1:] >= cu[:-1]])
    valid = valid.at[-1].set(valid[-1] & (cu[-1] == total))
    rules.append(
      Precondition(name, valid, f"nondecreasing from {name}[0] = 0 to {name}[S] = {total} ({tokens}.shape[0])")
    )
  return rules


_PACKED_TOKENS = "packed sequences: a token's sequence and keys come from cu_seqlens over all tokens"
_ALIGNED = "causal and window alignment (i + Nk - Nq) depend on a query's place in the whole sequence"


@functools.cache
def attention_impl(*, packed: bool, lse: bool, banded: bool) -> OpImpl:
  """The `OpImpl` of an `attention` call with the features of issue 51
  (causal, window, softcap, grouped heads, lse, packed sequences): the
  general reference `attention_reference` and the same kernels; one per
  layout (`packed`), output count (`lse`) and whether queries may split
  across devices (not under a band: their alignment is global)."""
  if packed:
    split = Split(
      inputs={"q": "t h d", "k": "u h d", "v": "u h d", "key_valid": "u", "cu_seqlens_q": "n", "cu_seqlens_k": "n"},
      outputs=("t h d", "h t") if lse else ("t h d",),
      independent="h",
      reasons={"t": _PACKED_TOKENS, "u": _PACKED_TOKENS, "n": _PACKED_TOKENS, "d": CONTRACTION},
    )
  else:
    split = Split(
      inputs={**_QKV, "key_valid": "b t"},
      outputs=("b s h d", "b h s") if lse else ("b s h d",),
      independent="b h" if banded else "b s h",
      reasons={**_REASONS, "s": _ALIGNED} if banded else _REASONS,
    )
  return OpImpl(
    reference=attention_reference,
    kernels=KERNELS,
    make_inputs=make_noncausal_inputs,
    cpu_axes=cpu_axes,
    split=split,
    preconditions=packed_preconditions if packed else None,
  )


def validate_prefix_cached(q, k, v, k_prefix, v_prefix, *, sm_scale=None, **_) -> None:
  """The contract of `prefix_cached_attention` (`jaxkern.contract`)."""
  c = Checks("prefix_cached_attention")
  _check_qkv(c, q, k, v, self_attention=False)
  batch, _, heads, head_dim = q.shape
  c.shape("k_prefix", k_prefix, (batch, None, heads, head_dim), "[B, Np, H, D]", "B, H, D from q")
  c.shape("v_prefix", v_prefix, k_prefix.shape, "[B, Np, H, D]", "k_prefix's shape")
  c.same_dtype("k_prefix", k_prefix, "q", q)
  c.same_dtype("v_prefix", v_prefix, "q", q)
  c.scalar("sm_scale", sm_scale, optional=True)


@public_op(validate_prefix_cached)
def prefix_cached_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  k_prefix: jax.Array,
  v_prefix: jax.Array,
  *,
  sm_scale: float | None = None,
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> jax.Array:
  """Attention of q over keys concat(k_prefix, k), all visible; the
  concatenation is never materialized by the kernel.

  Contract: q, k, v [B, Nq, H, D], k_prefix, v_prefix [B, Np, H, D] (Np >= 0),
  one float dtype (bf16); no masks and no index inputs (`checks=True` has
  nothing to check); non-finite values reach every row. Returns o
  [B, Nq, H, D] in q's dtype. Differentiable in q, k, v and the prefix.

  Backends: `xla`, `triton`, `mosaic_gpu` (the forward, for bf16 with D 64
  or 128 and `sm_scale` a Python float; its gradient is the Triton
  backward's; `backend="pallas"` falls back to Triton for other inputs)."""
  inputs = {"q": q, "k": k, "v": v, "k_prefix": k_prefix, "v_prefix": v_prefix}
  return dispatch.run(
    PREFIX_CACHED, inputs, params={"sm_scale": sm_scale}, config=config, backend=backend, checks=checks
  )


def validate_block_causal(q, k, v, segment_ids, *, sm_scale=None, **_) -> None:
  """The contract of `block_causal_attention` (`jaxkern.contract`)."""
  c = Checks("block_causal_attention")
  _check_qkv(c, q, k, v, self_attention=True)
  c.shape("segment_ids", segment_ids, q.shape[:2], "[B, N]", "B, N from q")
  c.integer("segment_ids", segment_ids)
  c.scalar("sm_scale", sm_scale, optional=True)


@public_op(validate_block_causal)
def block_causal_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array,
  *,
  sm_scale: float | None = None,
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> jax.Array:
  """Self-attention where token j is visible to token i iff
  segment_ids[b, j] <= segment_ids[b, i].

  Contract: q, k, v [B, N, H, D], one float dtype (bf16), segment_ids
  [B, N] int32, valid: nondecreasing along N (`checks=True` reports the
  first decrease). The visibility rule is the answer for any ids; a key
  hidden from a query never reaches it, even when its neighbours see it (a
  NaN in a later segment leaves earlier rows finite). Returns o
  [B, N, H, D] in q's dtype. Differentiable in q, k, v.

  Backends: `xla`, `triton`, `mosaic_gpu` (the forward, for bf16 with D 64
  or 128 and `sm_scale` a Python float; its gradient is the Triton
  backward's; `backend="pallas"` falls back to Triton for other inputs)."""
  return dispatch.run(
    BLOCK_CAUSAL,
    {"q": q, "k": k, "v": v, "segment_ids": segment_ids},
    params={"sm_scale": sm_scale},
    config=config,
    backend=backend,
    checks=checks,
  )
