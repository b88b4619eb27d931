"""MoE router GEMM + top-k: the kit's data (launches; edge cases for both
kernel forms: uneven splits, ragged D, small E; lowering of those) and the
family's own checks: exact ties, biased selection, the runtime scale, the
reference vs float64 numpy, the heuristic, synthesis scales, the policies.
(The checks themselves: test_definitions.py and kit.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import compare
from jaxkern import registry
from jaxkern.families import moe_router as fam
from kit import Case, TritonCall
from pallas_kernels import moe_router as mr

NAME = "moe_router_gemm_topk_deepseek41_d5120_e384_topk6"
D, E, TOPK = 5120, 384, 6
RECORDED_M = (1, 2, 3, 128, 448, 1984, 2432, 2944, 3456, 4032, 4096)

FUSED = mr.MoeRouterConfig(mr.RouterGemmStage(block_m=16, block_d=64, split_d=1, num_warps=4, num_stages=2))
# 7 requested splits of 80 D-blocks: 12 blocks each, a short last split.
ODD_SPLIT = mr.MoeRouterConfig(mr.RouterGemmStage(block_m=32, block_d=64, split_d=7, num_warps=4, num_stages=2),
                               mr.RouterEpilogueStage(block_m=16, num_warps=8))


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
  return mr.moe_router_topk(inputs["hidden"], inputs["weight"], inputs["bias"],
                            inputs["routed_scaling_factor"], top_k=top_k, config=config, interpret=True)


def launches(config, axes):
  """The kernel fits the config to the problem (blocks to the next power of
  two of M and D, at least 16; `split_d` to the splits its blocks make):
  one fused kernel over M blocks, or partial logits over (M blocks, splits)
  then a reduce-and-route kernel over epilogue row blocks (one stage)."""
  m, d = axes["M"], axes["D"]
  fit = lambda block, n: max(16, min(block, 1 << max(n - 1, 0).bit_length()))  # noqa: E731
  gemm = config.gemm
  block_m, block_d = fit(gemm.block_m, m), fit(gemm.block_d, d)
  blocks = -(-d // block_d)
  splits = -(-blocks // -(-blocks // gemm.split_d))
  m_blocks = -(-m // block_m)
  if splits == 1:
    return [TritonCall("moe_router_fused", (m_blocks, 1, 1), gemm.num_warps, gemm.num_stages)]
  epilogue_m = min(config.epilogue.block_m, 1 << max(m - 1, 0).bit_length())
  return [TritonCall("moe_router_partial_logits", (m_blocks, splits, 1), gemm.num_warps, gemm.num_stages),
          TritonCall("moe_router_reduce_route", (-(-m // epilogue_m), 1, 1), config.epilogue.num_warps, 1)]


def weights_sum_to_the_scale(out, ref, inputs):
  np.testing.assert_allclose(np.asarray(out["expert_weights"]).sum(1), 1.5, rtol=1e-5)


KERNEL_CASES = [Case(NAME, {"M": m}, config=config, check=weights_sum_to_the_scale, id=label)
                for m, config, label in [
                    (1, None, "decode_16_splits_one_row_route"),
                    (5, None, "five_rows_in_an_8_row_epilogue"),
                    (3, FUSED, "decode_fused"),
                    (33, None, "ragged_m"),
                    (33, FUSED, "fused_three_blocks_ragged"),
                    (40, ODD_SPLIT, "uneven_d_splits")]]
# D not a multiple of block_d, E and top_k not powers of two.
SMALL_E = {"M": 19, "D": 200, "E": 40, "TOPK": 3}
KERNEL_CASES += [Case(NAME, SMALL_E, config=c, id=f"ragged_d_small_e_{i}") for i, c in enumerate((None, FUSED))]
LOWERING_CASES = [Case(NAME, SMALL_E, config=c, id=f"ragged_d_small_e_{i}")
                  for i, c in enumerate((None, FUSED, ODD_SPLIT))]
SWEEP_CASE = Case(NAME, {"M": 5, "D": 128, "E": 16})  # fused and split forms, 5 distinct tilings


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
  return {"hidden": jnp.asarray(hidden, jnp.bfloat16), "weight": jnp.asarray(weight, jnp.bfloat16),
          "bias": jnp.zeros((e,), jnp.float32), "routed_scaling_factor": jnp.float32(1.5)}


@pytest.mark.parametrize("config", [None, FUSED])
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


@pytest.mark.parametrize("m", RECORDED_M + (7, 33))
def test_heuristic_choice_comes_first_and_every_stage_is_swept(m):
  candidates = mr.candidate_configs(shapes(m))
  assert candidates[0] == mr.choose_config(shapes(m))
  split = [c for c in candidates if c.gemm.split_d > 1]
  assert any(c.gemm.split_d == 1 for c in candidates) and split
  assert len({c.epilogue for c in split}) > 1  # the epilogue stage's fields are swept too


def test_heuristic_caps_splits_and_stays_two_stage():
  """Decode: 16 splits of 5 column blocks (not 80 of one), a one-row
  epilogue; every M uses the two-stage form on 8-warp GEMM tiles (the fused
  kernel and 4-warp tiles spill on sm_90a)."""
  config = mr.choose_config(shapes(1))
  assert config.gemm == mr.RouterGemmStage(block_m=16, block_d=64, split_d=16, num_warps=8, num_stages=2)
  assert config.epilogue == mr.RouterEpilogueStage(block_m=1, num_warps=8)
  assert mr._splits_per_load(1, 8, 16) == 16  # all partials of the row in one load
  for m in RECORDED_M + (8192, 100_000):
    c = mr.choose_config(shapes(m))
    assert 2 <= c.gemm.split_d <= 16 and c.gemm.num_warps == 8, (m, c)
  assert mr.choose_config(shapes(4096)).epilogue == mr.RouterEpilogueStage(8, 4)
  assert mr.choose_config(shapes(8192)).gemm.split_d == 2
  for m in (1, 3, 4096):
    for c in mr.candidate_configs(shapes(m)):
      assert c.gemm.num_warps == 8 and c.gemm.split_d <= 16
      assert c.gemm.split_d > 1 or c.gemm.block_m == 16


def test_config_rejects_bad_values():
  with pytest.raises(ValueError):
    mr.RouterGemmStage(block_m=48)
  with pytest.raises(ValueError):
    mr.RouterGemmStage(split_d=0)
  with pytest.raises(ValueError):
    mr.RouterEpilogueStage(block_m=12)
  with pytest.raises(ValueError):
    mr.RouterEpilogueStage(block_m=0)
  assert mr.RouterEpilogueStage(block_m=1).block_m == 1  # no dot in the epilogue: any power of two


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
  np.testing.assert_allclose(np.sort(np.take_along_axis(np.asarray(scores), np.asarray(ids), 1), axis=1)[:, ::-1],
                             top)
