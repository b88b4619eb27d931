"""MoE router GEMM + top-k: Pallas kernel (interpret mode) vs reference, the
reference vs float64 numpy, exact ties, biased selection, deviceless H100
lowering, input synthesis."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern.families import moe_router as fam
from pallas_kernels import moe_router as mr
from pallas_kernels.common import assert_lowers_to_triton

# The Triton-lowering DeprecationWarning is expected (SPEC 2); pytest resets
# the process-wide filter per test.

D, E, TOPK = 5120, 384, 6
RECORDED_M = (1, 2, 3, 128, 448, 1984, 2432, 2944, 3456, 4032, 4096)
LARGEST_M = max(RECORDED_M)
DATASETS = pathlib.Path(__file__).resolve().parent.parent / "datasets"

FUSED = mr.MoeRouterConfig(block_m=16, block_d=64, split_d=1, num_warps=4, num_stages=2)
# 7 requested splits of 80 D-blocks: 12 blocks each, a short last split.
ODD_SPLIT = mr.MoeRouterConfig(block_m=32, block_d=64, split_d=7, num_warps=4, num_stages=2)


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


def run_kernel(inputs, config=None, top_k=TOPK):
  return mr.moe_router_topk(inputs["hidden"], inputs["weight"], inputs["bias"],
                            inputs["routed_scaling_factor"], top_k=top_k, config=config, interpret=True)


@pytest.mark.parametrize("m,config", [
    (1, None),          # decode: split-D over 80 programs + routing kernel
    (3, FUSED),         # decode rows through the single fused kernel
    (33, None),         # ragged M, 64-row block
    (33, FUSED),        # three 16-row blocks, the last ragged
    (40, ODD_SPLIT),    # uneven D splits, ragged second block
])
def test_kernel_matches_reference(m, config):
  inputs = inputs_for(m, seed=m)
  ref = fam.moe_router_reference(**inputs)
  ids, weights = run_kernel(inputs, config)
  differing = assert_routes_match(ids, weights, inputs, ref)
  assert differing <= 1  # random inputs: near-ties are rare
  np.testing.assert_allclose(np.asarray(weights).sum(1), 1.5, rtol=1e-5)


@pytest.mark.parametrize("config", [None, FUSED])
def test_generic_shapes_ragged_d_and_small_e(config):
  # D not a multiple of block_d, E and top_k not powers of two.
  inputs = inputs_for(19, d=200, e=40, seed=7)
  ref_ids, ref_w = mr.moe_router_topk_reference(inputs["hidden"], inputs["weight"], inputs["bias"], 1.5, top_k=3)
  ids, weights = run_kernel(inputs, config, top_k=3)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_w), rtol=1e-4, atol=2e-5)


def test_kernel_at_cpu_axes_through_family_adapter():
  axes = fam.cpu_axes({"M": 4096, "D": D, "E": E, "TOPK": TOPK})
  inputs = fam.make_inputs(axes, jax.random.key(11), None)
  out = fam.kernel(**inputs, interpret=True, config=None)
  assert_routes_match(out["expert_ids"], out["expert_weights"], inputs, fam.moe_router_reference(**inputs))


def test_reference_matches_float64():
  m, d, e = 5, 32, 20
  inputs = inputs_for(m, d=d, e=e, seed=3)
  ref = fam.moe_router_reference(**inputs)
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
  ref = fam.moe_router_reference(**inputs)
  np.testing.assert_array_equal(np.asarray(ref["expert_ids"]), expected)
  ids, weights = run_kernel(inputs, config)
  np.testing.assert_array_equal(np.asarray(ids), expected)
  np.testing.assert_allclose(np.asarray(weights), np.asarray(ref["expert_weights"]), rtol=1e-5)


def test_large_negative_bias_excludes_experts_but_not_from_weights():
  inputs = inputs_for(4, seed=5)
  unbiased = fam.moe_router_reference(**inputs)["expert_ids"]
  banned = np.unique(np.asarray(unbiased)[:, :3])  # some experts each row would pick
  bias = inputs["bias"].at[banned].set(-1e4)
  bias = bias.at[0].set(-1e30)
  inputs = {**inputs, "bias": bias}
  ref = fam.moe_router_reference(**inputs)
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
  assert_routes_match(ids, weights, inputs, fam.moe_router_reference(**inputs))


def test_routed_scaling_factor_is_a_runtime_value():
  inputs = inputs_for(2, seed=6)
  f = jax.jit(lambda scale: run_kernel({**inputs, "routed_scaling_factor": scale})[1])
  np.testing.assert_allclose(np.asarray(f(jnp.float32(3.0))), 2 * np.asarray(f(jnp.float32(1.5))), rtol=1e-6)


def _lower(m, config, d=D, e=E):
  avals = (jax.ShapeDtypeStruct((m, d), jnp.bfloat16), jax.ShapeDtypeStruct((e, d), jnp.bfloat16),
           jax.ShapeDtypeStruct((e,), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))
  assert_lowers_to_triton(mr.moe_router_topk, *avals, config=config, interpret=False)


@pytest.mark.parametrize("m", [LARGEST_M, 1])
def test_lowers_for_h100_every_candidate(m):
  candidates = mr.candidate_configs(m, D, E)
  assert any(c.split_d == 1 for c in candidates) and any(c.split_d > 1 for c in candidates)
  for config in candidates:
    _lower(m, config)


def test_lowers_for_h100_recorded_sizes_and_ragged_d():
  for m in RECORDED_M:
    _lower(m, None)
  _lower(19, None, d=200, e=40)
  _lower(19, FUSED, d=200, e=40)


@pytest.mark.parametrize("m", RECORDED_M + (7, 33))
def test_heuristic_choice_is_a_candidate(m):
  assert mr.choose_config(m, D, E) in mr.candidate_configs(m, D, E)


def test_heuristic_fills_the_gpu_for_decode():
  config = mr.choose_config(1, D, E)
  assert config.block_m == 16 and config.split_d >= 64
  assert mr.choose_config(8192, D, E).split_d == 1  # enough token blocks: fused


def test_config_rejects_bad_values():
  with pytest.raises(ValueError):
    mr.MoeRouterConfig(block_m=48)
  with pytest.raises(ValueError):
    mr.MoeRouterConfig(split_d=0)


def _record():
  path = DATASETS / "workloads" / f"{fam.DEFINITION}.jsonl"
  for line in path.read_text(encoding="utf-8").splitlines():
    rec = json.loads(line)
    if rec["axes"]["M"] > 64:
      return rec
  raise AssertionError("no prefill record")


def test_make_inputs_deterministic_and_valid():
  axes = {"M": 7, "D": D, "E": E, "TOPK": TOPK}
  x = fam.make_inputs(axes, jax.random.key(0), None)
  y = fam.make_inputs(axes, jax.random.key(0), None)
  z = fam.make_inputs(axes, jax.random.key(1), None)
  assert set(x) == {"hidden", "weight", "bias", "routed_scaling_factor"}
  assert x["hidden"].shape == (7, D) and x["hidden"].dtype == jnp.bfloat16
  assert x["weight"].shape == (E, D) and x["weight"].dtype == jnp.bfloat16
  assert x["bias"].shape == (E,) and x["bias"].dtype == jnp.float32
  assert x["routed_scaling_factor"].shape == () and x["routed_scaling_factor"].dtype == jnp.float32
  assert float(x["routed_scaling_factor"]) == 1.5
  for key in x:
    np.testing.assert_array_equal(np.asarray(x[key], np.float32), np.asarray(y[key], np.float32))
    if key != "routed_scaling_factor":
      assert not np.array_equal(np.asarray(x[key], np.float32), np.asarray(z[key], np.float32))
  # Realistic: RMS-normed hidden (times gains around 1), weight ~ N(0, 1/D),
  # O(1) logits, small bias.
  rms = np.sqrt(np.mean(np.asarray(x["hidden"], np.float32) ** 2, axis=1))
  assert (rms > 0.7).all() and (rms < 1.6).all()
  assert abs(float(jnp.std(x["weight"].astype(jnp.float32))) * np.sqrt(D) - 1) < 0.05
  logits_std = float(jnp.std(jnp.dot(x["hidden"], x["weight"].T, preferred_element_type=jnp.float32)))
  assert 0.5 < logits_std < 2.0
  assert float(jnp.max(jnp.abs(x["bias"]))) < 0.5
  # A record (whose axes are larger than the run's) does not change the sizes.
  record = _record()
  w = fam.make_inputs(axes, jax.random.key(0), record)
  for key in x:
    np.testing.assert_array_equal(np.asarray(w[key], np.float32), np.asarray(x[key], np.float32))
  full = jax.eval_shape(lambda k: fam.make_inputs({**axes, "M": LARGEST_M}, k, record), jax.random.key(0))
  assert full["hidden"].shape == (LARGEST_M, D)


def test_cpu_axes():
  for m in RECORDED_M:
    small = fam.cpu_axes({"M": m, "D": D, "E": E, "TOPK": TOPK})
    assert small == {"M": min(m, 64), "D": D, "E": E, "TOPK": TOPK}
  assert fam.cpu_axes({"M": 100, "D": D, "E": E, "TOPK": TOPK})["M"] == 100  # 64 + 36: ragged kept


def test_topk_scores_and_pairing():
  impl = fam.IMPLS[fam.DEFINITION]
  inputs = inputs_for(3, seed=2)
  scores = impl.topk_scores["expert_ids"](inputs)
  assert scores.shape == (3, E) and scores.dtype == jnp.float32
  assert impl.paired_outputs == {"expert_weights": "expert_ids"}
  ref = impl.reference(**inputs)
  top = np.sort(np.asarray(scores), axis=1)[:, ::-1][:, :TOPK]
  np.testing.assert_allclose(np.sort(np.take_along_axis(np.asarray(scores), np.asarray(ref["expert_ids"]), 1),
                                     axis=1)[:, ::-1], top)


def test_public_moe_router_batched_under_jit():
  inputs = inputs_for(6, seed=8)
  f = jax.jit(lambda h, w, b: fam.moe_router(h, w, b))  # default scale 1.5
  ids, weights = f(inputs["hidden"].reshape(2, 3, D), inputs["weight"], inputs["bias"])
  assert ids.shape == weights.shape == (2, 3, TOPK)
  ref = fam.moe_router_reference(**inputs)
  assert_routes_match(ids.reshape(6, TOPK), weights.reshape(6, TOPK), inputs, ref)


def test_definition_file_names_the_reference():
  spec = json.loads((DATASETS / "definitions" / f"{fam.DEFINITION}.json").read_text(encoding="utf-8"))
  assert spec["reference"] == "jaxkern.families.moe_router:moe_router_reference"
  assert fam.IMPLS[fam.DEFINITION].reference is fam.moe_router_reference
  assert {k: v.get("value") for k, v in spec["axes"].items() if v["type"] == "const"} == {"D": D, "E": E, "TOPK": TOPK}
