"""FP8 x FP4 m-grouped GEMM for DeepSeek MoE experts (SPEC 4.3):
`grouped_gemm_fp8_fp4_e384_n{N}_k{K}_g32`.

C[m,n] = sum_k a[m,k] 2^(a_scale[m,k//32]-127) * e2m1(b[e,n,k]) 2^(b_scale[e,n,k//32]-127),
e = expert_ids[m], fp32 accumulation, bf16 out; rows in any order, rows with
e outside [0, E) (-1 = padding) are 0.
Kernel: `pallas_kernels.grouped_gemm`; formats: `jaxkern.quant`.

Input synthesis (SPEC 6), decided from the records:
* Rows are tokens x 6 routed slots. Every record has M = 6 x (new tokens) and
  its adapter note says the engine's -1 rows were discarded, so synthesized
  inputs carry **no -1 padding rows**: T = ceil(M / 6) tokens each route to 6
  distinct experts and the first M of the 6T (token, slot) rows are kept
  (M % 6 != 0 only happens for axes given by hand). -1 rows are covered by
  the family tests instead.
* Routing as the DeepSeek router makes it (4.2 -> 4.3): per token, logits =
  token noise + an expert popularity bias (the load imbalance real routers
  show) + a per-sequence topic bias; top-6 experts. The sequences are the
  record's `scheduler_sequence_lengths` entries (decode: one token each;
  prefill: the tokens split evenly among them, in order); without a record,
  one sequence. Rows are then sorted by expert (stable), DeepGEMM's
  m-grouped contiguous layout.
* Activations: N(0, 1) rows (RMS-normed hidden states), quantized to e4m3
  with UE8M0 scales per 32 k (`quant.quantize_fp8_e4m3`).
* Weights: N(0, 1/K), quantized to e2m1 with UE8M0 scales per 32 k
  (`quant.quantize_e2m1`), generated **only for the experts some row uses**,
  one expert at a time in a jitted loop (values depend on the expert id only);
  unused experts hold the quantization of zeros (bytes 0, scale byte 127).
  A decode step (M = 6) thus quantizes 6 experts, not 384 (4.5 GB).
* `cpu_axes` shrinks E to 16 and N, K by halving to <= 768 (multiples of 32
  kept, K = 2304 -> 576 stays a non-power-of-two multiple of 32), M to at
  most 96 rows (16 tokens): the full weight tensor is 4.5 GB.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkern import dispatch, quant, roofline, spmd
from jaxkern.contract import Checks, public_op
from jaxkern.family import OpImpl, Precondition, cdiv, in_range, varying_like
from jaxkern.spmd import CONTRACTION, Split
from pallas_kernels.grouped_gemm import KERNELS
from pallas_kernels.grouped_gemm import triton as kernel_lib
from pallas_kernels.shared.common import varying_axes

TOP_K = 6  # routed experts per token (DeepSeek-V4.1-Flash)
GROUP = 32  # k values per scale byte

# Reference: rows per window of one expert's product (bounds the fp32 temporary
# to window x N x 4 bytes).
_REFERENCE_WINDOW = 256

# Synthesis: spread of the expert popularity bias and of the per-sequence
# topic bias relative to the unit token noise of the router logits.
_POPULARITY_STD = 0.7
_TOPIC_STD = 0.5

# cpu_axes: E, the N/K cap (halving keeps multiples of 32) and max rows.
_CPU_EXPERTS = 16
_CPU_NK_CAP = 768
_CPU_ROWS = 96


def _dequantize_a(a: jax.Array, a_scale: jax.Array) -> jax.Array:
  """a * 2^(a_scale - 127) as bf16: exact (an e4m3 value times a power of two)."""
  return quant.dequantize_fp8_e4m3(a, a_scale, GROUP).astype(jnp.bfloat16)


def grouped_gemm_fp8_fp4_reference(
  a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, expert_ids: jax.Array
) -> jax.Array:
  """Plain-jnp reference (SPEC 4.3).

  Operands are dequantized to bf16, which is exact (e4m3 / e2m1 values times
  powers of two), so the bf16 x bf16 -> fp32 products are exact and only the
  fp32 summation order is the implementation's. Loops over the experts; an
  expert with rows dequantizes its weights once ([N, K]) and multiplies the
  rows from its first to its last row in windows of `_REFERENCE_WINDOW`,
  keeping the rows that are its own. Memory: a in bf16 plus one expert's
  weights plus a window's product, whatever M. Correct for any row order
  (grouped rows make it fast); -1 rows stay 0.
  """
  m = a.shape[0]
  num_experts, n, _ = b.shape
  ids = expert_ids.astype(jnp.int32)
  a_deq = _dequantize_a(a, a_scale)
  if m == 0:
    return jnp.zeros((0, n), jnp.bfloat16)
  window = min(_REFERENCE_WINDOW, m)
  rows = jnp.arange(m, dtype=jnp.int32)
  valid = ids >= 0
  safe = jnp.where(valid, ids, num_experts)  # out of range: dropped
  first = jnp.full((num_experts,), m, jnp.int32).at[safe].min(rows, mode="drop")
  last = jnp.full((num_experts,), -1, jnp.int32).at[safe].max(rows, mode="drop")

  def expert_rows(e, c):
    w = quant.dequantize_e2m1(b[e], b_scale[e], GROUP).astype(jnp.bfloat16)  # [N, K]

    def one_window(i, c):
      start = jnp.minimum(first[e] + i * window, m - window)
      x = lax.dynamic_slice_in_dim(a_deq, start, window, axis=0)
      part = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
      mine = lax.dynamic_slice_in_dim(ids, start, window) == e
      old = lax.dynamic_slice_in_dim(c, start, window, axis=0)
      new = jnp.where(mine[:, None], part.astype(jnp.bfloat16), old)
      return lax.dynamic_update_slice_in_dim(c, new, start, axis=0)

    num_windows = (last[e] - first[e] + window) // window
    return lax.fori_loop(0, num_windows, one_window, c)

  def per_expert(e, c):
    return lax.cond(last[e] >= 0, expert_rows, lambda e, c: c, e, c)

  out = varying_like(jnp.zeros((m, n), jnp.bfloat16), a, a_scale, b, b_scale, expert_ids)
  return lax.fori_loop(0, num_experts, per_expert, out)


# ----------------------------------------------------------------------------
# Input synthesis.


def _sequence_count(record: dict | None, tokens: int) -> int:
  lengths = (record or {}).get("scheduler_sequence_lengths") or [0]
  return max(1, min(len(lengths), tokens))


@functools.partial(jax.jit, static_argnames=("m", "e", "k", "sequences"))
def _routing_and_activations(key, *, m: int, e: int, k: int, sequences: int):
  key_tok, key_pop, key_topic, key_a = jax.random.split(key, 4)
  top_k = min(TOP_K, e)
  tokens = cdiv(m, top_k)
  # Router logits: token noise + expert popularity + the token's sequence topic.
  seq_of_token = (jnp.arange(tokens) * sequences) // tokens
  logits = (
    jax.random.normal(key_tok, (tokens, e))
    + _POPULARITY_STD * jax.random.normal(key_pop, (e,))
    + _TOPIC_STD * jax.random.normal(key_topic, (sequences, e))[seq_of_token]
  )
  _, chosen = lax.top_k(logits, top_k)  # distinct experts per token
  ids = jnp.sort(chosen.reshape(-1)[:m].astype(jnp.int32))  # grouped by expert
  x = jax.random.normal(key_a, (m, k), jnp.float32)
  a, a_scale = quant.quantize_fp8_e4m3(x, GROUP, "ue8m0")
  return ids, a, a_scale


@functools.partial(jax.jit, static_argnames=("e", "n", "k"))
def _expert_weights(key, expert_ids, *, e: int, n: int, k: int):
  """Quantized N(0, 1/K) weights of the experts `expert_ids` uses; the other
  experts hold quantized zeros. One expert per loop step (bounded memory)."""
  m = expert_ids.shape[0]
  slots = min(e, m)
  used = jnp.zeros((e,), bool).at[expert_ids].set(True, mode="drop")
  # The used experts, ascending, padded with -1.
  order = jnp.where(used, jnp.arange(e), e)
  present = jnp.sort(order)[:slots]
  b = jnp.zeros((e, n, k // 2), jnp.uint8)
  b_scale = jnp.full((e, n, k // GROUP), 127, jnp.uint8)

  def one(j, carry):
    b, b_scale = carry
    expert = present[j]

    def fill(carry):
      b, b_scale = carry
      w = jax.random.normal(jax.random.fold_in(key, expert), (n, k), jnp.float32) * lax.rsqrt(jnp.float32(k))
      packed, scales = quant.quantize_e2m1(w, GROUP)
      return (
        lax.dynamic_update_index_in_dim(b, packed, expert, 0),
        lax.dynamic_update_index_in_dim(b_scale, scales, expert, 0),
      )

    return lax.cond(expert < e, fill, lambda c: c, (b, b_scale))

  return lax.fori_loop(0, slots, one, (b, b_scale))


def make_inputs(axes: Mapping[str, int], key: jax.Array, record: dict | None = None) -> dict[str, jax.Array]:
  """Grouped rows routed like DeepSeek's router, quantized activations and
  weights (module docstring). `record` contributes the number of sequences;
  sizes come from `axes` (a CPU-scaled run caps the sequences at the tokens)."""
  m, e, n, k = (int(axes[x]) for x in ("M", "E", "N", "K"))
  key_route, key_b = jax.random.split(key)
  sequences = _sequence_count(record, cdiv(m, min(TOP_K, e)) if m else 1)
  ids, a, a_scale = _routing_and_activations(key_route, m=m, e=e, k=k, sequences=sequences)
  b, b_scale = _expert_weights(key_b, ids, e=e, n=n, k=k)
  return {"a": a, "a_scale": a_scale, "b": b, "b_scale": b_scale, "expert_ids": ids}


def cpu_axes(axes: Mapping[str, int]) -> dict[str, int]:
  """E -> 16; N and K halved while above 768 (staying multiples of 32); M
  capped at 96 rows (16 tokens; decode steps M = 6..18 stay as recorded).
  K_groups and K_packed follow K."""
  out = dict(axes)
  out["E"] = min(int(axes["E"]), _CPU_EXPERTS)
  for name in ("N", "K"):
    v = int(axes[name])
    while v > _CPU_NK_CAP and (name == "N" or (v // 2) % GROUP == 0) and v % 2 == 0:
      v //= 2
    out[name] = v
  out["K_groups"] = out["K"] // int(axes.get("G", GROUP))
  out["K_packed"] = out["K"] // 2
  out["M"] = min(int(axes["M"]), _CPU_ROWS)
  return out


# ---------------------------------------------------------------------------
# Roofline cost (`OpImpl.cost`, see `jaxkern.roofline`).


def expected_experts(rows: int, experts: int) -> float:
  """Expected number of distinct experts `rows` uniformly routed rows touch:
  E (1 - (1 - 1/E)^rows); exactly 1 for one row or one expert."""
  if rows <= 0:
    return 0.0
  return experts * (1.0 - (1.0 - 1.0 / experts) ** rows)


def grouped_gemm_cost(definition, axes, *, inputs=None, record=None, config=None):
  """C[m] = a[m] (FP8, UE8M0 scale per 32 k) times expert e(m)'s FP4 weight.
  With the run's `expert_ids`: FLOPs 2 N K per routed row (ids in [0, E);
  padding rows are only written as zeros), bytes of a and a_scale for those
  rows, and of the weights b and b_scale (packed e2m1 and UE8M0 bytes as
  stored) only the distinct experts the rows route to. Without inputs, every
  row is counted and the experts are the expected number of distinct experts
  under uniform routing (`expected_experts(M, E)`, exact for M=1; a bound,
  since real routing is skewed). expert_ids read and C written once. The
  FLOPs are judged against the peak of the kernel's dot operands
  (`pallas_kernels.grouped_gemm.triton.dot_operand_dtype`: fp8, the weights decoded
  to e4m3, Hopper having no FP4 tensor cores; f16 for folded scales)."""
  m, e = axes["M"], axes["E"]
  per_expert = (roofline.tensor_bytes(definition, "b", axes) + roofline.tensor_bytes(definition, "b_scale", axes)) / e
  per_row = (roofline.tensor_bytes(definition, "a", axes) + roofline.tensor_bytes(definition, "a_scale", axes)) / max(
    m, 1
  )
  ids = None if inputs is None else inputs.get("expert_ids")
  if ids is None:
    rows, experts, source = m, expected_experts(m, e), "axes"
  else:
    ids = roofline.host(ids)
    routed = ids[(ids >= 0) & (ids < e)]
    rows, experts, source = routed.size, np.unique(routed).size, "inputs"
  nbytes = (
    roofline.io_bytes(definition, axes, skip=("a", "a_scale", "b", "b_scale"))
    + round(rows * per_row)
    + round(experts * per_expert)
  )
  dtype_class = "fp8" if jnp.dtype(kernel_lib.dot_operand_dtype(config)).itemsize == 1 else "bf16"
  return roofline.Work(2 * rows * axes["N"] * axes["K"], nbytes, dtype_class, counted_from=source)


# How the op splits across devices (`jaxkern.spmd`): rows (with their expert
# ids) and output columns. Experts do not split here, as rows name them by
# global id: expert parallelism is a shard_map with local ids
# (examples/moe_sharded.py).
SPLIT = Split(
  inputs={"a": "m k", "a_scale": "m g", "b": "e n kp", "b_scale": "e n g", "expert_ids": "m"},
  outputs=("m n",),
  independent="m n",
  reasons={
    "k": CONTRACTION,
    "kp": CONTRACTION,
    "g": CONTRACTION,
    "e": "rows carry global expert ids; for expert parallelism call the op inside "
    "jax.shard_map on each device's rows with local ids (examples/moe_sharded.py)",
  },
)


def preconditions(inputs: Mapping[str, jax.Array]) -> list[Precondition]:
  """Checked mode: every expert id is -1 or an expert of b."""
  ids, experts = inputs["expert_ids"], inputs["b"].shape[0]
  return [
    Precondition(
      "expert_ids",
      (ids == -1) | in_range(ids, 0, experts),
      f"-1 (padding row) or [0, E) with E = {experts} (b.shape[0])",
    )
  ]


IMPL = OpImpl(
  reference=grouped_gemm_fp8_fp4_reference,
  kernels=KERNELS,
  make_inputs=make_inputs,
  cpu_axes=cpu_axes,
  cost=grouped_gemm_cost,
  split=SPLIT,
  preconditions=preconditions,
)
IMPLS = (IMPL,)


# ---------------------------------------------------------------------------
# Public op (`jaxkern.ops`), dispatched by `jaxkern.dispatch`.


def validate(a, a_scale, b, b_scale, expert_ids, **_) -> None:
  """The contract of `grouped_gemm_fp8_fp4` (`jaxkern.contract`): shapes
  from a [M, K] and b [E, N, K/2], K a multiple of 32, the quantized dtypes."""
  c = Checks("grouped_gemm_fp8_fp4")
  c.rank("a", a, "[M, K]", 2)
  c.rank("b", b, "[E, N, K/2]", 3)
  m, k = a.shape
  e, n, _ = b.shape
  if k % GROUP:
    c.fail("a", f"[M, K] with K a multiple of {GROUP}", f"shape {tuple(a.shape)}")
  c.shape("b", b, (None, None, k // 2), "[E, N, K/2]", f"K = {k} from a")
  c.shape("a_scale", a_scale, (m, k // GROUP), "[M, K/32]", "M, K from a")
  c.shape("b_scale", b_scale, (e, n, k // GROUP), "[E, N, K/32]", "E, N from b, K from a")
  c.shape("expert_ids", expert_ids, (m,), "[M]", "M from a")
  c.dtype("a", a, [jnp.float8_e4m3fn])
  for name, x in (("a_scale", a_scale), ("b", b), ("b_scale", b_scale)):
    c.dtype(name, x, [jnp.uint8])
  c.integer("expert_ids", expert_ids)


@public_op(validate)
def grouped_gemm_fp8_fp4(
  a: jax.Array,
  a_scale: jax.Array,
  b: jax.Array,
  b_scale: jax.Array,
  expert_ids: jax.Array,
  *,
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> jax.Array:
  """MoE expert GEMM, FP8 activations x MXFP4 weights.

  Contract (both backends):
  * a [M, K] float8_e4m3fn with UE8M0 a_scale [M, K/32] uint8 (2^(s-127));
    b [E, N, K/2] uint8 packed e2m1 (low nibble = even k) with UE8M0 b_scale
    [E, N, K/32] uint8; K a multiple of 32; any M >= 0, N, E >= 1. Returns
    bf16 [M, N]: row m = a[m] times expert expert_ids[m]'s weight, fp32
    accumulation. Quantizers: `jaxkern.quant`.
  * expert_ids [M] int32, valid: -1 (padding row) or [0, E), in any order
    (rows grouped by expert, DeepGEMM's contiguous layout, are the fast
    case, not a requirement).
  * Outside the valid range (< -1 or >= E) a row is invalid like a padding
    row: it contributes nothing and its output row is 0. `checks=True`
    reports such an id instead (`jaxkern.dispatch`).
  * Scale byte 255 (UE8M0's NaN) and non-finite a are not masked: they reach
    the rows that use them. Scale byte 0 gives 0 on the Pallas path (2^-127
    on the XLA path).
  * Every backend rejects other shapes or dtypes with the same
    `jaxkern.InputError` naming the input; both paths give the same answer up to fp32 summation order
    (bit-equal on CPU in the tests; on a GPU the fp8 tensor cores'
    accumulation within each 32-k group).
  * Not differentiable in its quantized inputs a, b (asking raises
    `jaxkern.autodiff.NotDifferentiableError`); to train through it, use
    `grouped_gemm_mxfp4_ste` (a straight-through estimator).

  Backends: `xla`, `triton`, `mosaic_gpu` (N a multiple of 64).
  """
  inputs = {"a": a, "a_scale": a_scale, "b": b, "b_scale": b_scale, "expert_ids": expert_ids}
  return dispatch.run(IMPL, inputs, config=config, backend=backend, checks=checks)


# ---------------------------------------------------------------------------
# Training through the quantized GEMM: a straight-through estimator.


def _rows_by_expert(expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(order, group_sizes, valid): the row order that groups rows by expert
  (stable; rows with an id outside [0, E) last), each expert's row count,
  and which rows have a valid id: what `lax.ragged_dot` takes."""
  ids = expert_ids.astype(jnp.int32)
  valid = (ids >= 0) & (ids < num_experts)
  key = jnp.where(valid, ids, num_experts)
  order = jnp.argsort(key, stable=True)
  sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  return order, sizes, valid


def _replicated_out(x: jax.Array) -> NamedSharding | None:
  """The `out_sharding` `lax.ragged_dot` needs on an Explicit mesh (it has no
  sharding rule of its own): replicated, as every operand is there (sharded
  operands reach it per shard, inside `grouped_gemm_mxfp4_ste`'s shard_map)."""
  mesh = jax.typeof(x).sharding.mesh
  return NamedSharding(mesh, P()) if not mesh.empty and AxisType.Explicit in mesh.axis_types else None


def grouped_gemm_bf16_vjp(
  dy: jax.Array, x: jax.Array, w: jax.Array, expert_ids: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """The VJP of the bf16 grouped GEMM y[m] = x[m] @ w[expert_ids[m]]^T (rows
  with an id outside [0, E) are 0): dy [M, N], x [M, K], w [E, N, K] ->
  (dx [M, K] = dy[m] @ w[expert_ids[m]], dw [E, N, K] = the sum over expert
  e's rows of dy[m]^T x[m]), both float32: bf16 operands, fp32 accumulation,
  rows in any order (grouped by expert with a stable sort, then two
  `lax.ragged_dot`s on XLA). Rows with an invalid id get dx 0 and add
  nothing to dw.

  Inside `jax.shard_map` (check_vma=True) the partial sums are reduced where
  the operands vary over more mesh axes than the input the gradient is for:
  dw over the axes the rows are split along, dx over those the weights'
  columns N are split along."""
  num_experts = w.shape[0]
  order, sizes, valid = _rows_by_expert(expert_ids, num_experts)
  operands = (dy, x, w, order, sizes, valid)
  dy, x, w, order, sizes, valid = varying_like(operands, *operands)
  dy_rows = jnp.where(valid[:, None], dy, 0).astype(jnp.bfloat16)[order]
  dx_rows = lax.ragged_dot(
    dy_rows, w.astype(jnp.bfloat16), sizes, preferred_element_type=jnp.float32, out_sharding=_replicated_out(dy)
  )
  dx = jnp.where(valid[:, None], jnp.zeros_like(dx_rows).at[order].set(dx_rows), 0)
  contract_rows = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
  )
  dw = lax.ragged_dot_general(
    dy_rows,
    x.astype(jnp.bfloat16)[order],
    sizes,
    contract_rows,
    preferred_element_type=jnp.float32,
    out_sharding=_replicated_out(dy),
  )
  return dx, dw


def _reduce_to(grad: jax.Array, like: jax.Array) -> jax.Array:
  """`grad` summed over the manual mesh axes it varies over and `like` (the
  primal input) does not: the cotangent's type must be its input's."""
  extra = tuple(sorted(varying_axes(grad) - varying_axes(like)))
  return lax.psum(grad, extra) if extra else grad


def _quantize_operands(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(a, a_scale, b, b_scale): x to FP8 e4m3 and w to MXFP4 e2m1, UE8M0
  scales per 32 k (`jaxkern.quant`, rounded to nearest, scales rounded up)."""
  a, a_scale = quant.quantize_fp8_e4m3(x, GROUP, "ue8m0")
  b, b_scale = quant.quantize_e2m1(w, GROUP)
  return a, a_scale, b, b_scale


def _straight_through(x: jax.Array, w: jax.Array, expert_ids: jax.Array, **op_kwargs: Any) -> jax.Array:
  """`grouped_gemm_mxfp4_ste` on one device's arrays (or one shard's)."""

  def forward(x, w, expert_ids):
    return grouped_gemm_fp8_fp4(*_quantize_operands(x, w), expert_ids, **op_kwargs)

  def forward_and_residuals(x, w, expert_ids):
    operands = _quantize_operands(x, w)
    # The quantized operands are the residuals: a quarter (w) and half (x) of bf16's bytes.
    return grouped_gemm_fp8_fp4(*operands, expert_ids, **op_kwargs), (operands, expert_ids, x, w)

  def backward(residuals, dy):
    (a, a_scale, b, b_scale), expert_ids, x, w = residuals
    x_deq = _dequantize_a(a, a_scale)
    w_deq = quant.dequantize_e2m1(b, b_scale, GROUP).astype(jnp.bfloat16)
    dx, dw = grouped_gemm_bf16_vjp(dy, x_deq, w_deq, expert_ids)
    return _reduce_to(dx, x).astype(x.dtype), _reduce_to(dw, w).astype(w.dtype), None

  ste = jax.custom_vjp(forward)
  ste.defvjp(forward_and_residuals, backward)
  return ste(x, w, expert_ids)


# How the STE splits across devices: rows and output columns, as the op.
STE_SPLIT = Split(
  inputs={"x": "m k", "w": "e n k", "expert_ids": "m"},
  outputs=("m n",),
  independent="m n",
  reasons={"k": CONTRACTION, "e": SPLIT.reasons["e"]},
)


def validate_ste(x, w, expert_ids, **_) -> None:
  """The contract of `grouped_gemm_mxfp4_ste` (`jaxkern.contract`): x [M, K]
  and w [E, N, K] unquantized floats, K a multiple of 32, expert_ids [M]."""
  c = Checks("grouped_gemm_mxfp4_ste")
  c.rank("x", x, "[M, K]", 2)
  c.rank("w", w, "[E, N, K]", 3)
  m, k = x.shape
  if k % GROUP:
    c.fail("x", f"[M, K] with K a multiple of {GROUP}", f"shape {tuple(x.shape)}")
  c.shape("w", w, (None, None, k), "[E, N, K]", f"K = {k} from x")
  c.shape("expert_ids", expert_ids, (m,), "[M]", "M from x")
  for name, t in (("x", x), ("w", w)):
    c.dtype(name, t, [jnp.bfloat16, jnp.float16, jnp.float32])
  c.integer("expert_ids", expert_ids)


@public_op(validate_ste)
def grouped_gemm_mxfp4_ste(
  x: jax.Array,
  w: jax.Array,
  expert_ids: jax.Array,
  *,
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> jax.Array:
  """MoE expert GEMM for training: unquantized activations and (master)
  weights in, quantized on the way, gradients by a straight-through
  estimator (STE).

  Forward: x [M, K] (bf16, f16 or f32) is quantized to FP8 e4m3 and w
  [E, N, K] (bf16, f16 or f32; the master weights) to MXFP4 e2m1, both with
  UE8M0 scales per 32 k (`jaxkern.quant`), and `grouped_gemm_fp8_fp4` runs
  on them (its kernel on a kernel backend): returns bf16 [M, N], row m =
  Q(x)[m] times expert expert_ids[m]'s Q(w), fp32 accumulation. expert_ids
  [M] int32 as the op takes them: -1 (padding) or [0, E), any order; rows
  with any other id are 0. K a multiple of 32.

  Backward: the quantizers' derivative is taken to be 1 (the
  straight-through estimator), so the gradients are those of the bf16
  grouped GEMM y[m] = x[m] @ w[expert_ids[m]]^T at the quantized operands:
  * dx[m] = dy[m] @ Q(w)[expert_ids[m]], returned in x's dtype;
  * dw[e] = sum over the rows m of expert e of dy[m]^T Q(x)[m], in w's
    dtype (fp32 accumulation);
  with Q(x), Q(w) the dequantized operands (exact in bf16), bf16 operands
  and fp32 accumulation (`grouped_gemm_bf16_vjp`: plain XLA,
  `lax.ragged_dot`, on every backend); rows with an invalid id get dx 0.
  This is an estimator, not the derivative of the quantized function:
  rounding is piecewise constant, so that derivative is 0 almost
  everywhere. Where x and w are exactly representable (Q(x) = x,
  Q(w) = w) it is the exact gradient of the unquantized bf16 grouped GEMM.
  expert_ids gets no gradient.

  The residuals kept for the backward pass are the quantized operands (FP8
  x, MXFP4 w): a quarter to a half of bf16's bytes. The weights are
  quantized on every call (one elementwise pass over w).

  Sharding: like the op, it splits along rows M and output columns N; on
  inputs sharded on an Explicit mesh under `jit` it runs per shard (the
  gradient of weights shared by row shards is summed across them); the
  experts do not split (expert parallelism: call it inside `jax.shard_map`
  with local ids, as `examples/moe_sharded.py` calls the op).

  Backends: those of `grouped_gemm_fp8_fp4` (`xla`, `triton`) for the
  forward; the backward is XLA's.
  """
  op_kwargs = {"config": config, "backend": backend, "checks": checks}

  def call(shard: Mapping[str, jax.Array]) -> jax.Array:
    return _straight_through(shard["x"], shard["w"], shard["expert_ids"], **op_kwargs)

  # No custom_partitioning of this composite on an Auto mesh (pallas=False):
  # the op inside partitions itself and the backward is jnp XLA partitions.
  # check_vma=False: the shard_map's transpose sums the shards' partial
  # gradients (dw over row shards, dx over column shards) itself.
  return spmd.run(
    STE_SPLIT, "grouped_gemm_mxfp4_ste", call, {"x": x, "w": w, "expert_ids": expert_ids}, pallas=False, check_vma=False
  )
