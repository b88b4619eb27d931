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
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from jaxkern.op import OpImpl
from pallas_kernels import flash_attention as kernel_lib
from pallas_kernels.common import cdiv

# Variants whose keys are padded text tokens (cross-attention to the prompt).
_PADDED_TEXT_VARIANTS = frozenset({"attn2", "audio_attn2"})

# cpu_axes budget: B * Nq * (keys per query), H kept at 32. Interpret mode
# runs ~6e6 (query, key, head) triples a second on two cores, after ~0.5-1 s
# of compilation; at this budget a shrunk recorded workload takes 1-2 s
# (measured: B=2, Nq=Nk=240, d128 in 1.3 s on the first call, 0.4 s after;
# the replay of all 202 records of the four definitions took ~4 minutes).
_CPU_PAIR_BUDGET = 160_000
# Sequence lengths up to this are kept as recorded at CPU scale (51, 126, the
# 25-32 token prefixes); longer ones shrink but stay longer than these.
_CPU_KEEP_LEN = 64


# ---------------------------------------------------------------------------
# References (plain jnp; bounded memory, see `kernel_lib.attention_reference`).


def noncausal_attention_reference(q, k, v, key_valid) -> jax.Array:
  """softmax(q k^T / sqrt(D)) v over the keys with key_valid, fp32."""
  return kernel_lib.attention_reference(q, k, v, key_valid=key_valid)


def prefix_cached_attention_reference(q, k, v, k_prefix, v_prefix) -> jax.Array:
  """Attention of q over the keys concat(k_prefix, k), all visible, fp32."""
  return kernel_lib.attention_reference(q, k, v, k_prefix=k_prefix, v_prefix=v_prefix)


def block_causal_attention_reference(q, k, v, segment_ids) -> jax.Array:
  """Key j visible to query i iff segment_ids[j] <= segment_ids[i], fp32."""
  return kernel_lib.attention_reference(q, k, v, segment_ids=segment_ids)


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
  ids = jnp.searchsorted(jnp.asarray(ends, jnp.int32), jnp.arange(q_len, dtype=jnp.int32),
                         side="right").astype(jnp.int32)
  return jnp.broadcast_to(ids, (batch, q_len))


def make_noncausal_inputs(axes: Mapping[str, int], key: jax.Array,
                          record: dict | None = None) -> dict[str, jax.Array]:
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


def make_prefix_cached_inputs(axes: Mapping[str, int], key: jax.Array,
                              record: dict | None = None) -> dict[str, jax.Array]:
  """q, k, v, k_prefix, v_prefix ~ N(0, 1) bf16. No mask input, so the
  record's `prefix_segments` (the prefix's own structure) are not needed."""
  del record
  b, nq, np_, h, d = (int(axes[n]) for n in ("B", "Nq", "Np", "H", "D"))
  q, k, v, k_prefix, v_prefix = _normal_bf16(
      key, *[(b, nq, h, d)] * 3, *[(b, np_, h, d)] * 2)
  return {"q": q, "k": k, "v": v, "k_prefix": k_prefix, "v_prefix": v_prefix}


def make_block_causal_inputs(axes: Mapping[str, int], key: jax.Array,
                             record: dict | None = None) -> dict[str, jax.Array]:
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
  If Nq and Nk differed they still differ. Interpret-mode time at these
  sizes: about 1 s per workload (0.5 s of it compilation)."""
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
# One flash kernel serves all four definitions: its optional key sources and
# masks are keyword arguments named like the definitions' inputs.


def _impl(reference, make_inputs) -> OpImpl:
  return OpImpl(reference=reference, kernel=kernel_lib.flash_attention, make_inputs=make_inputs,
                choose_config=kernel_lib.choose_config, candidate_configs=kernel_lib.candidate_configs,
                cpu_axes=cpu_axes)


IMPLS = (
    _impl(noncausal_attention_reference, make_noncausal_inputs),
    _impl(prefix_cached_attention_reference, make_prefix_cached_inputs),
    _impl(block_causal_attention_reference, make_block_causal_inputs),
)
