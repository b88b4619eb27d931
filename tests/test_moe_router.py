"""MoE router GEMM + top-k: the kit's data (launches; edge cases for the
decode and wide tilings: one launch at decode (one or several route steps,
several row blocks), uneven D splits, ragged D, M and E blocks, small E;
lowering of those) and the family's own checks: exact ties, NaN/inf rows,
M = 0, biased selection, the runtime scale, the reference vs float64 numpy,
the heuristic (one launch and its programs at decode, tiles at M = 4096),
synthesis scales, the policies.
(The checks themselves: test_definitions.py and kit.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kit import Case, TritonCall

from jaxkern import compare, registry
from jaxkern.families import moe_router as fam
from pallas_kernels.moe_router import triton as mr
from pallas_kernels.shared.lowering import lower_for_h100, triton_calls

NAME = "moe_router_gemm_topk_deepseek41_d5120_e384_topk6"
D, E, TOPK = 5120, 384, 6
RECORDED_M = (1, 2, 3, 128, 448, 1984, 2432, 2944, 3456, 4032, 4096)

# Large tiles without a D split (the M >= 2k form) and 16 x 16 tiles over 7
# requested D splits of 80 64-column blocks (12 each, a short last split).
WIDE = mr.MoeRouterConfig(
  mr.RouterGemmStage(block_m=64, block_e=128, block_d=128, split_d=1, num_warps=8, num_stages=3)
)
ODD_SPLIT = mr.MoeRouterConfig(
  mr.RouterGemmStage(block_m=16, block_e=16, block_d=64, split_d=7, num_warps=4, num_stages=3),
  mr.RouterEpilogueStage(block_m=16, num_warps=8),
)
# The decode tiling in two launches (the one-launch form's alternative).
TWO_LAUNCHES = mr.MoeRouterConfig(
  mr.RouterGemmStage(block_m=16, block_e=16, block_d=128, split_d=7, num_warps=4, num_stages=3),
  mr.RouterEpilogueStage(block_m=8, num_warps=4),
)
# One launch over 2 D splits of 64-column blocks and 16-expert blocks: with
# SMALL_E (M = 19, D = 200, E = 40) two row blocks, each with its own
# arrival count, ragged E and D blocks, and 4-row route steps (the second
# row block's 3 rows in one short step).
ONE_LAUNCH = mr.MoeRouterConfig(
  mr.RouterGemmStage(block_m=16, block_e=16, block_d=64, split_d=2, num_warps=4, num_stages=2),
  mr.RouterEpilogueStage(block_m=4, num_warps=4),
  one_launch=True,
)


def shapes(m, d=D, e=E):
  return {"hidden": jax.ShapeDtypeStruct((m, d), jnp.bfloat16), "weight": jax.ShapeDtypeStruct((e, d), jnp.bfloat16)}


def inputs_for(m, d=D, e=E, seed=0):
  return fam.make_inputs({"M": m, "D": d, "E": e, "TOPK": TOPK}, jax.random.key(seed), None)


def assert_routes_match(ids, weights, inputs, ref, top_k=TOPK):
  """Ids exact, or (near-tie from fp32 summation order) a different set whose
  reference selection scores match within f32 tolerance; weights compared on
  the ids both selected (SPEC 5)."""
  ids, weights = np.asarray(ids), np.asarray(weights)
  ref_ids, ref_w = np.asarray(ref["expert_ids"]), np.asarray(ref["expert_weights"])
  e = inputs["weight"].shape[0]
  assert ids.dtype == np.int32 and weights.dtype == np.float32
  assert ids.shape == ref_ids.shape == weights.shape == (inputs["hidden"].shape[0], top_k)
  assert ((ids >= 0) & (ids < e)).all()
  assert (np.diff(ids, axis=1) > 0).all(), "ids must be unique and ascending"
  scores = np.asarray(fam.selection_scores(inputs))
  for row in np.nonzero((ids != ref_ids).any(axis=1))[0]:
    got = np.sort(scores[row, ids[row]])[::-1]
    want = np.sort(scores[row, ref_ids[row]])[::-1]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5, err_msg=f"row {row} selects other experts")
  common = ids[:, :, None] == ref_ids[:, None, :]
  aligned = np.where(common.any(-1), (ref_w[:, None, :] * common).sum(-1), weights)
  np.testing.assert_allclose(weights, aligned, rtol=1e-4, atol=2e-5)
  return int((ids != ref_ids).any(axis=1).sum())


def reference(inputs, top_k=TOPK):
  return dict(zip(("expert_ids", "expert_weights"), fam.moe_router_reference(**inputs, top_k=top_k)))


def run_kernel(inputs, config=None, top_k=TOPK):
  return mr.moe_router_topk(
    inputs["hidden"],
    inputs["weight"],
    inputs["bias"],
    inputs["routed_scaling_factor"],
    top_k=top_k,
    config=config,
    interpret=True,
  )


def launches(config, axes):
  """The kernel fits the config to the problem (blocks to the next power of
  two of M, E and D, at least 16; `split_d` to the splits its blocks make).
  Two launches: the logits GEMM over (E blocks, M blocks, D splits), then
  the reduce and route kernel over epilogue row blocks (one stage). One
  launch: the GEMM's grid, warps and stages only."""
  m, d, e = axes["M"], axes["D"], axes["E"]
  pow2 = lambda n: 1 << max(n - 1, 0).bit_length()  # noqa: E731
  fit = lambda block, n: max(16, min(block, pow2(n)))  # noqa: E731
  gemm = config.gemm
  block_m, block_e, block_d = fit(gemm.block_m, m), fit(gemm.block_e, e), fit(gemm.block_d, d)
  blocks = -(-d // block_d)
  splits = -(-blocks // -(-blocks // gemm.split_d))
  grid = (-(-e // block_e), -(-m // block_m), splits)
  if config.one_launch:
    return [TritonCall("moe_router_one_launch", grid, gemm.num_warps, gemm.num_stages)]
  epilogue_m = min(config.epilogue.block_m, pow2(m))
  return [
    TritonCall("moe_router_logits", grid, gemm.num_warps, gemm.num_stages),
    TritonCall("moe_router_reduce_route", (-(-m // epilogue_m), 1, 1), config.epilogue.num_warps, 1),
  ]


def weights_sum_to_the_scale(out, ref, inputs):
  np.testing.assert_allclose(np.asarray(out["expert_weights"]).sum(1), 1.5, rtol=1e-5)


KERNEL_CASES = [
  Case(NAME, {"M": m}, config=config, check=weights_sum_to_the_scale, id=label)
  for m, config, label in [
    (1, None, "decode_one_launch_one_row"),
    (16, None, "decode_one_launch_two_8_row_steps"),
    (5, TWO_LAUNCHES, "two_launches_five_rows_in_an_8_row_epilogue"),
    (3, WIDE, "decode_in_one_wide_tile"),
    (33, None, "ragged_m"),
    (70, WIDE, "wide_tiles_ragged_m"),
    (40, ODD_SPLIT, "uneven_d_splits"),
  ]
]
# D not a multiple of block_d, E and top_k not powers of two (E blocks ragged).
SMALL_E = {"M": 19, "D": 200, "E": 40, "TOPK": 3}
KERNEL_CASES += [
  Case(NAME, SMALL_E, config=c, id=f"ragged_d_small_e_{i}") for i, c in enumerate((None, WIDE, ONE_LAUNCH))
]
LOWERING_CASES = [
  Case(NAME, SMALL_E, config=c, id=f"ragged_d_small_e_{i}") for i, c in enumerate((None, WIDE, ODD_SPLIT, ONE_LAUNCH))
]
LOWERING_CASES += [Case(NAME, {"M": m}, id=f"decode_one_launch_m{m}") for m in (1, 16)]
SWEEP_CASE = Case(NAME, {"M": 5, "D": 256, "E": 40})  # D splits, E blocks, both epilogues, both launch forms


def test_reference_matches_float64():
  m, d, e = 5, 32, 20
  inputs = inputs_for(m, d=d, e=e, seed=3)
  ref = reference(inputs)
  h = np.asarray(inputs["hidden"], np.float64)
  w = np.asarray(inputs["weight"], np.float64)
  logits = h @ w.T
  scores = np.sqrt(np.logaddexp(0.0, logits))
  ranking = scores + np.asarray(inputs["bias"], np.float64)
  # Stable sort on -ranking: equal values keep index order (lower id first).
  sel = np.sort(np.argsort(-ranking, axis=1, kind="stable")[:, :TOPK], axis=1)
  chosen = np.take_along_axis(scores, sel, axis=1)
  weights = chosen / chosen.sum(1, keepdims=True) * 1.5
  np.testing.assert_array_equal(np.asarray(ref["expert_ids"]), sel)
  np.testing.assert_allclose(np.asarray(ref["expert_weights"]), weights, rtol=1e-5)


def _tied_inputs():
  """Rows whose top-6 must break exact ties by the lower expert id.

  Row 0: experts 7 and 300 win clearly; every other weight row is zero, so
  the remaining 382 experts tie exactly (logit 0) and the picks must be
  0, 1, 2, 3. Row 1: experts 10 < 200 < 350 have identical rows and tie
  for the last slot behind five clear winners, so 10 must be picked.
  """
  d, e = 64, E
  hidden = np.zeros((2, d), np.float32)
  hidden[0, 0] = 1.0
  hidden[1, 1] = 1.0
  weight = np.zeros((e, d), np.float32)
  weight[7, 0], weight[300, 0] = 4.0, 3.0
  for rank, expert in enumerate((5, 50, 100, 150, 383)):
    weight[expert, 1] = 8.0 - rank
  weight[[10, 200, 350], 1] = 2.0
  return {
    "hidden": jnp.asarray(hidden, jnp.bfloat16),
    "weight": jnp.asarray(weight, jnp.bfloat16),
    "bias": jnp.zeros((e,), jnp.float32),
    "routed_scaling_factor": jnp.float32(1.5),
  }


@pytest.mark.parametrize("config", [None, WIDE, ODD_SPLIT])
def test_exact_ties_go_to_lower_expert_id(config):
  inputs = _tied_inputs()
  expected = np.array([[0, 1, 2, 3, 7, 300], [5, 10, 50, 100, 150, 383]], np.int32)
  ref = reference(inputs)
  np.testing.assert_array_equal(np.asarray(ref["expert_ids"]), expected)
  ids, weights = run_kernel(inputs, config)
  np.testing.assert_array_equal(np.asarray(ids), expected)
  np.testing.assert_allclose(np.asarray(weights), np.asarray(ref["expert_weights"]), rtol=1e-5)


def test_large_negative_bias_excludes_experts_but_not_from_weights():
  inputs = inputs_for(4, seed=5)
  unbiased = reference(inputs)["expert_ids"]
  banned = np.unique(np.asarray(unbiased)[:, :3])  # some experts each row would pick
  bias = inputs["bias"].at[banned].set(-1e4)
  bias = bias.at[0].set(-1e30)
  inputs = {**inputs, "bias": bias}
  ref = reference(inputs)
  ids, weights = run_kernel(inputs)
  assert not np.isin(np.asarray(ids), np.append(banned, 0)).any()
  assert_routes_match(ids, weights, inputs, ref)
  # Weights use the unbiased scores: positive, summing to the scale factor.
  assert (np.asarray(weights) > 0).all()
  np.testing.assert_allclose(np.asarray(weights).sum(1), 1.5, rtol=1e-5)
  # All but 4 experts banned: the last 2 picks come from the banned ones by
  # score, never from the kernel's padded expert slots (ids >= E).
  inputs = {**inputs, "bias": jnp.full((E,), -1e4, jnp.float32).at[:4].set(0.0)}
  ids, weights = run_kernel(inputs)
  assert (np.asarray(ids)[:, :4] == np.arange(4)).all()
  assert_routes_match(ids, weights, inputs, reference(inputs))


def test_routed_scaling_factor_is_a_runtime_value():
  inputs = inputs_for(2, seed=6)
  f = jax.jit(lambda scale: run_kernel({**inputs, "routed_scaling_factor": scale})[1])
  np.testing.assert_allclose(np.asarray(f(jnp.float32(3.0))), 2 * np.asarray(f(jnp.float32(1.5))), rtol=1e-6)


def test_nan_rows_give_in_range_ids_like_the_xla_path():
  """A hidden row all NaN: every score is NaN, which XLA's top_k ranks above
  any number (IEEE total order), ties going to the lowest id: experts
  0..k-1 with NaN weights, never the padded experts (ids >= E). A row with
  an inf gives +-inf/NaN logits, ordered the same way."""
  for config in (None, WIDE, ODD_SPLIT):
    inputs = inputs_for(4, d=200, e=40, seed=7)
    hidden = inputs["hidden"].at[1].set(jnp.nan).at[3, 5].set(jnp.inf)
    inputs = {**inputs, "hidden": hidden}
    ref_ids, ref_w = fam.moe_router_reference(**inputs, top_k=TOPK)
    ids, weights = run_kernel(inputs, config)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_array_equal(np.asarray(ids)[1], np.arange(TOPK))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_w), rtol=1e-5, equal_nan=True)
    assert np.isnan(np.asarray(weights)[1]).all()


def test_no_rows():
  inputs = inputs_for(0, d=64, e=40)
  ids, weights = run_kernel(inputs)
  assert ids.shape == weights.shape == (0, TOPK) and ids.dtype == jnp.int32 and weights.dtype == jnp.float32


def test_total_order_key_orders_like_ieee_total_order_with_one_nan():
  values = np.array([-np.inf, -3.0, -1e-40, -0.0, 0.0, 1e-40, 2.0, np.inf, np.nan], np.float32)
  keys = np.asarray(mr.total_order_key(jnp.asarray(values)))
  assert (np.diff(keys) > 0).all()
  # Whatever its sign and payload, a NaN gets +NaN's key: the top of the order.
  nan_bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], np.uint32)
  nan_keys = np.asarray(mr.total_order_key(jnp.asarray(nan_bits.view(np.float32))))
  assert (nan_keys == keys[-1]).all()


def test_a_nan_of_either_sign_routes_the_same_on_both_paths():
  """Biases of -NaN and +NaN on four experts: kernel and reference rank every
  NaN above every number, so both pick those four whatever their signs."""
  inputs = inputs_for(2, d=64, e=40)
  bias_bits = np.zeros(40, np.uint32)
  bias_bits[[3, 17]] = 0xFFC00000  # -NaN
  bias_bits[[9, 30]] = 0x7FC00000  # +NaN
  inputs = dict(inputs, bias=jnp.asarray(bias_bits.view(np.float32)))
  ids, _ = run_kernel(inputs)
  ref_ids = np.asarray(reference(inputs)["expert_ids"])
  assert all({3, 9, 17, 30} <= set(row) for row in ref_ids.tolist())
  np.testing.assert_array_equal(np.asarray(ids), ref_ids)


@pytest.mark.parametrize("m", RECORDED_M + (7, 33, 8192))
def test_heuristic_choice_comes_first_and_every_form_is_swept(m):
  candidates = mr.candidate_configs(shapes(m))
  assert candidates[0] == mr.choose_config(shapes(m))
  assert any(c.gemm.split_d == 1 for c in candidates) and any(c.gemm.split_d > 1 for c in candidates)
  assert len({c.epilogue for c in candidates}) > 1  # the epilogue stage's fields are swept too
  assert len({(c.gemm.block_m, c.gemm.block_e) for c in candidates}) > 1
  assert len(candidates) <= 32  # the sweep stays affordable
  forms = {c.one_launch for c in candidates}
  assert forms == ({True, False} if m <= 16 else {False})  # decode: one launch beside two; prefill as it was


def test_heuristic_fills_the_gpu_at_decode_and_reads_the_weight_once_per_128_rows():
  """Decode: 16 x 16 tiles, E and D split, at least one program per SM (132)
  and each weight element read by one program, all in one launch: the last
  program routes the rows, one row per warp and step at most; M = 4096:
  128 x 128 tiles, no D split (the weight read once per 128 rows, no
  partials beyond the logits), then the route kernel."""
  for m in (1, 2, 3, 16):
    config = mr.choose_config(shapes(m))
    gemm = config.gemm
    assert (gemm.block_m, gemm.block_e, gemm.block_d, gemm.split_d) == (16, 16, 128, 7), m
    assert mr.gemm_programs(gemm, m, E) == 24 * 1 * 7 >= 132
    blocks, per_split = -(-D // gemm.block_d), mr._d_blocks_per_split(gemm, D)
    assert (gemm.split_d - 1) * per_split < blocks <= gemm.split_d * per_split  # no empty split
    assert config.one_launch and config.epilogue.num_warps == gemm.num_warps == (4 if m <= 4 else 8)
    assert config.epilogue.block_m == min(mr.next_pow2(m), gemm.num_warps)
  assert mr.choose_config(shapes(1)).epilogue == mr.RouterEpilogueStage(block_m=1, num_warps=4)
  assert not mr.choose_config(shapes(17)).one_launch
  big = mr.choose_config(shapes(4096))
  assert (big.gemm.block_m, big.gemm.block_e, big.gemm.split_d) == (128, 128, 1)
  assert mr.gemm_programs(big.gemm, 4096, E) == 3 * 32
  assert big.epilogue == mr.RouterEpilogueStage(8, 4) and not big.one_launch
  for m in RECORDED_M + (8192, 100_000):
    c = mr.choose_config(shapes(m))
    assert mr.gemm_programs(c.gemm, m, E) >= 0.7 * 132 and c.gemm.split_d <= 16, (m, c)
    if not c.one_launch:
      assert c.gemm.num_warps == (8 if c.gemm.block_m * c.gemm.block_e >= 8192 else 4)


@pytest.mark.parametrize("m", (1, 16))
def test_decode_lowers_to_one_launch_that_fills_the_gpu(m):
  """For an abstract H100: one Triton launch (no reduce-and-route kernel
  after it) of 24 E blocks x 7 D splits = 168 programs, >= 132 SMs."""
  bias = jax.ShapeDtypeStruct((E,), jnp.float32)
  text = lower_for_h100(lambda h, w, b: mr.moe_router_topk(h, w, b, 1.5, interpret=False), *shapes(m).values(), bias)
  calls = triton_calls(text)
  assert [(c.name, c.grid) for c in calls] == [("moe_router_one_launch", (24, 1, 7))]
  assert np.prod(calls[0].grid) >= 132


def test_config_rejects_bad_values():
  with pytest.raises(ValueError):
    mr.RouterGemmStage(block_m=48)
  with pytest.raises(ValueError):
    mr.RouterGemmStage(split_d=0)
  with pytest.raises(ValueError):
    mr.RouterEpilogueStage(block_m=12)
  with pytest.raises(ValueError):
    mr.RouterEpilogueStage(block_m=0)
  with pytest.raises(ValueError):
    mr.RouterGemmStage(block_e=8)
  assert mr.RouterEpilogueStage(block_m=1).block_m == 1  # no dot in the epilogue: any power of two
  with pytest.raises(ValueError, match="one launch, one warp count"):
    mr.MoeRouterConfig(mr.RouterGemmStage(num_warps=4), mr.RouterEpilogueStage(num_warps=8), one_launch=True)
  with pytest.raises(ValueError):
    mr.MoeRouterConfig(one_launch=1)


def test_synthesis_scales():
  axes = {"M": 7, "D": D, "E": E, "TOPK": TOPK}
  x = fam.make_inputs(axes, jax.random.key(0), None)
  assert float(x["routed_scaling_factor"]) == 1.5
  # Realistic: RMS-normed hidden (times gains around 1), weight ~ N(0, 1/D),
  # O(1) logits, small bias.
  rms = np.sqrt(np.mean(np.asarray(x["hidden"], np.float32) ** 2, axis=1))
  assert (rms > 0.7).all() and (rms < 1.6).all()
  assert abs(float(jnp.std(x["weight"].astype(jnp.float32))) * np.sqrt(D) - 1) < 0.05
  logits_std = float(jnp.std(jnp.dot(x["hidden"], x["weight"].T, preferred_element_type=jnp.float32)))
  assert 0.5 < logits_std < 2.0
  assert float(jnp.max(jnp.abs(x["bias"]))) < 0.5


def test_cpu_axes():
  for m in RECORDED_M:
    small = fam.cpu_axes({"M": m, "D": D, "E": E, "TOPK": TOPK})
    assert small == {"M": min(m, 64), "D": D, "E": E, "TOPK": TOPK}
  assert fam.cpu_axes({"M": 100, "D": D, "E": E, "TOPK": TOPK})["M"] == 100  # 64 + 36: ragged kept


def test_policies_are_tie_aware_and_paired():
  impl = registry.get(NAME).impl
  inputs = inputs_for(3, seed=2)
  assert impl.policies["expert_weights"] == compare.PairedWith("expert_ids")
  scores = impl.policies["expert_ids"].scores(inputs)
  assert scores.shape == (3, E) and scores.dtype == jnp.float32
  ids, _ = fam.moe_router_reference(**inputs)
  top = np.sort(np.asarray(scores), axis=1)[:, ::-1][:, :TOPK]
  np.testing.assert_allclose(np.sort(np.take_along_axis(np.asarray(scores), np.asarray(ids), 1), axis=1)[:, ::-1], top)
