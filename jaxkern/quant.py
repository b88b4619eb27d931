"""Block-scaled low-precision quantizers (plain `jax.numpy`).

Formats (SPEC 4 conventions; decoders in `pallas_kernels.fp_formats`):
* e2m1 (FP4) with UE8M0 block scales (MXFP4-style): two codes per byte, low
  nibble = even element; scale byte `s` means `2**(s - 127)`.
* float8_e4m3fn with per-block scales, either UE8M0 bytes or float32.

Power-of-two scales are rounded UP (`2**ceil(log2(amax / max_code))`), so no
value saturates; values are rounded to nearest, ties to even.

Below the generic quantizers: the token record formats of DeepSeek MLA KV
caches (`quantize_mla_fp8_tokens`, `quantize_mla_fp4_tokens` and their
dequantizers), which the mixed MLA decode definition (SPEC 4.10) reads.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import fp_formats

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Midpoints between consecutive e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6;
# a tie at midpoint i rounds up iff the upper code (i + 1) is even.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
  """[..., n] -> [..., n / block_size, block_size] float32."""
  n = x.shape[-1]
  if n % block_size:
    raise ValueError(f"last dim {n} is not a multiple of block_size {block_size}")
  return x.astype(jnp.float32).reshape(*x.shape[:-1], n // block_size, block_size)


def _pow2_exponent_up(amax: jax.Array, max_code: float) -> jax.Array:
  """int32 `ceil(log2(amax / max_code))`, clamped to the UE8M0 range
  [-126, 127] (scale bytes 1..254); 0 where amax is 0."""
  y = amax / max_code
  mant, exp = jnp.frexp(y)                  # y = mant * 2**exp, mant in [0.5, 1)
  e = jnp.where(mant == 0.5, exp - 1, exp)  # exact powers of two keep their exponent
  e = jnp.where(amax > 0, e, 0)
  return jnp.clip(e, -126, 127).astype(jnp.int32)


def _exp2_int(e: jax.Array) -> jax.Array:
  """2**e as float32 for int32 e in [-126, 127], exactly."""
  return fp_formats.ue8m0_to_f32(e + 127)


def _repeat_scales(scales: jax.Array, block_size: int) -> jax.Array:
  return jnp.repeat(scales, block_size, axis=-1)


def quantize_e2m1(x: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
  """Quantizes the last axis of `x` to e2m1 with one UE8M0 scale per block.

  Returns `(packed, scales)`: `packed` uint8 `[..., n/2]` (low nibble = even
  element, bit 3 of a code = sign), `scales` uint8 `[..., n/block_size]`.
  Scale = `2**ceil(log2(amax / 6))` so every |x| / scale <= 6; rounding to
  nearest on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code.
  """
  xb = _blocks(x, block_size)
  e = _pow2_exponent_up(jnp.max(jnp.abs(xb), axis=-1), E2M1_MAX)
  y = jnp.abs(xb) / _exp2_int(e)[..., None]
  code = jnp.zeros(y.shape, jnp.int32)
  for i, t in enumerate(_E2M1_MIDPOINTS):
    up = (y > t) | ((y == t) & ((i + 1) % 2 == 0))
    code = code + up.astype(jnp.int32)
  code = jnp.where(xb < 0, code | 8, code).reshape(x.shape)
  packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(jnp.uint8)
  return packed, (e + 127).astype(jnp.uint8)


def dequantize_e2m1(packed: jax.Array, scales: jax.Array, block_size: int) -> jax.Array:
  """Inverse of `quantize_e2m1`: float32 `[..., 2 * packed.shape[-1]]`."""
  low, high = fp_formats.unpack_e2m1(packed)
  codes = jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
  values = fp_formats.e2m1_to_f32(codes)
  return values * _repeat_scales(fp_formats.ue8m0_to_f32(scales), block_size)


def quantize_fp8_e4m3(x: jax.Array, block_size: int,
                      scale_format: str = "ue8m0") -> tuple[jax.Array, jax.Array]:
  """Quantizes the last axis of `x` to float8_e4m3fn with one scale per block.

  scale_format "ue8m0": scales are uint8 UE8M0 bytes, `2**ceil(log2(amax /
  448))` (no value saturates); "f32": float32 scales `amax / 448` (1 for an
  all-zero block). Returns `(values float8_e4m3fn [..., n], scales [..., n /
  block_size])`; values are `x / scale` rounded to nearest even.
  """
  xb = _blocks(x, block_size)
  amax = jnp.max(jnp.abs(xb), axis=-1)
  if scale_format == "ue8m0":
    e = _pow2_exponent_up(amax, E4M3_MAX)
    scale, stored = _exp2_int(e), (e + 127).astype(jnp.uint8)
  elif scale_format == "f32":
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    stored = scale
  else:
    raise ValueError(f"scale_format must be 'ue8m0' or 'f32', got {scale_format!r}")
  y = jnp.clip(xb / scale[..., None], -E4M3_MAX, E4M3_MAX)
  return y.reshape(x.shape).astype(jnp.float8_e4m3fn), stored


def dequantize_fp8_e4m3(values: jax.Array, scales: jax.Array, block_size: int) -> jax.Array:
  """Inverse of `quantize_fp8_e4m3` (either scale format): float32."""
  s = fp_formats.ue8m0_to_f32(scales) if scales.dtype == jnp.uint8 else scales.astype(jnp.float32)
  return values.astype(jnp.float32) * _repeat_scales(s, block_size)


# ---------------------------------------------------------------------------
# DeepSeek MLA KV-cache token records (SPEC 4.10).
#
# FP8 token, D + 4 * (D/128) bytes (528 at D=512): D float8_e4m3fn bytes, then
# D/128 little-endian float32 scales, scale j multiplying dims 128j..128j+127.
# FP4 token, D/2 + D/16 bytes (288 at D=512): D/2 bytes of packed e2m1 (low
# nibble = even dim), then D/16 UE8M0 scale bytes, scale j multiplying dims
# 16j..16j+15.

MLA_FP8_GROUP = 128
MLA_FP4_GROUP = 16


def _f32_to_le_bytes(x: jax.Array) -> jax.Array:
  """float32 [..., n] -> uint8 [..., 4n], each value little-endian."""
  words = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  shifts = jnp.arange(4, dtype=jnp.uint32) * 8
  b = ((words[..., None] >> shifts) & 0xFF).astype(jnp.uint8)
  return b.reshape(*x.shape[:-1], 4 * x.shape[-1])


def _le_bytes_to_f32(b: jax.Array) -> jax.Array:
  """uint8 [..., 4n] (little-endian words) -> float32 [..., n]."""
  w = b.reshape(*b.shape[:-1], b.shape[-1] // 4, 4).astype(jnp.uint32)
  word = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)
  return lax.bitcast_convert_type(word, jnp.float32)


def quantize_mla_fp8_tokens(x: jax.Array, *, pow2_scales: bool = True) -> jax.Array:
  """Tokens `[..., D]` -> FP8 token records uint8 `[..., D + 4 * D/128]`.

  One scale per 128 dims, stored as float32: a power of two rounded up
  (`pow2_scales=True`, the synthesis default, SPEC 6) or `amax / 448`."""
  values, scales = quantize_fp8_e4m3(x, MLA_FP8_GROUP, "ue8m0" if pow2_scales else "f32")
  if pow2_scales:
    scales = fp_formats.ue8m0_to_f32(scales)
  value_bytes = lax.bitcast_convert_type(values, jnp.uint8)
  return jnp.concatenate([value_bytes, _f32_to_le_bytes(scales)], axis=-1)


def dequantize_mla_fp8_tokens(records: jax.Array) -> jax.Array:
  """FP8 token records uint8 `[..., D + 4 * D/128]` -> float32 `[..., D]`."""
  d = records.shape[-1] * MLA_FP8_GROUP // (MLA_FP8_GROUP + 4)
  values = lax.bitcast_convert_type(records[..., :d], jnp.float8_e4m3fn)
  return dequantize_fp8_e4m3(values, _le_bytes_to_f32(records[..., d:]), MLA_FP8_GROUP)


def quantize_mla_fp4_tokens(x: jax.Array) -> jax.Array:
  """Tokens `[..., D]` -> FP4 token records uint8 `[..., D/2 + D/16]`
  (e2m1, one UE8M0 scale per 16 dims, rounded up)."""
  packed, scales = quantize_e2m1(x, MLA_FP4_GROUP)
  return jnp.concatenate([packed, scales], axis=-1)


def dequantize_mla_fp4_tokens(records: jax.Array) -> jax.Array:
  """FP4 token records uint8 `[..., D/2 + D/16]` -> float32 `[..., D]`."""
  d = records.shape[-1] * 16 // 9
  return dequantize_e2m1(records[..., :d // 2], records[..., d // 2:], MLA_FP4_GROUP)
