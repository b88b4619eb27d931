"""Low-precision formats: the kernels' bit-level decoders
(`pallas_kernels.shared.fp_formats`), the references' own decoders and the
quantizers (`jaxkern.quant`): bit layout, scale bytes, rounding and
round-trip error bounds."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkern import quant
from pallas_kernels.shared import fp_formats

E2M1_VALUES = [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_e2m1_to_f32_every_code():
  got = np.asarray(fp_formats.e2m1_to_f32(jnp.arange(16, dtype=jnp.int32)))
  expected = np.array(E2M1_VALUES + [-v for v in E2M1_VALUES], np.float32)
  np.testing.assert_array_equal(got, expected)
  assert np.signbit(got[8])  # code 8 is -0.0
  # Agrees with ml_dtypes' float4_e2m1fn read from the same bits.
  ml = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
  np.testing.assert_array_equal(ml, expected)


def test_e4m3_to_f32_every_byte_bit_for_bit():
  """All 256 bytes, from uint8 or from the low byte of a wider word (the
  Mosaic GPU mixed MLA decodes 16-bit words): ml_dtypes' float8_e4m3fn bit
  for bit (subnormals, -0.0 included), NaN where it has NaN."""
  codes = np.arange(256, dtype=np.uint8)
  want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  for bits in (jnp.asarray(codes), jnp.asarray(codes.astype(np.int32) | 0x5A00) & 0xFF):
    got = np.asarray(fp_formats.e4m3_to_f32(bits))
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32))
  assert np.isnan(want).sum() == 2 and np.signbit(np.asarray(fp_formats.e4m3_to_f32(jnp.int32(0x80))))


def test_unpack_e2m1_low_nibble_first():
  low, high = fp_formats.unpack_e2m1(jnp.array([0x21, 0xF0, 0x0F], jnp.uint8))
  np.testing.assert_array_equal(np.asarray(low), [1, 0, 15])
  np.testing.assert_array_equal(np.asarray(high), [2, 15, 0])


def test_ue8m0_to_f32():
  s = jnp.array([1, 100, 126, 127, 128, 254], jnp.uint8)
  np.testing.assert_array_equal(
    np.asarray(fp_formats.ue8m0_to_f32(s)), np.ldexp(np.float32(1), np.array([1, 100, 126, 127, 128, 254]) - 127)
  )
  edge = np.asarray(fp_formats.ue8m0_to_f32(jnp.array([0, 255], jnp.uint8)))
  assert edge[0] == 0.0 and np.isposinf(edge[1])  # documented edge bytes


def test_reference_decoders_agree_with_the_kernel_decoders_on_every_byte():
  """Two independent decoders (a value table and exp2 here, bit assembly in
  the kernels) agree on every code and every valid scale byte."""
  byte = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)
  for ours, theirs in zip(quant.unpack_e2m1(byte), fp_formats.unpack_e2m1(byte)):
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
  codes = jnp.arange(16, dtype=jnp.int32)
  got, want = np.asarray(quant.e2m1_to_f32(codes)), np.asarray(fp_formats.e2m1_to_f32(codes))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
  valid = byte[1:255]
  np.testing.assert_array_equal(np.asarray(quant.ue8m0_to_f32(valid)), np.asarray(fp_formats.ue8m0_to_f32(valid)))
  assert np.isposinf(np.asarray(quant.ue8m0_to_f32(jnp.array([255], jnp.uint8))))[0]


def test_quantize_e2m1_bit_layout_and_scale_byte():
  # One block of 32: amax 6 -> scale 1.0 (byte 127); element 0 = 0.5 (code
  # 1), element 1 = 1.0 (code 2): byte 0 = 0x21; element 2 = -6 (code 15).
  x = jnp.zeros((32,), jnp.float32).at[0].set(0.5).at[1].set(1.0).at[2].set(-6.0)
  packed, scales = quant.quantize_e2m1(x, 32)
  assert packed.dtype == jnp.uint8 and packed.shape == (16,)
  assert scales.dtype == jnp.uint8 and scales.shape == (1,)
  assert int(scales[0]) == 127
  assert int(packed[0]) == 0x21 and int(packed[1]) == 0x0F
  # amax 6.5 needs scale 2 (byte 128); amax 3 fits scale 0.5 (byte 126).
  assert int(quant.quantize_e2m1(x.at[3].set(6.5), 32)[1][0]) == 128
  assert int(quant.quantize_e2m1(jnp.full((32,), 3.0), 32)[1][0]) == 126
  assert int(quant.quantize_e2m1(jnp.zeros((32,)), 32)[1][0]) == 127


def test_quantize_e2m1_rounds_to_nearest_even():
  # Scale 1 (amax 6 in the block); midpoints go to the even code.
  mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, -0.75, 0.2, 2.9]
  want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, 0.0, 3.0]
  x = np.zeros(32, np.float32)
  x[: len(mids)] = mids
  x[-1] = 6.0
  packed, scales = quant.quantize_e2m1(jnp.asarray(x), 32)
  back = np.asarray(quant.dequantize_e2m1(packed, scales, 32))
  np.testing.assert_array_equal(back[: len(mids)], want)
  # Same as ml_dtypes' float4_e2m1fn rounding.
  np.testing.assert_array_equal(back, x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_e2m1_round_trip_bounds():
  x = jax.random.normal(jax.random.key(0), (8, 256), jnp.float32) * jnp.exp(
    jax.random.normal(jax.random.key(1), (8, 1)) * 3
  )
  packed, scales = quant.quantize_e2m1(x, 32)
  assert packed.shape == (8, 128) and scales.shape == (8, 8)
  back = np.asarray(quant.dequantize_e2m1(packed, scales, 32))
  xb = np.asarray(x).reshape(8, 8, 32)
  scale = np.ldexp(1.0, np.asarray(scales, np.int32) - 127)[..., None]
  amax = np.abs(xb).max(-1, keepdims=True)
  # Scales rounded up, minimal: 3 < amax/scale <= 6 (nothing saturates).
  assert (amax / scale <= 6).all() and (amax / scale > 3).all()
  # Half a grid step: 0.25 below 2, 0.25*|y| above.
  err = np.abs(back.reshape(8, 8, 32) - xb) / scale
  assert (err <= np.maximum(0.25, 0.25 * np.abs(xb) / scale) + 1e-6).all()
  # Grid values round-trip exactly.
  packed2, scales2 = quant.quantize_e2m1(jnp.asarray(back), 32)
  np.testing.assert_array_equal(np.asarray(quant.dequantize_e2m1(packed2, scales2, 32)), back)


@pytest.mark.parametrize("scale_format", ["ue8m0", "f32"])
def test_fp8_round_trip_bounds(scale_format):
  x = jax.random.normal(jax.random.key(2), (4, 128), jnp.float32) * jnp.exp(
    jax.random.normal(jax.random.key(3), (4, 1)) * 3
  )
  values, scales = quant.quantize_fp8_e4m3(x.astype(jnp.bfloat16), 32, scale_format)
  assert values.dtype == jnp.float8_e4m3fn and values.shape == (4, 128)
  assert scales.shape == (4, 4)
  assert scales.dtype == (jnp.uint8 if scale_format == "ue8m0" else jnp.float32)
  xb = np.asarray(x.astype(jnp.bfloat16), np.float32)
  back = np.asarray(quant.dequantize_fp8_e4m3(values, scales, 32))
  if scale_format == "ue8m0":
    scale = np.ldexp(1.0, np.asarray(scales, np.int32) - 127)
  else:
    scale = np.asarray(scales)
  amax = np.abs(xb.reshape(4, 4, 32)).max(-1)
  assert (amax / scale <= 448).all()
  if scale_format == "ue8m0":
    assert (amax / scale > 224).all()
  # e4m3: 3 mantissa bits, half-ulp relative error 2**-4 for normals
  # (>= 2**-6 after scaling), absolute 2**-10 * scale below.
  s = np.repeat(scale, 32, axis=-1)
  err = np.abs(back - xb)
  assert (err <= np.maximum(2**-4 * np.abs(xb), 2**-10 * s) * (1 + 1e-6)).all()


def test_fp8_ue8m0_scale_bytes():
  x = jnp.zeros((64,), jnp.float32).at[0].set(448.0).at[32].set(449.0)
  values, scales = quant.quantize_fp8_e4m3(x, 32)
  np.testing.assert_array_equal(np.asarray(scales), [127, 128])
  assert float(values[0].astype(jnp.float32)) == 448.0
  assert int(quant.quantize_fp8_e4m3(jnp.zeros((32,)), 32)[1][0]) == 127


def test_block_size_must_divide():
  with pytest.raises(ValueError):
    quant.quantize_e2m1(jnp.zeros((48,)), 32)
  with pytest.raises(ValueError):
    quant.quantize_fp8_e4m3(jnp.zeros((48,)), 32, "f16")


def test_fp8_rounding_survives_jit():
  """quantize -> dequantize under one jit still rounds (XLA's excess-precision
  simplification must not fold the fp8 converts away)."""
  import jax

  x = jnp.linspace(-3.0, 3.0, 64, dtype=jnp.float32).reshape(2, 32) * 1.013
  eager = quant.dequantize_fp8_e4m3(*quant.quantize_fp8_e4m3(x, 32), 32)
  jitted = jax.jit(lambda x: quant.dequantize_fp8_e4m3(*quant.quantize_fp8_e4m3(x, 32), 32))(x)
  np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))
  assert not np.array_equal(np.asarray(jitted), np.asarray(x))
