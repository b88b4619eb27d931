"""What is the Mosaic GPU grouped GEMM's own (`pallas_kernels.grouped_gemm.mosaic_gpu`):
the work list of item runs, the weights' decode and the activation operand
in the permuted k order, the fold
and its fallback (promoted groups) against float64 NumPy, the inputs it
refuses, the heuristic, and the synchronization faults the interpret run
must catch. Its H100 lowering and interpret-mode
runs on the kit's edge cases (decode, rows in any order with invalid ids,
ragged items over two N tiles) are kit cases in `test_grouped_gemm.py`;
its sm_90a compile is `test_aot.py`'s.
Mosaic GPU's interpreter is slow (seconds a launch): shapes are tiny."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_grouped_gemm import E2M1, grouped, operands, reference_float64, run_ptx

from jaxkern.families import grouped_gemm as fam
from pallas_kernels.grouped_gemm import mosaic_gpu as mg
from pallas_kernels.grouped_gemm import triton as gg
from pallas_kernels.shared import fp_formats
from pallas_kernels.shared import mosaic_gpu_compat as compat
from pallas_kernels.shared.kernel import Unsupported

RECORDED_NK = ((4608, 5120), (5120, 2304))


def shapes(m, n=4608, k=5120, e=384):
  return {
    "a": jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
    "a_scale": jax.ShapeDtypeStruct((m, k // 32), jnp.uint8),
    "b": jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8),
    "b_scale": jax.ShapeDtypeStruct((e, n, k // 32), jnp.uint8),
    "expert_ids": jax.ShapeDtypeStruct((m,), jnp.int32),
  }


@pytest.mark.parametrize("seed", range(5))
def test_work_list_covers_every_row_once_in_runs(seed):
  """Items are runs of consecutive rows with one key (the id, E when
  invalid), at most block_m rows, in row order, every row in exactly one;
  each item names its expert's index among the distinct valid ids."""
  rng = np.random.default_rng(seed)
  e, block_m, m = int(rng.integers(1, 10)), int(rng.choice([8, 16, 64])), int(rng.integers(1, 200))
  ids = rng.integers(-2, e + 2, m) if seed % 2 else np.sort(rng.integers(0, e, m))
  items, count, experts, _ = (np.asarray(x) for x in mg.work_list(jnp.asarray(ids, jnp.int32), e, block_m))
  key = np.where((ids >= 0) & (ids < e), ids, e)
  count = int(count[0])
  distinct = np.unique(key[key < e])
  np.testing.assert_array_equal(experts[: len(distinct)], distinct)
  covered = np.zeros(m, int)
  expected_first = 0
  for item_key, first, rows, used in items.T[:count]:
    assert first == expected_first and 1 <= rows <= block_m
    assert np.all(key[first : first + rows] == item_key)
    if item_key < e:
      assert experts[used] == item_key
    covered[first : first + rows] += 1
    expected_first = first + rows
  assert np.all(covered == 1)
  assert np.all(items[2, count:] == 0)


def test_weight_decode_gives_the_values_in_the_permuted_k_order():
  """Every byte pair (four e2m1 codes, low nibble first) decodes to f16 in
  the kernel's k order: in each 32-k group, column 8i + j holds k = 4j + i."""
  pairs = jnp.arange(1 << 16, dtype=jnp.uint32).astype(jnp.uint16).reshape(-1, 8)
  mult = jnp.full((pairs.shape[0],), 2.0**-3, jnp.float16)
  got = np.asarray(mg.weights_to_f16(pairs, mult), np.float64)
  packed = np.asarray(pairs).view(np.uint8).reshape(-1, 16)
  low, high = (np.asarray(x) for x in fp_formats.unpack_e2m1(jnp.asarray(packed)))
  values = np.stack([E2M1[low], E2M1[high]], -1).reshape(-1, 32) * 2.0**-6 * 2.0**-3
  np.testing.assert_array_equal(got, np.asarray(mg.permute_group(jnp.asarray(values))))


def test_activation_operand_keeps_every_value_exactly():
  """The activations converted before the launch: every e4m3 byte value in
  rows that fold (each group d bytes below the row's largest scale is
  `e4m3 x 2^(7 - d)`, d up to the fold's limit) and rows that do not (a
  spread one byte beyond it; a byte 0), in the permuted k order by scale
  group; and each f16 value times 2^(promotion byte - 127) is the
  activation times its own scale, exactly (what the promoted fallback
  multiplies by)."""
  rows, k = 4, 256
  a_bytes = np.arange(rows * k, dtype=np.uint32).reshape(rows, k).astype(np.uint8)
  a = jnp.asarray(a_bytes).view(jnp.float8_e4m3fn)
  hi = 150
  spread = np.arange(k // 32) * gg.FOLD_A_MAX_SHIFT // (k // 32 - 1)  # 0 .. the limit
  a_scale = np.stack([hi - spread, hi - spread[::-1], hi - spread - (spread == spread.max()), hi - 0 * spread])
  a_scale[3, 2] = 0  # a byte 0 does not fold
  a16, promote, a_fold = (np.asarray(x) for x in mg.activation_operand(a, jnp.asarray(a_scale, jnp.uint8)))
  assert list(a_fold) == [hi, hi, -1, -1] and a16.shape == (k // 32, rows, 32) and a16.dtype == np.float16
  values = np.asarray(a.astype(jnp.float32), np.float64) * 2.0 ** (np.repeat(a_scale, 32, axis=1) - 127.0)
  got = np.swapaxes(a16, 0, 1).astype(np.float64) * 2.0 ** (promote.T[:, :, None] - 127.0)
  np.testing.assert_array_equal(got.reshape(rows, k), np.asarray(mg.permute_group(jnp.asarray(values))))
  np.testing.assert_array_equal(promote.T[2:], a_scale[2:])  # rows that do not fold: their own bytes
  finite = np.isfinite(values)
  assert (np.asarray(a.astype(jnp.float32))[finite] != 0).sum() > 0.9 * finite.size


def test_ptx_decode_text_matches_jnp_on_every_pair():
  """The compiled kernel's weight decode (`E2M1_PAIRS_TO_F16_PTX`, run by
  the test emulator of `test_grouped_gemm`) on a register of two byte
  pairs gives, in result i, code i of each lane's pair as the jnp form
  does: every 16-bit pair value in either lane, the other lane varied."""
  values = np.arange(1 << 16, dtype=np.uint32)
  for lane in range(2):
    other = np.roll(values, 12345)
    words = values << (16 * lane) | other << (16 * (1 - lane))
    regs = run_ptx(mg.E2M1_PAIRS_TO_F16_PTX, {"$4": words})
    want = [np.asarray(x) for x in mg._codes_to_f16(jnp.asarray(values, jnp.uint16))]
    for i in range(4):
      got = (regs[f"${i}"] >> (16 * lane) & 0xFFFF).astype(np.uint16).view(np.float16)
      np.testing.assert_array_equal(got.view(np.uint16), want[i].view(np.uint16))


def test_permuted_order_leaves_a_dot_unchanged():
  a, b = (jax.random.randint(jax.random.key(i), (8, 96), -8, 8).astype(jnp.float32) for i in (0, 1))
  np.testing.assert_array_equal(np.asarray(mg.permute_group(a) @ mg.permute_group(b).T), np.asarray(a @ b.T))


def spread_operands():
  """E = 4, N = 64, K = 64 (two scale groups), 9 rows an expert: expert 1
  has an activation row and expert 3 a weight row whose scales spread one
  byte beyond the fold's limits (the only nonzero products far below the
  row's largest scale), so their units take the promoted fallback;
  experts 0 and 2 fold."""
  x = operands(grouped([(e, 9) for e in range(4)]), 64, 64, e=4, seed=11)
  a, a_scale = np.asarray(x["a"]).view(np.uint8).copy(), np.asarray(x["a_scale"]).copy()
  b, b_scale = np.asarray(x["b"]).copy(), np.asarray(x["b_scale"]).copy()
  a[9 + 4, :32], a_scale[9 + 4] = 0, [140, 140 - gg.FOLD_A_MAX_SHIFT - 1]
  b[3, 5, :16], b_scale[3, 5] = 0, [140, 140 - gg.FOLD_B_MAX_SHIFT - 1]
  return {
    **x,
    "a": jnp.asarray(a).view(jnp.float8_e4m3fn),
    "a_scale": jnp.asarray(a_scale),
    "b": jnp.asarray(b),
    "b_scale": jnp.asarray(b_scale),
  }


def test_fold_and_its_promoted_fallback_match_float64():
  """Folded units and the units beyond the fold's limits (promoted per
  scale group) equal float64 NumPy to bf16 rounding, element by element
  (relative: the rows far below their largest scale are compared at their
  own size); the fallback's units are the ones `_operands` flags."""
  x = spread_operands()
  config = mg.MosaicGroupedGemmConfig(block_m=16, block_n=128, stages=2)
  items, _, fold = (np.asarray(v) for v in mg._operands(**x, config=config)[:3])
  assert list(fold[:4, 0]) == [1, 0, 1, 0] and list(items[0, :4]) == [0, 1, 2, 3]
  out = np.asarray(mg.grouped_gemm_fp8_fp4(**x, config=config, interpret=True), np.float64)
  np.testing.assert_allclose(out, reference_float64(**x), rtol=2**-7, atol=0)


def test_unsupported_n_is_refused():
  x = operands([0, 1], 40, 64, e=2)
  with pytest.raises(Unsupported, match="N=40 must be a multiple of 64"):
    mg.grouped_gemm_fp8_fp4(**x, interpret=True)


def test_empty_rows_give_an_empty_result():
  x = operands([], 64, 64, e=2)
  c = mg.grouped_gemm_fp8_fp4(**x, interpret=True)
  assert c.shape == (0, 64) and c.dtype == jnp.bfloat16


@pytest.mark.parametrize(
  "overrides,field",
  [({"block_m": 12}, "block_m"), ({"block_n": 64}, "block_n"), ({"stages": 1}, "stages"), ({"grid": 0}, "grid")],
)
def test_config_rejects_bad_fields(overrides, field):
  with pytest.raises(ValueError, match=f"MosaicGroupedGemmConfig.{field}="):
    mg.MosaicGroupedGemmConfig(**overrides)


def test_heuristic_items_follow_the_rows_per_expert_and_fit():
  assert mg.choose_config(shapes(6)).block_m == 8  # decode: one row an expert
  assert mg.choose_config(shapes(18)).block_m == 8
  assert mg.choose_config(shapes(2688)).block_m == 16  # 7 rows an expert on average
  assert mg.choose_config(shapes(24576)).block_m == 64
  for m in (6, 24576):
    for n, k in RECORDED_NK:
      candidates = mg.candidate_configs(shapes(m, n, k))
      assert candidates[0] == mg.choose_config(shapes(m, n, k))
      assert all(mg.fits(c) for c in candidates) and len(candidates) >= 4


def test_reference_agrees_on_the_decode_case():
  """The family reference and float64 NumPy agree on the fault problem's
  operands (what the fault tests compare the kernel with)."""
  x = fault_operands()
  ref = np.asarray(fam.grouped_gemm_fp8_fp4_reference(**x), np.float64)
  np.testing.assert_allclose(ref, reference_float64(**x), rtol=2**-7, atol=1e-6)


# ---------------------------------------------------------------------------
# Synchronization faults. The interpreter runs each warpgroup as a thread and
# checks barrier phases, not asynchrony, so each fault breaks the ring
# protocol itself: 12 steps (3 units of 4) through a 2-slot ring.

FAULT_CONFIG = mg.MosaicGroupedGemmConfig(block_m=8, block_n=128, stages=2, grid=1)


def fault_operands():
  return operands([0, 1, 2], 64, 256, e=3, seed=2)


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_correct_protocol_on_the_fault_problem():
  x = fault_operands()
  out = np.asarray(mg._launch(**x, config=FAULT_CONFIG, interpret=True), np.float64)
  np.testing.assert_allclose(out, reference_float64(**x), rtol=2**-7, atol=1e-6)


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
@pytest.mark.parametrize("fault", mg.FAULTS)
def test_broken_barriers_are_caught(fault):
  """`release_once`: `empty` counting one arrival instead of one per
  consumer lets the producer refill a slot the other consumer still reads;
  `staged_short`: `loaded` counting one copy fewer than a step makes
  completes before the last copy lands. Either way a barrier's phases run
  ahead of its waiters, which the interpreter reports."""
  x = fault_operands()
  try:
    with pytest.raises(Exception, match="phase|arriv|barrier"):
      jax.block_until_ready(mg._launch(**x, config=FAULT_CONFIG, interpret=True, fault=fault))
  finally:
    compat.reset_interpreter()


def test_unknown_fault_is_refused():
  with pytest.raises(ValueError, match="fault must be None or one of"):
    mg._launch(**fault_operands(), config=FAULT_CONFIG, interpret=True, fault="skip_everything")
