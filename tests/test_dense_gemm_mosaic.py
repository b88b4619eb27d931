"""What is the Mosaic GPU dense GEMM's own (`pallas_kernels.dense_gemm.mosaic_gpu`):
empty products, the inputs it refuses, config and problem checks, the
heuristic and grid, the H100 lowering of every shipped config at the
recorded (N, K) on the main environment's jax, and the synchronization
faults the interpret run must catch (its barrier checks, its race
detector). Its interpret-mode runs against the reference (ragged M and N,
many tiles, every candidate) are kit cases in `test_dense_gemm.py`; like
every interpret run in the suite, they run the race detector."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mosaic_faults import assert_interpreter_reports, assert_race_detected, results_without_race_detection

from pallas_kernels.dense_gemm import mosaic_gpu as mg
from pallas_kernels.shared import device
from pallas_kernels.shared.kernel import Unsupported
from pallas_kernels.shared.lowering import lower_for_h100

RECORDED_NK = ((12288, 4096), (4096, 4096), (4096, 12288))
LARGEST_RECORDED_M = 24576


def operands(m, n, k, seed=0):
  key_a, key_b = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(key_a, (m, k), jnp.bfloat16)
  b = (jax.random.normal(key_b, (n, k)) / np.sqrt(k)).astype(jnp.bfloat16)
  return a, b


def reference(a, b):
  """Plain jnp: fp32-accumulated A @ B^T rounded to bf16 once."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def assert_within_one_ulp(c, want):
  """Equal up to one bf16 ulp of the reference (a different fp32 summation
  order may round to the neighbouring bf16 value), plus 1e-4 absolute for
  results that cancel to near zero; no NaN."""
  c, want = np.asarray(c, np.float32), np.asarray(want, np.float32)
  assert c.shape == want.shape
  assert np.isfinite(c).all()
  ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), 2.0**-126))) - 7)
  err = np.abs(c - want)
  assert (err <= ulp + 1e-4).all(), f"max error {err.max()} at {np.unravel_index(err.argmax(), err.shape)}"


def shapes(m, n, k):
  return {"A": jax.ShapeDtypeStruct((m, k), jnp.bfloat16), "B": jax.ShapeDtypeStruct((n, k), jnp.bfloat16)}


@pytest.mark.parametrize("m,n,k", [(0, 256, 64), (3, 0, 64), (3, 256, 0)])
def test_empty_products_are_zeros(m, n, k):
  c = mg.dense_gemm_nt(jnp.ones((m, k), jnp.bfloat16), jnp.ones((n, k), jnp.bfloat16), interpret=True)
  assert c.shape == (m, n) and c.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(c, np.float32), np.zeros((m, n)))


@pytest.mark.parametrize(
  "n,k,match", [(4000, 4096, "N=4000 must be a multiple of 64"), (4096, 4100, "MosaicGemmConfig.block_k=64")]
)
def test_unsupported_n_or_k_is_refused(n, k, match):
  a, b = jnp.zeros((8, k), jnp.bfloat16), jnp.zeros((n, k), jnp.bfloat16)
  with pytest.raises(Unsupported, match=match):
    mg.dense_gemm_nt(a, b, interpret=True)


def test_unsupported_dtypes_are_refused():
  a = jnp.zeros((8, 64), jnp.float32)
  with pytest.raises(Unsupported, match="bfloat16 or float16"):
    mg.dense_gemm_nt(a, a, interpret=True)
  with pytest.raises(Unsupported, match="bfloat16 or float16"):
    mg.dense_gemm_nt(a.astype(jnp.bfloat16), a.astype(jnp.bfloat16), out_dtype=jnp.float32, interpret=True)


def test_heuristic_narrows_block_n_to_a_multiple_of_128():
  assert mg.choose_config(shapes(64, 384, 64)).block_n == 128
  assert mg.choose_config(shapes(64, 320, 64)).block_n == 256  # a partial last tile instead


@pytest.mark.parametrize(
  "overrides,field",
  [
    ({"block_m": 96}, "block_m"),
    ({"block_k": 32}, "block_k"),
    ({"stages": 1}, "stages"),
    ({"split": "k"}, "split"),
    ({"grid": 0}, "grid"),
    ({"block_m": 256, "block_n": 256}, "accumulator_elements"),
    ({"block_n": 512, "split": "m", "block_m": 64}, "consumer_rows"),
    ({"stages": 5}, "shared_memory_bytes"),
  ],
)
def test_config_rejects_bad_fields(overrides, field):
  with pytest.raises(ValueError, match=f"MosaicGemmConfig.{field}="):
    mg.MosaicGemmConfig(**overrides)


@pytest.mark.parametrize("m", [1, 5, 4096, 4125, LARGEST_RECORDED_M])
def test_heuristic_is_the_first_candidate_and_every_candidate_fits(m):
  for n, k in RECORDED_NK:
    candidates = mg.candidate_configs(shapes(m, n, k))
    assert candidates[0] == mg.choose_config(shapes(m, n, k))
    assert len(candidates) == len(set(candidates)) >= 5
    for config in candidates:
      mg.check_problem(m, n, k, config)


def test_grid_is_the_sm_count_capped_by_the_tiles():
  config = mg.DEFAULT_CONFIG
  assert mg.grid_size(config, LARGEST_RECORDED_M, 12288) == device.DEFAULT_NUM_SMS
  assert mg.grid_size(config, 200, 512) == 4  # 2 x 2 tiles
  assert mg.grid_size(mg.MosaicGemmConfig(grid=7), LARGEST_RECORDED_M, 12288) == 7


def lower(m, n, k, config):
  """StableHLO of the kernel lowered for an abstract H100 with 132 SMs."""

  def fn(a, b):
    assert mg.num_sms() == 132
    return mg.dense_gemm_nt(a, b, config=config, interpret=False)

  return lower_for_h100(fn, *shapes(m, n, k).values())


@pytest.mark.parametrize("n,k", RECORDED_NK)
def test_every_shipped_config_lowers_for_h100(n, k):
  """Layout inference and the shared-memory limit run at lowering."""
  for config in mg.candidate_configs(shapes(LARGEST_RECORDED_M, n, k)):
    assert "mosaic_gpu_v2" in lower(LARGEST_RECORDED_M, n, k, config)


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
@pytest.mark.parametrize("m", [1, 4125])
def test_short_and_unaligned_m_lower(m):
  assert "mosaic_gpu_v2" in lower(m, 4096, 4096, mg.DEFAULT_CONFIG)


# ---------------------------------------------------------------------------
# Synchronization faults. Interpret mode runs each warpgroup as a thread and
# checks the barrier phase invariants; its race detector (on in the whole
# suite) orders every load, store and TMA copy by the barriers, store waits
# and `commit_smem` between them. Neither models wgmma (a wgmma is done when
# issued and its operand reads are not checked): the ring's faults are
# caught by the phase checks or by wrong products, the epilogue's by the
# detector.

FAULT_PROBLEM = (128, 256, 512)  # 8 K steps through a 2-slot ring: 4 uses per slot; 4 epilogue pieces per consumer
FAULT_CONFIG = mg.MosaicGemmConfig(stages=2, grid=1)


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_correct_protocol_on_the_fault_problem():
  """Also: the race detector finds nothing in the shipped protocol."""
  a, b = operands(*FAULT_PROBLEM, seed=2)
  assert_within_one_ulp(mg._gemm(a, b, FAULT_CONFIG, True, jnp.bfloat16), reference(a, b))


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_slot_released_by_one_consumer_is_caught():
  """`empty` counting one arrival instead of one per consumer lets the
  producer refill a slot that the other consumer has not read yet; the
  phases then run ahead of their waiters, which the interpreter reports.
  (The race detector cannot see the consumers' reads, wgmma's; it flags a
  TMA load over one no consumer has waited on when the producer gets that
  far first: timing-dependent, not asserted.)"""
  a, b = operands(*FAULT_PROBLEM, seed=2)
  assert_interpreter_reports(lambda: mg._gemm(a, b, FAULT_CONFIG, True, jnp.bfloat16, fault="release_once"), "phase")


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_off_by_one_ring_slot_is_caught():
  """Consumers reading the slot after the one their barrier guards compute
  with data of another K step (or not loaded yet): the product is wrong.
  The race detector does not see it (the reads are wgmma's)."""
  a, b = operands(*FAULT_PROBLEM, seed=2)
  c = np.asarray(mg._gemm(a, b, FAULT_CONFIG, True, jnp.bfloat16, fault="wrong_slot"), np.float32)
  want = np.asarray(reference(a, b), np.float32)
  assert not np.allclose(c, want, atol=0.05, rtol=0.05, equal_nan=False)


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
@pytest.mark.parametrize(
  "fault",
  [
    # A piece written into its epilogue slot while the TMA store of two
    # pieces ago may still read it (no `wait_smem_to_gmem(1)` first).
    "epilogue_unwaited",
    # A piece stored without `commit_smem()`: its writes are not ordered
    # before the TMA's read.
    "uncommitted",
  ],
)
def test_epilogue_races_only_the_race_detector_catches(fault):
  """The interpreter runs a TMA store when it is issued, so the products
  are right; the race detector reports the unordered write and read."""
  a, b = operands(*FAULT_PROBLEM, seed=2)

  def launch():
    return mg._gemm(a, b, FAULT_CONFIG, True, jnp.bfloat16, fault=fault)

  assert_within_one_ulp(results_without_race_detection(launch), reference(a, b))
  assert_race_detected(launch, mg.__name__)


def test_unknown_fault_is_refused():
  a, b = operands(8, 256, 64)
  with pytest.raises(ValueError, match="fault must be None or one of"):
    mg._gemm(a, b, FAULT_CONFIG, True, jnp.bfloat16, fault="skip_everything")
