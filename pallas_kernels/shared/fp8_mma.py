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
* `e2m1_to_e4m3_operand`: pairs of packed e2m1 bytes -> the e4m3 operand
  of their values times 2**-6 (`fp_formats.e2m1_to_e4m3_bits`), in k order.
* `promote`: `acc + part * a_scale * b_scale` as one multiply and one fused
  multiply-add per element.
* f16 operands with scales folded in (`e2m1_to_f16_operand`,
  `e4m3_to_f16_operand`): the values times a per-row f16 power of two, in
  the k order `pair_major`, in which a thread's byte pairs (the e4m3
  fragment's k 4c..4c+3) are its f16 MMA register fragments; both operands
  of a dot take it.

The decode, the conversions and the promotion have two forms with equal results: inline PTX
(`ptx=True`, a Triton kernel on a GPU: the decode works on 32-bit words of
two byte pairs, and the promotion is a real `fma`, which the Triton
lowering never forms from jnp's multiply and add) and plain jnp
(`ptx=False`: interpret mode, CPUs). Outside a Triton kernel `fp8_dot_nt`
is `lax.dot_general` with fp32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as jax_core  # a primitive with its own Triton lowering
from jax._src.interpreters import mlir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax.experimental.pallas import triton as plgpu
from jax.extend.mlir import ir

from pallas_kernels.shared.common import NT_DIMS
from pallas_kernels.shared.fp_formats import e2m1_to_e4m3_bits

FP8_TYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
# Products a wgmma may accumulate before Triton inserts an fp32 promotion of
# its own: more than any K, as upstream Triton's default on sm_90.
MAX_IMPRECISE_PRODUCTS = 1 << 30

fp8_dot_nt_p = jax_core.Primitive("fp8_dot_nt")


def fp8_dot_nt(a: jax.Array, b: jax.Array, acc: jax.Array | None = None) -> jax.Array:
  """`a [M, K] @ b [N, K]^T` (plus `acc`, fp32 [M, N], when given) -> fp32
  [M, N] for fp8 `a`, `b` of one dtype (module docstring: inside a Triton
  kernel, wgmma with fast fp8 accumulation within the call; with `acc`, the
  wgmma accumulates onto it in place)."""
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
    raise ValueError(f"fp8_dot_nt: expected a [M, K] and b [N, K], got {a.shape} and {b.shape}")
  if a.dtype != b.dtype or a.dtype not in FP8_TYPES:
    raise ValueError(f"fp8_dot_nt: a and b must share an fp8 dtype, got {a.dtype} and {b.dtype}")
  if acc is None:
    return fp8_dot_nt_p.bind(a, b)
  if acc.shape != (a.shape[0], b.shape[0]) or acc.dtype != jnp.float32:
    raise ValueError(f"fp8_dot_nt: acc must be float32 {(a.shape[0], b.shape[0])}, got {acc.dtype} {acc.shape}")
  return fp8_dot_nt_p.bind(a, b, acc)


def _dot_reference(a, b, acc=None):
  out = lax.dot_general(a, b, NT_DIMS, preferred_element_type=jnp.float32)
  return out if acc is None else acc + out


@fp8_dot_nt_p.def_abstract_eval
def _abstract_eval(a, b, acc=None):
  return jax_core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32)


fp8_dot_nt_p.def_impl(_dot_reference)
mlir.register_lowering(fp8_dot_nt_p, mlir.lower_fun(_dot_reference, multiple_results=False))


@triton_lowering.register_lowering(fp8_dot_nt_p)
def _triton_lowering(ctx, a, b, acc=None):
  dot_rule = triton_lowering.triton_lowering_rules[lax.dot_general_p]
  rule_ctx = ctx if acc is None else ctx.replace(avals_in=ctx.avals_in[:2])
  out = dot_rule(
    rule_ctx, a, b, dimension_numbers=NT_DIMS, out_sharding=None, precision=None, preferred_element_type=jnp.float32
  )
  dot = out.owner
  if dot.name != "tt.dot":  # Pallas's rule returns the dot's fp32 result itself
    raise NotImplementedError(f"fp8_dot_nt: expected the lowering to end in tt.dot, got {dot.name}")
  dot.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), MAX_IMPRECISE_PRODUCTS)
  if acc is not None:  # the rule's zero accumulator replaced: the wgmma accumulates onto `acc`
    dot.operands[2] = acc
  return out


# e2m1_to_e4m3_bits on a word `$2` of four packed bytes (two of the
# kernel's byte pairs): `$1` the four odd (high-nibble) codes' e4m3 bytes,
# `$0` the four even (low-nibble) ones', byte i from byte i (magnitude to
# bits 4..2, sign to bit 7; `lop3` immLut 0xEC is (a & c) | b). The last
# instruction to read `$2` is the one writing `$1`, and no output is read
# after being written: an output may share the input's register.
# tests/test_grouped_gemm.py runs these lines on every byte value with NumPy.
E2M1_TO_E4M3_PTX = """{
.reg .b32 e, o, t;
shl.b32 e, $2, 2;
and.b32 e, e, 0x1C1C1C1C;
shl.b32 t, $2, 4;
shr.b32 o, $2, 2;
and.b32 o, o, 0x1C1C1C1C;
lop3.b32 $1, $2, o, 0x80808080, 0xEC;
lop3.b32 $0, t, e, 0x80808080, 0xEC;
}"""
# acc + part * a_scale * b_scale: $0 = fma(part * a_scale, b_scale, acc).
PROMOTE_PTX = """{
.reg .f32 t;
mul.rn.f32 t, $1, $2;
fma.rn.f32 $0, t, $3, $4;
}"""


# Pallas's Triton rule for `plgpu.elementwise_inline_asm` wraps the op's
# results in a one-element list (jax 0.11.2 and 0.12.0.1: binding an asm
# with two results fails, "2 outvars do not match 1 outvals"), so the
# two-result decode has a primitive of its own, lowered only inside a Triton
# kernel, whose rule returns each result.
inline_asm_p = jax_core.Primitive("fp8_mma_inline_asm")
inline_asm_p.multiple_results = True


@inline_asm_p.def_abstract_eval
def _inline_asm_abstract_eval(*avals, asm, constraints, pack, results):
  del asm, constraints, pack
  if any(a.shape != avals[0].shape for a in avals) or any(r.shape != avals[0].shape for r in results):
    raise ValueError("inline asm: every argument and result must have one shape (elementwise)")
  return [jax_core.ShapedArray(r.shape, r.dtype) for r in results]


@triton_lowering.register_lowering(inline_asm_p)
def _inline_asm_lowering(ctx, *args, asm, constraints, pack, results):
  del results
  types = [mlir.aval_to_ir_type(ctx.context.mlir_ctx, aval) for aval in ctx.avals_out]
  op = tt_dialect.ElementwiseInlineAsmOp(types, asm, constraints=constraints, pure=True, packed_element=pack, args=args)
  return list(op.results)


def _even_odd(pairs: jax.Array, *, ptx: bool) -> tuple[jax.Array, jax.Array]:
  """Per pair of packed e2m1 bytes, uint16: the e4m3 bytes of its two even
  codes (low byte first) and of its two odd ones (`e2m1_to_e4m3_bits`)."""
  if ptx:
    return _even_odd_asm(pairs)
  even, odd = (x.astype(jnp.uint16) for x in e2m1_to_e4m3_bits(jnp.stack([pairs & 0xFF, pairs >> 8], axis=-1)))
  return even[..., 0] | even[..., 1] << 8, odd[..., 0] | odd[..., 1] << 8


def _even_odd_asm(pairs: jax.Array) -> tuple[jax.Array, jax.Array]:
  # Two uint16 pairs per asm instance, one register.
  out = jax.ShapeDtypeStruct(pairs.shape, jnp.int16)
  even, odd = inline_asm_p.bind(
    lax.bitcast_convert_type(pairs, jnp.int16), asm=E2M1_TO_E4M3_PTX, constraints="=r,=r,r", pack=2, results=(out, out)
  )
  return lax.bitcast_convert_type(even, jnp.uint16), lax.bitcast_convert_type(odd, jnp.uint16)


def e2m1_to_e4m3_operand(pairs: jax.Array, *, ptx: bool) -> jax.Array:
  """Pairs of packed e2m1 bytes, uint16 [rows, P] (the low byte first; low
  nibble = even k, so a pair is four k values) -> float8_e4m3fn [rows, 4P]
  in k order, each value the e2m1 value times 2**-6, exactly
  (`fp_formats.e2m1_to_e4m3_bits`). `ptx`: the decode in inline PTX, on
  words of two pairs (Triton kernels on a GPU; P even), else jnp (any P)."""
  rows, width = pairs.shape
  even, odd = _even_odd(pairs, ptx=ptx)
  # A pair's k order is even, odd, even, odd: as uint16 halves (Triton has
  # no bitcast between widths), which the lowering turns into one `prmt`
  # per MMA operand register.
  first, last = (even & 0xFF) | (odd << 8), (even >> 8) | (odd & 0xFF00)
  decoded = jnp.stack([first, last], axis=-1)  # [rows, P, 2]
  decoded = jnp.stack([decoded, decoded >> 8], axis=-1).astype(jnp.uint8).reshape(rows, 4 * width)
  return lax.bitcast_convert_type(decoded, jnp.float8_e4m3fn)


# A byte pair's decode, `$4` (the even codes' e4m3 bytes) and `$5` (the odd
# codes'), -> f16 `$0`..`$3`: the pair's four values in k order times the f16
# `$6`. `prmt` puts each byte's two e4m3 values side by side (selector
# 0x3120), then one convert and one multiply per byte.
E4M3_PAIR_TO_F16_PTX = """{
.reg .b32 eo, x, v0, v1, s;
.reg .b16 p0, p1;
mov.b32 eo, {$4, $5};
prmt.b32 x, eo, 0, 0x3120;
mov.b32 {p0, p1}, x;
cvt.rn.f16x2.e4m3x2 v0, p0;
cvt.rn.f16x2.e4m3x2 v1, p1;
mov.b32 s, {$6, $6};
mul.rn.f16x2 v0, v0, s;
mul.rn.f16x2 v1, v1, s;
mov.b32 {$0, $1}, v0;
mov.b32 {$2, $3}, v1;
}"""


def _pair_to_f16(even: jax.Array, odd: jax.Array, scale: jax.Array, *, ptx: bool) -> jax.Array:
  """A byte pair's e4m3 bytes, uint16 `even` and `odd` [rows, P] (byte j:
  byte j of the pair), f16 `scale` [rows, 1] -> f16 [rows, P, 4]: the
  pair's four values in k order times the scale."""
  if ptx:
    out = jax.ShapeDtypeStruct(even.shape, jnp.float16)
    args = [lax.bitcast_convert_type(x, jnp.int16) for x in (even, odd)] + [jnp.broadcast_to(scale, even.shape)]
    values = inline_asm_p.bind(
      *args, asm=E4M3_PAIR_TO_F16_PTX, constraints="=h,=h,=h,=h,h,h,h", pack=1, results=(out,) * 4
    )
    # Triton stacks two arrays at a time, on the last axis: [(v0, v2), (v1, v3)] is v0..v3.
    v0, v1, v2, v3 = values
    return jnp.stack([jnp.stack([v0, v2], axis=-1), jnp.stack([v1, v3], axis=-1)], axis=-1).reshape(*even.shape, 4)
  e4m3 = jnp.stack([even & 0xFF, odd & 0xFF, even >> 8, odd >> 8], axis=-1).astype(jnp.uint8)
  return lax.bitcast_convert_type(e4m3, jnp.float8_e4m3fn).astype(jnp.float16) * scale[..., None]


# Two e4m3 bytes `$2` (the low byte first) -> f16 `$0`, `$1`: their values
# times the f16 `$3`.
E4M3X2_TO_F16_PTX = """{
.reg .b32 v, s;
cvt.rn.f16x2.e4m3x2 v, $2;
mov.b32 s, {$3, $3};
mul.rn.f16x2 v, v, s;
mov.b32 {$0, $1}, v;
}"""


def e4m3_to_f16_operand(pairs: jax.Array, scale: jax.Array, *, ptx: bool) -> jax.Array:
  """fp8 e4m3 values as uint16 byte pairs [rows, P] (the low byte first; P a
  multiple of 16: whole 32-k groups), f16 `scale` [rows, 1] -> float16
  [rows, 2P] of the values times the scale, in `pair_major` column order."""
  rows, width = pairs.shape
  if ptx:
    out = jax.ShapeDtypeStruct(pairs.shape, jnp.float16)
    lo, hi = inline_asm_p.bind(
      lax.bitcast_convert_type(pairs, jnp.int16),
      jnp.broadcast_to(scale, pairs.shape),
      asm=E4M3X2_TO_F16_PTX,
      constraints="=h,=h,h,h",
      pack=1,
      results=(out, out),
    )
    values = jnp.stack([lo, hi], axis=-1)
  else:
    both = jnp.stack([pairs & 0xFF, pairs >> 8], axis=-1).astype(jnp.uint8)
    values = lax.bitcast_convert_type(both, jnp.float8_e4m3fn).astype(jnp.float16) * scale[..., None]
  return pair_major(values.reshape(rows, 2 * width))


def pair_major(x: jax.Array) -> jax.Array:
  """[rows, 32 g] -> the same values with each 32-k group's columns in the
  order of an f16 MMA's register fragments over byte pairs: column
  16h + 8f + 2c + v holds k = 16h + 4c + 2f + v (pair c of half h, byte f
  of the pair, value v of the byte). A k permutation applied to both
  operands leaves the dot unchanged; it lets a thread's byte pairs (which
  hold k 4c..4c+3, the e4m3 fragment's) be its f16 fragment registers."""
  rows, width = x.shape
  x = x.reshape(rows, width // 32, 2, 4, 2, 2)
  return jnp.transpose(x, (0, 1, 2, 4, 3, 5)).reshape(rows, width)


def pair_major_inverse(x: jax.Array) -> jax.Array:
  """The inverse of `pair_major`: k order back."""
  rows, width = x.shape
  x = x.reshape(rows, width // 32, 2, 2, 4, 2)
  return jnp.transpose(x, (0, 1, 2, 4, 3, 5)).reshape(rows, width)


def e2m1_to_f16_operand(pairs: jax.Array, scale: jax.Array, *, ptx: bool) -> jax.Array:
  """Pairs of packed e2m1 bytes, uint16 [rows, P] (P a multiple of 8: whole
  32-k groups), f16 `scale` [rows, 1] -> float16 [rows, 4P] of the e2m1
  values times 2**-6 times the scale, in `pair_major` column order."""
  rows, width = pairs.shape
  even, odd = _even_odd(pairs, ptx=ptx)
  values = _pair_to_f16(even, odd, scale, ptx=ptx)  # [rows, P, 4]
  return pair_major(values.reshape(rows, 4 * width))


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
  return plgpu.elementwise_inline_asm(
    PROMOTE_PTX,
    args=args,
    constraints="=f,f,f,f,f",
    pack=1,
    result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)],
  )[0]
