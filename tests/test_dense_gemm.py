"""Dense BF16 NT GEMM: the kit's data (launches, edge cases: ragged and tiny
shapes, the K tail, tile groups; lowering at ragged sizes) and the family's
own checks: every tile order, the chunked reference vs float64 numpy, the
heuristic, synthesis scales, CPU axes; any M, N, K; the gradients (custom
VJP: dA and dB as launches of the same kernel) against the XLA path and
float64 finite differences, and their lowering. (The checks themselves:
test_definitions.py and kit.py.)"""

import functools

import gradients
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kit import Case, MosaicGpuCall, TritonCall
from numerics import assert_bf16_close

from jaxkern import ops, registry
from jaxkern.families import dense_gemm as gemm
from pallas_kernels.dense_gemm import config as dense_gemm_config
from pallas_kernels.dense_gemm import mosaic_gpu as mg
from pallas_kernels.dense_gemm import triton as dg
from pallas_kernels.shared.lowering import lower_for_h100, triton_calls

DEFINITIONS = [n for n in registry.names() if n.startswith("dense_gemm")]
RECORDED_M = (4096, 4125, 6144, 8192, 12288, 16384, 24576)


def nk(name):
  const = registry.get(name).definition.const_axes
  return const["N"], const["K"]


def shapes(m, n, k):
  return {"A": jax.ShapeDtypeStruct((m, k), jnp.bfloat16), "B": jax.ShapeDtypeStruct((n, k), jnp.bfloat16)}


def operands(m, n, k, seed=0):
  key_a, key_b = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(key_a, (m, k), jnp.bfloat16)
  b = (jax.random.normal(key_b, (n, k)) / np.sqrt(k)).astype(jnp.bfloat16)
  return a, b


# A config with tiny blocks puts many tiles, several groups (one of them
# short) and a K tail into a small problem.
SMALL_BLOCKS = dg.DenseGemmConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=2)
GEMM = "dense_gemm_bf16_nt_n4096_k4096"


def launches(config, axes):
  """One program per (M, N) tile."""
  tiles = -(-axes["M"] // config.block_m) * -(-axes["N"] // config.block_n)
  return [TritonCall("dense_gemm_nt", (tiles, 1, 1), config.num_warps, config.num_stages)]


def launches_mosaic_gpu(config, axes):
  """One Mosaic GPU call: A (rows padded to a multiple of 8) and B in, C out."""
  del config
  m, n, k = axes["M"], axes["N"], axes["K"]
  return (
    [MosaicGpuCall((f"tensor<{-(-m // 8) * 8}x{k}xbf16>", f"tensor<{n}x{k}xbf16>"), (f"tensor<{m}x{n}xbf16>",))]
    if m
    else []
  )


KERNEL_CASES = [
  Case(GEMM, {"M": m, "N": n, "K": k}, config=config, id=label)
  for m, n, k, config, label in [
    (1, 24, 40, None, "decode_row_ragged_nk"),
    (7, 64, 64, None, "seven_rows"),
    (33, 100, 130, None, "ragged_mnk"),
    (130, 300, 96, None, "two_m_tiles_ragged_second"),
    (33, 100, 130, SMALL_BLOCKS, "many_tiles_k_tail"),
    (40, 72, 72, SMALL_BLOCKS, "groups_of_2_and_1"),  # 3x5 tiles
    (1, 16, 16, SMALL_BLOCKS, "one_tile_exactly"),
    # Issue 20: K below the fitted block_k with M a power of two (K 24-48 at
    # M=64 raised "slice slice_sizes must be less than or equal to operand shape").
    (64, 40, 48, None, "m64_k48_k_below_block"),
    (128, 16, 24, None, "m128_k24"),
    (16, 17, 1, None, "k1"),
  ]
]
LOWERING_CASES = [
  Case(GEMM, {"M": 4125}),
  Case("dense_gemm_bf16_nt_n4096_k12288", {"M": 1}),
  Case(GEMM, {"M": 4125, "N": 1000, "K": 4100}, id="ragged_n_and_k"),
]
# The Mosaic GPU kernel in interpret mode: more tiles than CTAs, a ring that
# wraps, rows not a multiple of 8, a partial last N-tile, both splits.
KERNEL_CASES += [
  Case(GEMM, {"M": m, "N": n, "K": k}, config=mg.MosaicGemmConfig(**overrides), id=label, backend="mosaic_gpu")
  for m, n, k, overrides, label in [
    (200, 512, 64, {"grid": 3, "group_m": 2}, "mosaic_more_tiles_than_ctas_ragged_m"),
    (64, 256, 192, {"stages": 2, "epilogue_n": 128}, "mosaic_m_below_tile_ring_wraps_wide_stores"),
    (5, 256, 64, {}, "mosaic_five_rows"),
    (136, 256, 64, {"grid": 1, "split": "n", "stages": 3}, "mosaic_one_cta_two_tiles_split_n"),
    (72, 320, 128, {"grid": 2}, "mosaic_partial_last_n_tile"),
  ]
]
SWEEP_CASE = Case(GEMM, {"M": 33, "N": 100, "K": 130})
SWEEP_CASE_MOSAIC_GPU = Case(GEMM, {"M": 72, "N": 256, "K": 128})


def test_reference_matches_float64():
  a, b = operands(5, 24, 40, seed=3)
  c = gemm.dense_gemm_reference(a, b)
  expected = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
  assert c.dtype == jnp.bfloat16
  # fp32 accumulation then one bf16 rounding: within half a bf16 ulp + fp32 noise.
  np.testing.assert_allclose(np.asarray(c, np.float64), expected, rtol=2**-8, atol=1e-5)


def test_reference_row_chunks_match_one_product(monkeypatch):
  a, b = operands(37, 24, 32, seed=4)
  whole = gemm.dense_gemm_reference(a, b)
  # 5 chunks of 8 rows: the last starts at row 29 and overlaps its neighbour.
  monkeypatch.setattr(gemm, "_REFERENCE_F32_BYTES", 37 * 24 * 4 // 5 + 1)
  chunked = gemm.dense_gemm_reference(a, b)
  np.testing.assert_array_equal(np.asarray(chunked, np.float32), np.asarray(whole, np.float32))


@pytest.mark.parametrize("num_pid_m,num_pid_n,group_m", [(9, 19, 2), (5, 3, 8), (1, 7, 8), (8, 4, 4)])
def test_grouped_order_visits_every_tile_once(num_pid_m, num_pid_n, group_m):
  pids = jnp.arange(num_pid_m * num_pid_n)
  tile_m, tile_n = dense_gemm_config.tile_coords(pids, num_pid_m, num_pid_n, min(group_m, num_pid_m))
  tiles = set(zip(np.asarray(tile_m).tolist(), np.asarray(tile_n).tolist()))
  assert tiles == {(i, j) for i in range(num_pid_m) for j in range(num_pid_n)}


@pytest.mark.parametrize("m", RECORDED_M + (1, 7, 33))
def test_heuristic_choice_is_a_candidate(m):
  for n, k in map(nk, DEFINITIONS):
    assert dg.choose_config(shapes(m, n, k)) == dg.candidate_configs(shapes(m, n, k))[0]


def test_config_rejects_bad_blocks():
  with pytest.raises(ValueError):
    dg.DenseGemmConfig(block_m=96)
  with pytest.raises(ValueError):
    dg.DenseGemmConfig(block_k=8)
  with pytest.raises(ValueError):
    dg.DenseGemmConfig(group_m=0)


def test_synthesis_scales():
  """Unit activations, weights ~ 1/sqrt(K), so C is O(1)."""
  axes = gemm.cpu_axes({"M": 4125, "N": 4096, "K": 4096})
  x = gemm.make_inputs(axes, jax.random.key(0), None)
  a_std = float(jnp.std(x["A"].astype(jnp.float32)))
  b_std = float(jnp.std(x["B"].astype(jnp.float32)))
  assert abs(a_std - 1) < 0.05 and abs(b_std * np.sqrt(axes["K"]) - 1) < 0.05
  c_std = float(jnp.std(gemm.dense_gemm_reference(**x).astype(jnp.float32)))
  assert 0.8 < c_std < 1.2


def test_cpu_axes_shrinks_m_and_keeps_raggedness():
  for name in DEFINITIONS:
    n, k = nk(name)
    for m in RECORDED_M:
      small = gemm.cpu_axes({"M": m, "N": n, "K": k})
      assert small["M"] <= 128
      assert (small["M"] % 64 == 0) == (m % 64 == 0)
      assert small["M"] * small["N"] * small["K"] <= gemm._CPU_MAC_BUDGET
  # Under budget, the constant axes stay as defined.
  assert gemm.cpu_axes({"M": 4096, "N": 4096, "K": 4096}) == {"M": 64, "N": 4096, "K": 4096}
  assert gemm.cpu_axes({"M": 5, "N": 24, "K": 40}) == {"M": 5, "N": 24, "K": 40}


# ---------------------------------------------------------------------------
# Any M, N, K >= 1 on both paths.


@pytest.mark.parametrize("m,n,k", [(64, 32, 48), (32, 8, 24), (1, 1, 1), (64, 64, 33), (5, 3, 200)])
def test_any_sizes_on_both_paths(m, n, k):
  a, b = operands(m, n, k, seed=m + k)
  want = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
  for backend in ("pallas", "xla"):
    c = jax.jit(functools.partial(ops.dense_gemm, backend=backend))(a, b)
    assert c.shape == (m, n)
    assert_bf16_close(c, want)


def test_empty_operands_give_zeros():
  a, b = jnp.zeros((0, 48), jnp.bfloat16), jnp.zeros((16, 48), jnp.bfloat16)
  assert dg.dense_gemm_nt(a, b, interpret=True).shape == (0, 16)
  c = dg.dense_gemm_nt(jnp.zeros((3, 0), jnp.bfloat16), jnp.zeros((5, 0), jnp.bfloat16), interpret=True)
  np.testing.assert_array_equal(np.asarray(c, np.float32), np.zeros((3, 5)))


@pytest.mark.parametrize("layout", dg.LAYOUTS)
def test_every_layout_matches_numpy(layout):
  """`gemm` in each operand layout: C = op(X) . op(Y) with the stored arrays
  transposed as the layout says, ragged in every dimension."""
  m, n, k = 37, 21, 50
  x, y = operands(m, k, n, seed=5)[0], operands(n, k, n, seed=6)[0]  # [M,K], [N,K] values
  want = np.asarray(x, np.float64) @ np.asarray(y, np.float64).T
  x_stored = x if layout[0] == "n" else x.T
  y_stored = y.T if layout[1] == "n" else y
  c = dg.gemm(x_stored, y_stored, layout=layout, config=SMALL_BLOCKS, interpret=True)
  assert_bf16_close(c, want)


# ---------------------------------------------------------------------------
# Gradients.


def dense_gemm_op(backend, config=None):
  return lambda a, b: ops.dense_gemm(a, b, backend=backend, config=config)


@pytest.mark.parametrize("m,n,k", [(1, 24, 40), (33, 100, 130), (64, 32, 48), (7, 16, 5)])
def test_pallas_gradients_match_xla_under_jit(m, n, k):
  a, b = operands(m, n, k, seed=m)
  pallas = gradients.grads(dense_gemm_op("pallas"), (a, b), (0, 1))
  xla = gradients.grads(dense_gemm_op("xla"), (a, b), (0, 1))
  assert pallas[0].dtype == pallas[1].dtype == jnp.bfloat16
  gradients.assert_grads_close(pallas, xla, ("dA", "dB"))


def test_gradients_with_many_tiles_and_batch_dimensions():
  """Small backward tiles: many tiles, short groups and K tails in both
  gradient GEMMs; a leading batch dimension on the activations."""
  a = operands(6, 40, 72, seed=8)[0].reshape(2, 3, 72)
  b = operands(6, 40, 72, seed=9)[1]

  def pallas(a, b):
    return dg.dense_gemm_nt(
      a.reshape(-1, 72), b, config=SMALL_BLOCKS, backward_config=(SMALL_BLOCKS, SMALL_BLOCKS), interpret=True
    ).reshape(2, 3, 40)

  got = gradients.grads(pallas, (a, b), (0, 1))
  want = gradients.grads(dense_gemm_op("xla"), (a, b), (0, 1))
  gradients.assert_grads_close(got, want, ("dA", "dB"))


@pytest.mark.device_stack
def test_gradient_runs_pallas_kernels():
  a, b = operands(5, 24, 40)
  weights = gradients.weights_like((5, 24))
  names = gradients.pallas_calls(jax.grad(gradients.loss(dense_gemm_op("pallas"), weights), (0, 1)), a, b)
  assert {"dense_gemm_nn", "dense_gemm_tn"} <= set(names) and len(names) >= 2, names


def test_gradients_match_float64_finite_differences():
  """float32 operands through the Pallas path (interpret mode) against
  central differences of the float64 product."""
  rng = np.random.default_rng(3)
  a, b = rng.standard_normal((3, 20)), rng.standard_normal((17, 20))
  weights = gradients.weights_like((3, 17))
  f = gradients.loss(lambda a, b: dg.dense_gemm_nt(a, b, out_dtype=jnp.float32, interpret=True), weights)
  got = jax.grad(f, (0, 1))(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  want = gradients.finite_difference_grads(lambda a, b: a @ b.T, [a, b], np.asarray(weights, np.float64))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-4, atol=1e-4)


def backward_launches(m, n, k):
  """dA [M,K] (layout nn) and dB [N,K] (layout tn), heuristic configs."""
  config_da, config_db = dg.backward_configs(m, n, k)
  return [
    TritonCall(
      "dense_gemm_nn",
      (-(-m // config_da.block_m) * -(-k // config_da.block_n), 1, 1),
      config_da.num_warps,
      config_da.num_stages,
    ),
    TritonCall(
      "dense_gemm_tn",
      (-(-n // config_db.block_m) * -(-k // config_db.block_n), 1, 1),
      config_db.num_warps,
      config_db.num_stages,
    ),
  ]


@pytest.mark.parametrize("m,n,k", [(4125, 4096, 4096), (1, 4096, 12288), (24576, 12288, 4096), (7, 1000, 4100)])
def test_backward_lowers_to_its_launches(m, n, k):
  """The gradient of the loss (C unused: only the backward GEMMs remain)
  lowers for an H100 to the two launches its configs imply."""
  shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (n, k))]
  grad = jax.grad(lambda a, b: jnp.sum(dg.dense_gemm_nt(a, b, interpret=False).astype(jnp.float32)), (0, 1))
  assert sorted(triton_calls(lower_for_h100(grad, *shapes))) == sorted(backward_launches(m, n, k))
