"""Low-precision number formats decoded with integer ops (SPEC 4 conventions).

Usable both inside Pallas Triton kernels and in plain `jax.numpy`: only
shifts, masks, selects and bitcasts, no table gathers (FP4 is not a Triton
type, and a gather from a constant table does not lower).

* e2m1 (FP4): a 4-bit code; bit 3 is the sign, codes 0..7 are the
  magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Two codes per uint8 byte, the
  **low nibble is the even (first) element**.
* UE8M0: one uint8 byte `s` meaning the power of two `2**(s - 127)`.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp


def unpack_e2m1(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """uint8 bytes holding two e2m1 codes -> `(low, high)` int32 codes 0..15.

  `low` is the even (first) element of each pair, `high` the odd one."""
  b = packed.astype(jnp.int32)
  return b & 0xF, (b >> 4) & 0xF


def e2m1_to_f32(code: jax.Array) -> jax.Array:
  """e2m1 codes (integer array, values 0..15) -> float32, exactly.

  Builds the f32 bit pattern: magnitude m = code & 7; m >= 2 is a normal
  number `2**((m >> 1) - 1) * (1 + (m & 1) / 2)` (exponent field
  `(m >> 1) + 126`, top mantissa bit `m & 1`); m = 1 is the subnormal 0.5
  (exponent field 126); m = 0 is zero. Code 8 gives -0.0."""
  c = code.astype(jnp.int32)
  m = c & 7
  exponent = jnp.where(m >= 2, (m >> 1) + 126, jnp.where(m == 1, 126, 0))
  mantissa = jnp.where(m >= 2, m & 1, 0)
  bits = ((c & 8) << 28) | (exponent << 23) | (mantissa << 22)
  return lax.bitcast_convert_type(bits, jnp.float32)


def ue8m0_to_f32(s: jax.Array) -> jax.Array:
  """UE8M0 scale bytes (uint8 or int 0..255) -> `2**(s - 127)` as float32.

  The byte is shifted into the f32 exponent field with a zero mantissa, so
  s = 1..254 are exact powers of two; s = 0 gives 0.0 (not the subnormal
  2**-127) and s = 255 (invalid in UE8M0) gives +inf."""
  bits = (s.astype(jnp.int32) & 0xFF) << 23
  return lax.bitcast_convert_type(bits, jnp.float32)
