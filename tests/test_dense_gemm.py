"""Dense BF16 NT GEMM: the kit's data (launches, edge cases: ragged and tiny
shapes, the K tail, tile groups; lowering at ragged sizes) and the family's
own checks: every tile order, the chunked reference vs float64 numpy, the
heuristic, synthesis scales, CPU axes. (The checks themselves:
test_definitions.py and kit.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import registry
from jaxkern.families import dense_gemm as gemm
from kit import Case, TritonCall
from pallas_kernels import dense_gemm as dg

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


KERNEL_CASES = [Case(GEMM, {"M": m, "N": n, "K": k}, config=config, id=label) for m, n, k, config, label in [
    (1, 24, 40, None, "decode_row_ragged_nk"),
    (7, 64, 64, None, "seven_rows"),
    (33, 100, 130, None, "ragged_mnk"),
    (130, 300, 96, None, "two_m_tiles_ragged_second"),
    (33, 100, 130, SMALL_BLOCKS, "many_tiles_k_tail"),
    (40, 72, 72, SMALL_BLOCKS, "groups_of_2_and_1"),   # 3x5 tiles
    (1, 16, 16, SMALL_BLOCKS, "one_tile_exactly"),
]]
LOWERING_CASES = [
    Case(GEMM, {"M": 4125}),
    Case("dense_gemm_bf16_nt_n4096_k12288", {"M": 1}),
    Case(GEMM, {"M": 4125, "N": 1000, "K": 4100}, id="ragged_n_and_k"),
]
SWEEP_CASE = Case(GEMM, {"M": 33, "N": 100, "K": 130})


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
  tile_m, tile_n = dg._tile_coords(pids, num_pid_m, num_pid_n, min(group_m, num_pid_m))
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
