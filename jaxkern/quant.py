"""Quantizers and dequantizers for the low-precision formats of the definitions.

* MXFP4-style e2m1: two 4-bit codes per byte (**low nibble = even element**),
  one UE8M0 scale byte per `block_size` consecutive values.
* FP8 e4m3 (`float8_e4m3fn`) with one scale per `block_size` consecutive
  values, either a UE8M0 byte (power of two) or an fp32 number.

Blocks run along the last axis, which `block_size` must divide. Power-of-two
scales are rounded UP: the scale is the smallest power of two for which the
block's largest magnitude fits the format's largest finite value (6 for e2m1,
448 for e4m3), so nothing saturates; values are then rounded to nearest, ties
to even. An all-zero block gets scale byte 127 (scale 1.0; fp32 format: 1.0).
Scales are clamped to bytes 1..254 (2**-126 .. 2**127).

Plain `jax.numpy`, jit-compatible. The decoders here are the references'
own (a value table for e2m1, `exp2` for UE8M0), independent of the kernels'
bit-level decoders (`pallas_kernels.shared.fp_formats`), so that a decoding bug in
a kernel cannot pass its own check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

E2M1_MAX = 6.0
# e2m1 code -> value: magnitude codes 0..7, bit 3 the sign (code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E4M3_MAX = 448.0
_MIN_EXP, _MAX_EXP = -126, 127


def unpack_e2m1(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Packed bytes -> their two e2m1 codes `(even, odd)`: the low nibble holds
  the even (first) element."""
  x = packed.astype(jnp.int32)
  return x % 16, x // 16


def e2m1_to_f32(code: jax.Array) -> jax.Array:
  """e2m1 codes 0..15 -> float32, by table."""
  return jnp.asarray(E2M1_VALUES, jnp.float32)[code.astype(jnp.int32)]


def ue8m0_to_f32(s: jax.Array) -> jax.Array:
  """UE8M0 scale bytes -> float32 `2**(s - 127)`, exactly (255, invalid,
  gives inf)."""
  return jnp.ldexp(jnp.ones(s.shape, jnp.float32), s.astype(jnp.int32) - 127)


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
  n = x.shape[-1]
  if block_size < 1 or n % block_size:
    raise ValueError(f"block_size={block_size} must divide the last axis ({n})")
  return x.astype(jnp.float32).reshape(*x.shape[:-1], n // block_size, block_size)


def _pow2_exponent_rounded_up(amax: jax.Array, fmt_max: float) -> jax.Array:
  """Smallest integer e with amax <= fmt_max * 2**e (0 where amax == 0),
  clamped to the UE8M0 range. log2 gives a first guess; exact comparisons
  against fmt_max * 2**e (exact in fp32) fix it up."""
  safe = jnp.where(amax > 0, amax, fmt_max)
  e = jnp.ceil(jnp.log2(safe) - jnp.log2(jnp.float32(fmt_max))).astype(jnp.int32)
  e = jnp.where(safe > jnp.ldexp(jnp.float32(fmt_max), e), e + 1, e)
  e = jnp.where(safe <= jnp.ldexp(jnp.float32(fmt_max), e - 1), e - 1, e)
  return jnp.clip(e, _MIN_EXP, _MAX_EXP)


def _round_to_e2m1_code(y: jax.Array) -> jax.Array:
  """|y| <= 6 (fp32) -> e2m1 codes 0..15, round to nearest, ties to even.

  In each binade the grid points are integers after a power-of-two scaling
  (x2 below 2, x1 in [2, 4), x1/2 in [4, 6]) and an even integer there is an
  even mantissa, so `jnp.round` (half to even) in that domain is RNE on the
  e2m1 grid.
  """
  a = jnp.minimum(jnp.abs(y), E2M1_MAX)
  q = jnp.where(a < 2, jnp.round(a * 2) / 2, jnp.where(a < 4, jnp.round(a), jnp.round(a / 2) * 2))
  q2 = (q * 2).astype(jnp.int32)  # 0, 1, 2, 3, 4, 6, 8, 12
  mag = jnp.where(q2 <= 4, q2, jnp.where(q2 <= 8, q2 // 2 + 2, 7))
  sign = jnp.where((y < 0) & (mag > 0), 8, 0)
  return mag | sign


def quantize_e2m1(x: jax.Array, block_size: int = 32) -> tuple[jax.Array, jax.Array]:
  """x [..., n] -> (packed uint8 [..., n/2], scales uint8 UE8M0 [..., n/block_size]).

  Byte j of a row packs element 2j in its low nibble and 2j+1 in its high
  nibble. Scale of a block: the smallest power of two with amax/scale <= 6.
  """
  if x.shape[-1] % 2:
    raise ValueError(f"the last axis ({x.shape[-1]}) must be even to pack e2m1 pairs")
  blocks = _blocks(x, block_size)
  e = _pow2_exponent_rounded_up(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), E2M1_MAX)
  codes = _round_to_e2m1_code(jnp.ldexp(blocks, -e)).reshape(x.shape)
  packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)
  return packed, (e[..., 0] + 127).astype(jnp.uint8)


def dequantize_e2m1(packed: jax.Array, scales: jax.Array, block_size: int = 32) -> jax.Array:
  """Inverse of `quantize_e2m1`: -> float32 [..., 2 * packed.shape[-1]]."""
  low, high = unpack_e2m1(packed)
  codes = jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
  values = _blocks(e2m1_to_f32(codes), block_size)
  return (values * ue8m0_to_f32(scales)[..., None]).reshape(codes.shape)


def quantize_fp8_e4m3(x: jax.Array, block_size: int = 32, scale_format: str = "ue8m0") -> tuple[jax.Array, jax.Array]:
  """x [..., n] -> (float8_e4m3fn [..., n], scales [..., n/block_size]).

  `scale_format="ue8m0"`: uint8 bytes, the smallest power of two with
  amax/scale <= 448. `scale_format="f32"`: float32 `amax / 448` (1.0 for an
  all-zero block); values are clipped to +-448 against division rounding.
  """
  blocks = _blocks(x, block_size)
  amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
  if scale_format == "ue8m0":
    e = _pow2_exponent_rounded_up(amax, E4M3_MAX)
    values = jnp.ldexp(blocks, -e)
    scales = (e[..., 0] + 127).astype(jnp.uint8)
  elif scale_format == "f32":
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    values = jnp.clip(blocks / scale, -E4M3_MAX, E4M3_MAX)
    scales = scale[..., 0]
  else:
    raise ValueError(f"scale_format must be 'ue8m0' or 'f32', got {scale_format!r}")
  # The barrier keeps XLA from folding a later fp8 -> f32 convert into this
  # one (its excess-precision simplification would otherwise drop the
  # rounding when quantize and dequantize meet under one jit).
  return lax.optimization_barrier(values.reshape(x.shape).astype(jnp.float8_e4m3fn)), scales


def dequantize_fp8_e4m3(values: jax.Array, scales: jax.Array, block_size: int = 32) -> jax.Array:
  """Inverse of `quantize_fp8_e4m3` -> float32; uint8 scales are UE8M0,
  floating scales are used as they are."""
  if jnp.issubdtype(scales.dtype, jnp.integer):
    scale = ue8m0_to_f32(scales)
  else:
    scale = scales.astype(jnp.float32)
  return (_blocks(values, block_size) * scale[..., None]).reshape(values.shape)


# ---------------------------------------------------------------------------
# DeepSeek MLA KV-cache token records (the mixed MLA decode's caches).
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
  (`pow2_scales=True`, the synthesis default) or `amax / 448`."""
  values, scales = quantize_fp8_e4m3(x, MLA_FP8_GROUP, "ue8m0" if pow2_scales else "f32")
  if pow2_scales:
    scales = ue8m0_to_f32(scales)
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
  return dequantize_e2m1(records[..., : d // 2], records[..., d // 2 :], MLA_FP4_GROUP)
