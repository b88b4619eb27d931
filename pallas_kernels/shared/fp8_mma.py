"""Pieces for FP8 tensor cores in a Pallas Triton kernel: an fp8 dot that
reaches Hopper's `wgmma ... e4m3`, packed e2m1 weights decoded to an e4m3
operand, and the promotion of a partial product into an fp32 accumulator.

* `fp8_dot_nt`: Pallas lowers `lax.dot_general` to a `tt.dot` whose
  `maxNumImpreciseAcc` is 0 ("accumulate every fp8 product in full fp32").
  Hopper's fp8 wgmma accumulates with less precision than fp32 inside an
  instruction, so Triton then refuses wgmma for an fp8 dot with an fp32
  result and falls back to mma.sync after upcasting both operands to f16
  (`mma.m16n8k16.f16`). `fp8_dot_nt` is the same dot with
  `maxNumImpreciseAcc` above its K: wgmma, its result handed back as is.
  Callers keep K at one scale group (32) and promote each partial product
  into their own fp32 accumulator (DeepGEMM-style), so the hardware's
  in-instruction accumulation never spans more than one call.
* `e2m1_to_e4m3_operand`: packed e2m1 bytes -> the e4m3 operand of their
  values times 2**-6 (`fp_formats.e2m1_to_e4m3_bits`), in k order.
* `promote`: `acc + part * a_scale * b_scale` as one multiply and one fused
  multiply-add per element.

The decode and the promotion have two forms with equal results: inline PTX
(`ptx=True`, a Triton kernel on a GPU: the decode works on 32-bit words of
four packed bytes, and the promotion is a real `fma`, which the Triton
lowering never forms from jnp's multiply and add) and plain jnp
(`ptx=False`: interpret mode, CPUs). Outside a Triton kernel `fp8_dot_nt`
is `lax.dot_general` with fp32 accumulation.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp
from jax._src import core as jax_core  # a primitive with its own Triton lowering
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering as triton_lowering

from pallas_kernels.shared.common import NT_DIMS
from pallas_kernels.shared.fp_formats import e2m1_to_e4m3_bits

FP8_TYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
# Products a wgmma may accumulate before Triton inserts an fp32 promotion of
# its own: more than any K, as upstream Triton's default on sm_90.
MAX_IMPRECISE_PRODUCTS = 1 << 30

fp8_dot_nt_p = jax_core.Primitive("fp8_dot_nt")


def fp8_dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
  """`a [M, K] @ b [N, K]^T` -> fp32 [M, N] for fp8 `a`, `b` of one dtype
  (module docstring: inside a Triton kernel, wgmma with fast fp8
  accumulation within the call)."""
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
    raise ValueError(f"fp8_dot_nt: expected a [M, K] and b [N, K], got {a.shape} and {b.shape}")
  if a.dtype != b.dtype or a.dtype not in FP8_TYPES:
    raise ValueError(f"fp8_dot_nt: a and b must share an fp8 dtype, got {a.dtype} and {b.dtype}")
  return fp8_dot_nt_p.bind(a, b)


def _dot_reference(a, b):
  return lax.dot_general(a, b, NT_DIMS, preferred_element_type=jnp.float32)


@fp8_dot_nt_p.def_abstract_eval
def _abstract_eval(a, b):
  return jax_core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32)


fp8_dot_nt_p.def_impl(_dot_reference)
mlir.register_lowering(fp8_dot_nt_p, mlir.lower_fun(_dot_reference, multiple_results=False))


@triton_lowering.register_lowering(fp8_dot_nt_p)
def _triton_lowering(ctx, a, b):
  dot_rule = triton_lowering.triton_lowering_rules[lax.dot_general_p]
  out = dot_rule(ctx, a, b, dimension_numbers=NT_DIMS, out_sharding=None, precision=None,
                 preferred_element_type=jnp.float32)
  dot = out.owner
  if dot.name != "tt.dot":  # Pallas's rule returns the dot's fp32 result itself
    raise NotImplementedError(f"fp8_dot_nt: expected the lowering to end in tt.dot, got {dot.name}")
  dot.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32),
                                                            MAX_IMPRECISE_PRODUCTS)
  return out


# e2m1_to_e4m3_bits on a 32-bit word of four packed bytes: `$1` the word,
# `$0` the four even (low-nibble) or odd (high-nibble) elements' e4m3 bytes.
# Only shl/shr/and/or with immediates (tests/test_grouped_gemm.py runs these
# lines on every byte value with NumPy).
E2M1_EVEN_TO_E4M3_PTX = """{
.reg .b32 t;
shl.b32 t, $1, 4;
and.b32 t, t, 0x80808080;
shl.b32 $0, $1, 2;
and.b32 $0, $0, 0x1C1C1C1C;
or.b32 $0, $0, t;
}"""
E2M1_ODD_TO_E4M3_PTX = """{
.reg .b32 t;
and.b32 t, $1, 0x80808080;
shr.b32 $0, $1, 2;
and.b32 $0, $0, 0x1C1C1C1C;
or.b32 $0, $0, t;
}"""
# acc + part * a_scale * b_scale: $0 = fma(part * a_scale, b_scale, acc).
PROMOTE_PTX = """{
.reg .f32 t;
mul.rn.f32 t, $1, $2;
fma.rn.f32 $0, t, $3, $4;
}"""


def _word_asm(asm: str, packed: jax.Array) -> jax.Array:
  # Triton's inline asm takes signless integers: int8, four to a register.
  out = jax.ShapeDtypeStruct(packed.shape, jnp.int8)
  return plgpu.elementwise_inline_asm(asm, args=[lax.bitcast_convert_type(packed, jnp.int8)], constraints="=r,r",
                                      pack=4, result_shape_dtypes=[out])[0]


def e2m1_to_e4m3_operand(packed: jax.Array, *, ptx: bool) -> jax.Array:
  """Packed e2m1 bytes [rows, B] (low nibble = even k) -> float8_e4m3fn
  [rows, 2B] in k order, each value the e2m1 value times 2**-6, exactly.
  `ptx`: decode 32-bit words with inline PTX (Triton kernels on a GPU;
  B a multiple of 4), else jnp (any B)."""
  if ptx:
    even, odd = (_word_asm(asm, packed) for asm in (E2M1_EVEN_TO_E4M3_PTX, E2M1_ODD_TO_E4M3_PTX))
  else:
    even, odd = (lax.bitcast_convert_type(x, jnp.int8) for x in e2m1_to_e4m3_bits(packed))
  rows, width = packed.shape
  interleaved = jnp.stack([even, odd], axis=-1).reshape(rows, 2 * width)  # Triton's join: back in k order
  return lax.bitcast_convert_type(interleaved, jnp.float8_e4m3fn)


def promote(acc: jax.Array, part: jax.Array, a_scale: jax.Array, b_scale: jax.Array, *, ptx: bool) -> jax.Array:
  """`acc + part * a_scale * b_scale` (fp32; `a_scale` [rows, 1] and
  `b_scale` [1, cols] broadcast). With power-of-two scales and products in
  the normal range both forms round once, at the addition, and agree
  exactly. `ptx`: one mul and one fma per element (inline PTX, Triton
  kernels on a GPU), else jnp."""
  if not ptx:
    return acc + part * (a_scale * b_scale)
  shape = acc.shape
  args = [part, jnp.broadcast_to(a_scale, shape), jnp.broadcast_to(b_scale, shape), acc]
  return plgpu.elementwise_inline_asm(PROMOTE_PTX, args=args, constraints="=f,f,f,f,f", pack=1,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])[0]
