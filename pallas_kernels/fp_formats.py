"""Bit-level decoders for the low-precision formats of SPEC 4 (e2m1, UE8M0).

Integer and bit operations only (no table gathers, no fp4 dtype: FP4 is not a
Triton type), so every function here works both inside a Pallas Triton kernel
body and in plain `jax.numpy`. This module imports nothing from `jaxkern`.

Formats:
* e2m1 (FP4, OCP MX): a 4-bit code; bit 3 is the sign, bits 2..1 the exponent
  (bias 1), bit 0 the mantissa. Magnitude codes 0..7 mean
  0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 1 is the only subnormal). Two codes share a
  byte, the **low nibble holding the even (first) element**.
* UE8M0: an unsigned byte `s` meaning the power of two `2**(s - 127)`: the
  exponent field of an fp32 with no sign and no mantissa.
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp


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


def ue8m0_to_f32(s):
  """UE8M0 scale bytes -> float32 `2**(s - 127)`, by shifting `s` into the
  fp32 exponent field.

  Edge bytes, as that construction gives them: `s = 0` yields +0.0 (the exact
  value 2**-127 is an fp32 subnormal the construction does not produce; the
  quantizers in `jaxkern.quant` never emit 0), and `s = 255` yields +inf
  (SPEC 4: 255 is invalid).
  """
  bits = (s.astype(jnp.int32) & 0xFF) << 23
  return lax.bitcast_convert_type(bits, jnp.float32)
