"""The straight-through grouped GEMM (`ops.grouped_gemm_mxfp4_ste`): its
forward is the FP8 x FP4 op on the quantized operands; its gradient is the
bf16 grouped GEMM's at the quantized operands (NumPy float64), hence, on
exactly representable operands, the exact gradient of the unquantized
function (central finite differences in float64, and `jax.grad` of a plain
jnp grouped GEMM); rows in any order, padding and out-of-range ids, zero
and one rows, one expert; inside `jax.shard_map` and on an Explicit mesh
(one device; several: tests/multidevice_ops.py); the contract's errors."""

import functools
import re

import gradients
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkern import InputError, ops, quant

GROUP = 32
# Rows, columns, K, experts: K two scale groups, ids in any order with -1 and out-of-range rows.
M, N, K, E = 24, 40, 64, 4
IDS = np.array([2, 0, -1, 3, 1, 1, 0, 4, 2, 2, -2, 3, 0, 1, 3, -1, 2, 0, 0, 3, 1, 2, 7, 0], np.int32)


def operands(seed=0, m=M, e=E, x_dtype=jnp.bfloat16):
  """x [m, K] and w [e, N, K] with per-row magnitude spread (the scale bytes vary)."""
  kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
  x = (jax.random.normal(kx, (m, K)) * 2.0).astype(x_dtype)
  w = jax.random.normal(kw, (e, N, K)) * jnp.exp(jax.random.normal(ks, (e, N, 1))) / np.sqrt(K)
  return x, w


@jax.jit
def _round_trip(x, w):
  xq = quant.dequantize_fp8_e4m3(*quant.quantize_fp8_e4m3(x, GROUP, "ue8m0"), GROUP)
  return xq, quant.dequantize_e2m1(*quant.quantize_e2m1(w, GROUP), GROUP)


def dequantized(x, w):
  """Q(x), Q(w) in float64: the operands the forward's GEMM multiplies."""
  xq, wq = _round_trip(x, w)
  return np.asarray(xq, np.float64), np.asarray(wq, np.float64)


def bf16_weights(shape, seed=99):
  """Loss weights exactly representable in bf16: the cotangent of the op's
  bf16 output is then the weights themselves."""
  return jnp.asarray(gradients.weights_like(shape, seed).astype(jnp.bfloat16), jnp.float32)


def ste_grads(x, w, ids, weights, backend="xla"):
  def loss(x, w):
    return jnp.sum(ops.grouped_gemm_mxfp4_ste(x, w, ids, backend=backend).astype(jnp.float32) * weights)

  return jax.jit(jax.grad(loss, (0, 1)))(x, w)


def numpy_grads(dy, xq, wq, ids):
  """dx = dy[m] @ wq[e(m)], dw[e] = sum of dy[m]^T xq[m] over e's rows, float64."""
  valid = (ids >= 0) & (ids < wq.shape[0])
  dx = np.zeros(xq.shape)
  dw = np.zeros(wq.shape)
  for row in np.flatnonzero(valid):
    dx[row] = dy[row] @ wq[ids[row]]
    dw[ids[row]] += np.outer(dy[row], xq[row])
  return dx, dw


def grouped_gemm_f64(x, w, ids):
  """The unquantized grouped GEMM in float64 NumPy (rows with invalid ids 0)."""
  valid = (ids >= 0) & (ids < w.shape[0])
  y = np.einsum("mk,mnk->mn", x, w[np.where(valid, ids, 0)])
  return np.where(valid[:, None], y, 0.0)


def representable(seed=1):
  """x (f32) exactly on the FP8 grid and w on the MXFP4 grid, with their
  scales: quantizing either gives it back."""
  x, w = operands(seed, x_dtype=jnp.float32)
  xq, wq = dequantized(x, w)
  x, w = jnp.asarray(xq, jnp.float32), jnp.asarray(wq, jnp.float32)
  again_x, again_w = dequantized(x, w)
  assert np.array_equal(again_x, xq) and np.array_equal(again_w, wq)
  return x, w


def forward_and_grads(x, w, ids, weights, backend="xla"):
  """(the op's output, dx, dw) of sum(output * weights), under one jit."""

  def loss(x, w):
    y = ops.grouped_gemm_mxfp4_ste(x, w, ids, backend=backend)
    return jnp.sum(y.astype(jnp.float32) * weights), y

  (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)
  return y, dx, dw


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_forward_is_the_op_and_gradient_the_bf16_grouped_gemms_at_the_quantized_operands(backend):
  """Forward: `grouped_gemm_fp8_fp4` on Q(x), Q(w), bit for bit. Gradient:
  dx = dy Q(w)[e] in x's dtype (bf16), dw = dy^T Q(x) per expert in w's
  (f32); rows with an invalid id get dx 0 and add nothing to dw."""
  x, w = operands()
  ids, weights = jnp.asarray(IDS), bf16_weights((M, N))
  y, dx, dw = forward_and_grads(x, w, ids, weights, backend)
  a, a_scale = quant.quantize_fp8_e4m3(x, GROUP, "ue8m0")
  b, b_scale = quant.quantize_e2m1(w, GROUP)
  want = jax.jit(functools.partial(ops.grouped_gemm_fp8_fp4, backend=backend))(a, a_scale, b, b_scale, ids)
  assert y.dtype == jnp.bfloat16 and y.shape == (M, N)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))

  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  want_dx, want_dw = numpy_grads(np.asarray(weights, np.float64), *dequantized(x, w), IDS)
  invalid = (IDS < 0) | (IDS >= E)
  assert invalid.sum() == 5 and not np.asarray(dx, np.float32)[invalid].any()
  # dx: fp32 sums rounded once to bf16; dw: fp32 sums over each expert's rows.
  np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, rtol=2**-8, atol=1e-6 * np.abs(want_dx).max())
  np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, rtol=1e-5, atol=1e-6 * np.abs(want_dw).max())


def test_on_representable_operands_it_is_the_exact_gradient_by_finite_differences():
  """Where quantizing changes nothing the estimator is the derivative of the
  unquantized bf16 grouped GEMM: central differences of that function in
  float64 (at sampled coordinates: it is bilinear, so they are exact up to
  rounding), and `jax.grad` of it written in plain jnp."""
  x, w = representable()
  ids = jnp.asarray(IDS)
  weights = bf16_weights((M, N))
  dx, dw = ste_grads(x, w, ids, weights)
  x64, w64, weights64 = (np.asarray(t, np.float64) for t in (x, w, weights))

  def loss64(x, w):
    return float(np.sum(grouped_gemm_f64(x, w, IDS) * weights64))

  rng = np.random.default_rng(0)
  eps = 1e-3
  for grad, point, shape in ((dx, x64, x64.shape), (dw, w64, w64.shape)):
    for flat in rng.choice(int(np.prod(shape)), size=40, replace=False):
      at = np.unravel_index(flat, shape)
      plus, minus = point.copy(), point.copy()
      plus[at] += eps
      minus[at] -= eps
      args = (plus, w64) if point is x64 else (x64, plus)
      args_minus = (minus, w64) if point is x64 else (x64, minus)
      fd = (loss64(*args) - loss64(*args_minus)) / (2 * eps)
      np.testing.assert_allclose(float(grad[at]), fd, rtol=1e-5, atol=1e-5, err_msg=str(at))

  def plain(x, w):
    valid = (ids >= 0) & (ids < E)
    y = jnp.einsum("mk,mnk->mn", x, w[jnp.where(valid, ids, 0)], precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(jnp.where(valid[:, None], y, 0.0) * weights)

  want_dx, want_dw = jax.grad(plain, (0, 1))(x, w)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(want_dx), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(want_dw), rtol=1e-5, atol=1e-5)


def test_degenerate_sizes():
  """No rows, only padding rows, one row of one expert."""
  for m, e, ids in [(0, E, []), (6, E, [-1] * 6), (1, 1, [0])]:
    x, w = operands(m=m, e=e)
    ids = np.asarray(ids, np.int32)
    weights = bf16_weights((m, N))
    y, dx, dw = forward_and_grads(x, w, jnp.asarray(ids), weights)
    assert y.shape == (m, N) and y.dtype == jnp.bfloat16
    want_dx, want_dw = numpy_grads(np.asarray(weights, np.float64), *dequantized(x, w), ids)
    np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, rtol=2**-8, atol=1e-6, err_msg=str(ids))
    np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, rtol=1e-5, atol=1e-5, err_msg=str(ids))


def one_device_mesh(axis_type):
  return jax.make_mesh((1,), ("x",), axis_types=(axis_type,))


def test_gradient_inside_shard_map():
  """Rows split over the mesh inside the user's shard_map (check_vma=True),
  the kernel path: the weights' gradient is summed over the row shards in
  the backward pass."""
  backend = "pallas"
  x, w = operands()
  ids, weights = jnp.asarray(IDS), bf16_weights((M, N))
  want = ste_grads(x, w, ids, weights, backend)

  def grads(x, w, ids, weights):
    def loss(x, w):
      return jnp.sum(ops.grouped_gemm_mxfp4_ste(x, w, ids, backend=backend).astype(jnp.float32) * weights)

    dx, dw = jax.grad(loss, (0, 1))(x, w)
    return dx, jax.lax.psum(dw, "x")

  rows = P("x")
  sharded = jax.shard_map(
    grads, mesh=one_device_mesh(AxisType.Auto), in_specs=(rows, P(), rows, rows), out_specs=(rows, P())
  )
  got = jax.jit(sharded)(x, w, ids, weights)
  for g, want_g in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want_g, np.float32))


@pytest.mark.parametrize("rows_sharded", [True, False], ids=["rows_sharded", "replicated"])
def test_gradient_on_an_explicit_mesh(rows_sharded):
  """Rows sharded: the op's own shard_map; all replicated: `lax.ragged_dot`
  needs its out_sharding on an Explicit mesh."""
  x, w = operands()
  ids, weights = jnp.asarray(IDS), bf16_weights((M, N))
  want = ste_grads(x, w, ids, weights)
  mesh = one_device_mesh(AxisType.Explicit)
  spec = P("x") if rows_sharded else P()
  with jax.set_mesh(mesh):
    x, ids, weights = (jax.device_put(t, NamedSharding(mesh, spec)) for t in (x, ids, weights))
    got = ste_grads(x, w, ids, weights)
  for g, want_g in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want_g, np.float32))


def test_experts_sharded_under_jit_point_to_shard_map():
  x, w = operands()
  mesh = one_device_mesh(AxisType.Explicit)
  with pytest.raises(ValueError, match="rows carry global expert ids; for expert parallelism"):
    jax.jit(ops.grouped_gemm_mxfp4_ste)(x, jax.device_put(w, NamedSharding(mesh, P("x"))), jnp.asarray(IDS))


@pytest.mark.parametrize(
  "x, w, ids, message",
  [
    (jnp.zeros((4, 48)), jnp.zeros((2, 8, 48)), jnp.zeros(4, jnp.int32), "x must be [M, K] with K a multiple of 32"),
    (jnp.zeros((4, 64)), jnp.zeros((2, 8, 32)), jnp.zeros(4, jnp.int32), "w must be [E, N, K] = [*, *, 64]"),
    (
      jnp.zeros((4, 64), jnp.float8_e4m3fn),
      jnp.zeros((2, 8, 64)),
      jnp.zeros(4, jnp.int32),
      "x must be bfloat16 or float16 or float32, got float8_e4m3fn",
    ),
    (jnp.zeros((4, 64)), jnp.zeros((2, 8, 64)), jnp.zeros(4), "expert_ids must be an integer dtype"),
    (jnp.zeros((4, 64)), jnp.zeros((8, 64)), jnp.zeros(4, jnp.int32), "w must be [E, N, K] (rank 3)"),
  ],
  ids=["k_not_32", "k_mismatch", "quantized_x", "float_ids", "w_rank"],
)
def test_bad_inputs_raise_input_errors(x, w, ids, message):
  with pytest.raises(InputError, match="^" + re.escape(f"grouped_gemm_mxfp4_ste: {message}")):
    ops.grouped_gemm_mxfp4_ste(x, w, ids)


def test_checked_mode_reports_an_id_outside_the_experts():
  x, w = operands()
  ids = jnp.asarray(IDS)
  f = ops.checked(jax.jit(lambda x, w, ids: ops.grouped_gemm_mxfp4_ste(x, w, ids, checks=True)))
  f(x, w, jnp.where((ids >= 0) & (ids < E), ids, -1))
  with pytest.raises(Exception, match=r"grouped_gemm: expert_ids\[7\] = 4 is outside its valid range"):
    f(x, w, ids)
