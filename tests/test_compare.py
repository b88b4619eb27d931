"""The comparison policy (SPEC section 5) on crafted cases: each rule, each failure."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import compare
from jaxkern.dataset import TensorSpec


def spec(name, dtype, shape=("R", "C")):
  return {name: TensorSpec(name=name, shape=shape, dtype=dtype)}


def run(specs, out, ref, **kw):
  return compare.compare(specs, out, ref, **kw)


def test_bf16_fib_rule_needs_both_bounds_exceeded():
  y = jnp.array([[1.0, 100.0, 0.0, -2.0]], jnp.bfloat16)
  # 100 -> 101: |d|=1 > atol but < rtol*100 = 1.6: passes. 0 -> 0.004: < atol: passes.
  x = jnp.array([[1.0, 101.0, 0.004, -2.0]], jnp.bfloat16)
  r = run(spec("o", "bfloat16"), {"o": x}, {"o": y})
  assert r.passed and r.outputs["o"].matched_ratio == 1.0
  assert r.outputs["o"].max_abs_error == pytest.approx(1.0)
  # 1 -> 1.03: |d|=0.03 > atol and > 0.016: fails.
  x2 = x.at[0, 0].set(1.03125)
  r2 = run(spec("o", "bfloat16"), {"o": x2}, {"o": y})
  assert r2.status == "incorrect_numerical" and r2.outputs["o"].matched_ratio == 0.75
  assert r2.outputs["o"].max_rel_error == pytest.approx(0.03125)


def test_f32_tolerance_is_tighter():
  y = jnp.ones((2, 2), jnp.float32)
  ok = run(spec("o", "float32"), {"o": y + 5e-5}, {"o": y})  # rtol 1e-4 * 1 = 1e-4 covers it
  bad = run(spec("o", "float32"), {"o": y + 5e-4}, {"o": y})
  assert ok.passed and not bad.passed


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_where_reference_is_finite_fails(bad):
  y = jnp.zeros((1, 4), jnp.float32)
  r = run(spec("o", "float32"), {"o": y.at[0, 1].set(bad)}, {"o": y})
  assert r.status == "incorrect_numerical" and r.outputs["o"].max_abs_error == float("inf")
  assert r.outputs["o"].matched_ratio == 0.75


def test_nonfinite_reference_matches_only_the_same_value():
  # Lonely attention rows report lse = +inf.
  y = jnp.array([[1.0, jnp.inf]], jnp.float32)
  assert run(spec("lse", "float32"), {"lse": y}, {"lse": y}).passed
  assert not run(spec("lse", "float32"), {"lse": y.at[0, 1].set(3.0)}, {"lse": y}).passed
  assert not run(spec("lse", "float32"), {"lse": y.at[0, 1].set(-jnp.inf)}, {"lse": y}).passed


def test_shape_and_dtype_mismatch_fail_outright():
  y = jnp.zeros((2, 3), jnp.bfloat16)
  assert run(spec("o", "bfloat16"), {"o": jnp.zeros((3, 2), jnp.bfloat16)}, {"o": y}).status == "incorrect_shape"
  assert run(spec("o", "bfloat16"), {"o": jnp.zeros((2, 3), jnp.float32)}, {"o": y}).status == "incorrect_dtype"
  assert run(spec("o", "bfloat16"), {}, {"o": y}).status == "incorrect_shape"


def test_integer_outputs_are_exact():
  y = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
  assert run(spec("i", "int32"), {"i": y}, {"i": y}).passed
  r = run(spec("i", "int32"), {"i": y.at[1, 2].add(1)}, {"i": y})
  assert r.status == "incorrect_numerical" and r.outputs["i"].matched_ratio == pytest.approx(5 / 6)


def test_empty_outputs_pass():
  y = jnp.zeros((0, 4), jnp.bfloat16)
  assert run(spec("o", "bfloat16"), {"o": y}, {"o": y}).passed


# Top-k: scores over 6 candidates; ids 1 and 4 tie.
SCORES = np.array([[0.1, 0.9, 0.5, 0.2, 0.9, 0.3]], np.float32)
TOPK_SPECS = {**spec("ids", "int32"), **spec("w", "float32")}


def topk(out_ids, ref_ids, out_w=None, ref_w=None, with_inputs=True):
  out = {"ids": jnp.array([out_ids], jnp.int32)}
  ref = {"ids": jnp.array([ref_ids], jnp.int32)}
  if out_w is not None:
    out["w"], ref["w"] = jnp.array([out_w], jnp.float32), jnp.array([ref_w], jnp.float32)
    specs = TOPK_SPECS
  else:
    specs = spec("ids", "int32")
  return run(
    specs,
    out,
    ref,
    inputs={"s": SCORES} if with_inputs else None,
    policies={"ids": compare.TopK(scores=lambda inputs: inputs["s"]), "w": compare.PairedWith("ids")},
  )


def test_topk_tie_is_accepted_and_reported():
  r = topk([2, 4], [1, 2])  # 1 and 4 both score 0.9
  assert r.passed and r.tie_accepted_rows == 1 and r.outputs["ids"].tie_accepted_rows == 1


def test_topk_without_inputs_is_exact():
  assert topk([2, 4], [1, 2], with_inputs=False).status == "incorrect_numerical"


@pytest.mark.parametrize(
  "ids,why",
  [
    ([2, 3], "a lower score"),
    ([4, 4], "duplicate ids"),
    ([4, 7], "id out of range"),
    ([4, -1], "different -1 padding"),
    ([4, -2], "invalid negative id"),
  ],
)
def test_topk_rejections(ids, why):
  assert topk(ids, [1, 2]).status == "incorrect_numerical", why


def test_topk_same_padding_accepted():
  assert topk([4, -1], [1, -1]).passed


def test_topk_same_set_wrong_order_fails():
  assert not topk([2, 1], [1, 2]).passed


def test_paired_weights_compared_on_common_ids():
  # Tie row: kernel picked 4 instead of 1; the weight of id 2 must still match.
  assert topk([2, 4], [1, 2], out_w=[0.4, 0.6], ref_w=[0.6, 0.4]).passed
  r = topk([2, 4], [1, 2], out_w=[0.5, 0.6], ref_w=[0.6, 0.4])
  assert r.outputs["w"].status == "incorrect_numerical"
  # Exact rows compare positionally.
  assert not topk([1, 2], [1, 2], out_w=[0.4, 0.6], ref_w=[0.6, 0.4]).passed
  assert topk([1, 2], [1, 2], out_w=[0.6, 0.4], ref_w=[0.6, 0.4]).passed


def test_gdn_state_metric():
  rng = np.random.default_rng(0)
  y = rng.standard_normal((2, 8, 16, 16)).astype(np.float32)
  specs = spec("new_state", "float32", ("N", "H", "K", "V"))
  pol = {"new_state": compare.StateMetric()}
  small = y * (1 + 0.004 * rng.standard_normal(y.shape).astype(np.float32))
  assert run(specs, {"new_state": jnp.asarray(small)}, {"new_state": jnp.asarray(y)}, policies=pol).passed
  # Elementwise rtol would fail this, the state metric does not.
  assert not run(specs, {"new_state": jnp.asarray(small)}, {"new_state": jnp.asarray(y)}).passed
  # One bad head fails the per-(sequence, head) bound.
  bad = y.copy()
  bad[1, 3] *= 1.05
  r = run(specs, {"new_state": jnp.asarray(bad)}, {"new_state": jnp.asarray(y)}, policies=pol)
  assert r.status == "incorrect_numerical" and "max_head_relative_rms" in r.outputs["new_state"].message
  # A zero state (an empty sequence) must stay zero.
  z = np.zeros_like(y)
  assert run(specs, {"new_state": jnp.asarray(z)}, {"new_state": jnp.asarray(z)}, policies=pol).passed
  z2 = z.copy()
  z2[0, 0, 0, 0] = 1e-3
  assert not run(specs, {"new_state": jnp.asarray(z2)}, {"new_state": jnp.asarray(z)}, policies=pol).passed


def test_bound_ratio_is_at_most_one_exactly_when_passed():
  """max_bound_ratio = worst |x-y| / max(atol, rtol*|y|): <= 1 on every
  passing output (whatever its max abs error / atol), > 1 on every failing
  one; a non-finite mismatch is inf; equal non-finite values count 0."""
  rng = np.random.default_rng(1)
  outcomes = set()
  for trial in range(40):
    y = (rng.standard_normal((8, 16)) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
    scale = 10.0 ** rng.uniform(-5, -3)
    x = (y + scale * rng.standard_normal(y.shape) * (np.abs(y) + 1e-3)).astype(np.float32)
    o = run(spec("o", "float32"), {"o": jnp.asarray(x)}, {"o": jnp.asarray(y)}).outputs["o"]
    assert o.max_bound_ratio is not None and (o.status == "passed") == (o.max_bound_ratio <= 1.0), (trial, o)
    outcomes.add(o.status)
  assert outcomes == {"passed", "incorrect_numerical"}
  # bf16's tolerances: passing although max abs error / atol is 10, as rtol*|y| allows more.
  y = jnp.array([2.0, -4.0, 0.001], jnp.float32)
  o = compare.compare_float("o", y + jnp.array([0.025, -0.05, 0.004]), y, atol=0.005, rtol=0.016)
  assert o.status == "passed" and o.max_abs_error / 0.005 == pytest.approx(10.0, rel=1e-4)
  assert o.max_bound_ratio == pytest.approx(0.8, rel=1e-4)  # 0.004 / atol; 0.05 / (0.016 * 4) = 0.78
  failing = compare.compare_float("o", y.at[1].set(jnp.nan), y, atol=0.005, rtol=0.016)
  assert failing.status == "incorrect_numerical" and failing.max_bound_ratio == float("inf")
  beyond = compare.compare_float("o", y.at[0].add(0.04), y, atol=0.005, rtol=0.016)  # 0.04 / 0.032
  assert beyond.status == "incorrect_numerical" and beyond.max_bound_ratio == pytest.approx(1.25, rel=1e-4)
  lse = jnp.array([[1.0, jnp.inf]], jnp.float32)
  assert run(spec("lse", "float32"), {"lse": lse}, {"lse": lse}).outputs["lse"].max_bound_ratio == 0.0
  assert compare.compare_float("o", y[:0], y[:0], atol=0.005, rtol=0.016).max_bound_ratio == 0.0
  # Integer outputs have none (and the results line leaves it out).
  ints = run(spec("i", "int32"), {"i": jnp.zeros((1, 2), jnp.int32)}, {"i": jnp.zeros((1, 2), jnp.int32)})
  assert ints.outputs["i"].max_bound_ratio is None and "max_bound_ratio" not in ints.to_json()["i"]


def test_bound_ratio_of_paired_and_state_outputs():
  """Paired weights: over the ids both selected; the state metric: its worst
  metric / threshold. Both <= 1 exactly when passed."""
  ok = topk([2, 4], [1, 2], out_w=[0.4, 0.6], ref_w=[0.6, 0.4]).outputs["w"]
  bad = topk([2, 4], [1, 2], out_w=[0.5, 0.6], ref_w=[0.6, 0.4]).outputs["w"]
  assert ok.max_bound_ratio == 0.0 and bad.max_bound_ratio == pytest.approx(0.1 / (1e-4 * 0.4), rel=1e-3)
  rng = np.random.default_rng(0)
  y = rng.standard_normal((2, 8, 16, 16)).astype(np.float32)
  specs, pol = spec("new_state", "float32", ("N", "H", "K", "V")), {"new_state": compare.StateMetric()}
  for noise in (0.002, 0.004, 0.02):
    x = y * (1 + noise * rng.standard_normal(y.shape).astype(np.float32))
    o = run(specs, {"new_state": jnp.asarray(x)}, {"new_state": jnp.asarray(y)}, policies=pol).outputs["new_state"]
    assert o.max_bound_ratio is not None and (o.status == "passed") == (o.max_bound_ratio <= 1.0), (noise, o)


def test_first_failing_output_sets_status_and_json():
  specs = {**spec("a", "bfloat16"), **spec("b", "int32")}
  y = {"a": jnp.zeros((1, 2), jnp.bfloat16), "b": jnp.zeros((1, 2), jnp.int32)}
  r = run(specs, {"a": y["a"], "b": jnp.ones((1, 2), jnp.int32)}, y)
  assert r.status == "incorrect_numerical" and r.outputs["a"].status == "passed"
  js = r.to_json()
  assert js["b"]["status"] == "incorrect_numerical" and js["b"]["matched_ratio"] == 0.0


def test_a_new_policy_needs_no_change_to_compare():
  """A family-defined policy (here: every element within 1.0) plugs in."""

  class Loose(compare.Policy):
    def compare(self, name, x, y, spec, ctx):
      ok = bool(jnp.all(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)) <= 1.0))
      return compare.OutputComparison(name, compare.PASSED if ok else compare.INCORRECT_NUMERICAL)

  specs = {"o": TensorSpec(name="o", shape=("N",), dtype="float32")}
  x, y = {"o": jnp.asarray([1.0, 2.5])}, {"o": jnp.asarray([1.0, 2.0])}
  assert not run(specs, x, y).passed
  assert run(specs, x, y, policies={"o": Loose()}).passed


def test_status_is_one_enum_that_serializes_as_its_value():
  import json

  assert compare.Status("passed") is compare.PASSED
  assert json.dumps({"s": compare.Status.TIMEOUT}) == '{"s": "timeout"}'
  assert compare.Status.TIMEOUT.failed and not compare.Status.SKIPPED.failed and not compare.PASSED.failed
