"""Bit-level decoders for the low-precision formats of SPEC 4 (e2m1, e4m3, UE8M0).

Integer and bit operations only (no table gathers, no fp4 dtype: FP4 is not a
Triton type, and Mosaic GPU converts fp8/fp4 registers only on newer PTX or
GPUs), so every function here works inside a Pallas Triton or Mosaic GPU
kernel body and in plain `jax.numpy`. This module imports nothing from `jaxkern`.

Formats:
* e2m1 (FP4, OCP MX): a 4-bit code; bit 3 is the sign, bits 2..1 the exponent
  (bias 1), bit 0 the mantissa. Magnitude codes 0..7 mean
  0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 1 is the only subnormal). Two codes share a
  byte, the **low nibble holding the even (first) element**.
* UE8M0: an unsigned byte `s` meaning the power of two `2**(s - 127)`: the
  exponent field of an fp32 with no sign and no mantissa.
* e4m3 (float8_e4m3fn): bit 7 the sign, bits 6..3 the exponent (bias 7),
  bits 2..0 the mantissa; subnormals are `m * 2**-9`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def f32_bits_one_nan(x):
  """The int32 bits of f32 `x` with every NaN (any sign, any payload) made
  the one +NaN, 0x7FC00000: a NaN's sign is not defined by the arithmetic
  that made it, so the total-order keys built from these bits must not see it."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where((bits & 0x7FFFFFFF) > 0x7F800000, jnp.int32(0x7FC00000), bits)


def unpack_e2m1(packed):
  """Splits packed bytes into their two e2m1 codes: `(low, high)`, int32.

  `low` (bits 0..3) is the even (first) element of each pair, `high`
  (bits 4..7) the odd (second) one. Works on any integer dtype holding the
  byte value 0..255 (uint8 is widened first).
  """
  x = packed.astype(jnp.int32)
  return x & 0xF, (x >> 4) & 0xF


def e2m1_to_f32(code):
  """e2m1 codes (integer array, values 0..15) -> float32, exactly.

  Builds the fp32 bit pattern: with magnitude `c = code & 7`, exponent bits
  `e = c >> 1` and mantissa bit `m = c & 1`, a normal code (e > 0) is
  `2**(e-1) * (1 + m/2)`: fp32 exponent field `e + 126`, top mantissa bit `m`.
  The subnormal code 1 is 0.5 (exponent field 126, no mantissa) and code 0 is
  zero (sign kept: code 8 is -0.0). Bit 3 becomes the fp32 sign bit.
  """
  c = code.astype(jnp.int32)
  mag = c & 7
  e = mag >> 1
  m = mag & 1
  normal_bits = ((e + 126) << 23) | (m << 22)
  # e == 0: code 1 -> 0.5 (exponent field 126), code 0 -> +-0.
  bits = jnp.where(e > 0, normal_bits, m * (126 << 23))
  bits = bits | ((c & 8) << 28)
  return lax.bitcast_convert_type(bits, jnp.float32)


def e4m3_to_f32(bits):
  """e4m3 (float8_e4m3fn) bit patterns (integer array, low byte) -> float32,
  exactly. The magnitude bits (exponent field e, mantissa m) moved up to
  fp32's with the exponent bias raised by 120 make every normal value (e >
  0); for e = 0 they make `2**-7 (1 + m/8)`, whose excess over 2**-7 doubled
  is the subnormal `m * 2**-9` (no fp32 subnormal arises, so flushing them
  changes nothing); e = 15, m = 7 is NaN (float8_e4m3fn has no infinities).
  Bit 7 becomes the sign bit (0x80 is -0.0)."""
  b = bits.astype(jnp.int32)
  magnitude = lax.bitcast_convert_type(((b & 0x7F) << 20) + (120 << 23), jnp.float32)
  magnitude = jnp.where((b & 0x78) == 0, (magnitude - 2.0**-7) * 2.0, magnitude)
  magnitude = jnp.where((b & 0x7F) == 0x7F, jnp.nan, magnitude)
  return lax.bitcast_convert_type(lax.bitcast_convert_type(magnitude, jnp.int32) | ((b & 0x80) << 24), jnp.float32)


# `e2m1_to_e4m3_bits` yields e4m3 values of the e2m1 values times 2**-E2M1_E4M3_EXPONENT.
E2M1_E4M3_EXPONENT = 6


def e2m1_to_e4m3_bits(packed):
  """Packed e2m1 bytes -> `(even, odd)` uint8 e4m3 bit patterns whose values
  are the low / high nibbles' e2m1 values times `2**-6`, exactly.

  An e2m1 code's magnitude bits (exponent e, mantissa bit m) moved to bits
  4..2 of an e4m3 byte form exponent field e and top mantissa bit m: for
  e > 0 the value `2**(e-7) (1 + m/2)`, the e2m1 value `2**(e-1) (1 + m/2)`
  times 2**-6; for the subnormal code 1 the e4m3 subnormal `4 * 2**-9`, 0.5
  times 2**-6; code 0 is 0. The sign moves to bit 7 (code 8 is -0.0). A
  mask, a shift and an or per element, all in uint8: every e2m1 value is an
  e4m3 value, so fp8 tensor cores can take the weights without a wider type.
  """
  x = packed.astype(jnp.uint8)
  even = ((x & 0x7) << 2) | ((x & 0x8) << 4)
  odd = ((x >> 2) & 0x1C) | (x & 0x80)
  return even, odd


def ue8m0_to_f32(s):
  """UE8M0 scale bytes -> float32 `2**(s - 127)`, by shifting `s` into the
  fp32 exponent field. Any integer type: its low byte is the scale (so a
  word of packed scales, shifted right by 8 g, gives its byte g).

  Edge bytes, as that construction gives them: `s = 0` yields +0.0 (the exact
  value 2**-127 is an fp32 subnormal the construction does not produce; the
  quantizers in `jaxkern.quant` never emit 0), and `s = 255` yields +inf
  (SPEC 4: 255 is invalid).
  """
  bits = (s.astype(jnp.int32) & 0xFF) << 23
  return lax.bitcast_convert_type(bits, jnp.float32)
