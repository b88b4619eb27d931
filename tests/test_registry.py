"""The registry and the Op contract, checked for every implemented definition."""

import jax
import numpy as np
import pytest

import jaxkern
from jaxkern import dataset
from jaxkern import registry

NAMES = registry.names()
IMPLEMENTED = [n for n in NAMES if registry.get(n).implemented]


def test_get_unknown_name_lists_close_matches():
  with pytest.raises(KeyError, match="noncausal_dense_attention_h32_d64"):
    registry.get("noncausal_dense_attention_h32_d6")


def test_every_definition_has_an_op():
  assert len(NAMES) == 21
  for n in NAMES:
    op = registry.get(n)
    assert op.definition.name == n and op is registry.get(n)


def test_unimplemented_ops_raise_clearly():
  for n in NAMES:
    op = registry.get(n)
    if op.implemented:
      continue
    for call in (lambda: op.reference({}), lambda: op.kernel({}), lambda: op.make_inputs({})):
      with pytest.raises(NotImplementedError, match=n):
        call()


def test_axes_are_validated_with_clear_errors():
  op = registry.get("dense_gemm_bf16_nt_n4096_k4096")
  assert op.full_axes({"M": 5}) == {"M": 5, "N": 4096, "K": 4096}
  with pytest.raises(dataset.DatasetError, match="axes.N.*expected 4096"):
    op.full_axes({"M": 5, "N": 8})
  with pytest.raises(dataset.DatasetError, match="axes.M.*missing axis"):
    op.full_axes({})
  with pytest.raises(dataset.DatasetError, match="axes.Q"):
    op.full_axes({"M": 1, "Q": 2})


def test_check_tensors_names_field_and_expectation():
  d = registry.get("dense_gemm_bf16_nt_n4096_k4096").definition
  axes = {"M": 2, "N": 4, "K": 8}
  good = {"A": np.zeros((2, 8), jax.numpy.bfloat16), "B": np.zeros((4, 8), jax.numpy.bfloat16)}
  registry.check_tensors(d, good, axes)
  with pytest.raises(dataset.DatasetError, match=r"inputs.B.*\(4, 8\)"):
    registry.check_tensors(d, {**good, "B": np.zeros((4, 7), jax.numpy.bfloat16)}, axes)
  with pytest.raises(dataset.DatasetError, match="inputs.A.*bfloat16"):
    registry.check_tensors(d, {**good, "A": np.zeros((2, 8), np.float32)}, axes)
  with pytest.raises(dataset.DatasetError, match="names differ"):
    registry.check_tensors(d, {"A": good["A"]}, axes)


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_implemented_op_contract(name):
  """make_inputs is deterministic and matches the definition at CPU-budget axes
  derived from a recorded workload; the heuristic's config is a candidate."""
  op = registry.get(name)
  w = dataset.load_workloads(name)[0]
  axes = op.cpu_axes(op.full_axes(w.axes))
  assert set(axes) == set(op.definition.axes)
  a = op.make_inputs(axes, seed=3, record=w.record, scaled=True)
  b = op.make_inputs(axes, seed=3, record=w.record, scaled=True)
  c = op.make_inputs(axes, seed=4, record=w.record, scaled=True)
  for k in a:
    np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
  assert any(not np.array_equal(np.asarray(a[k]), np.asarray(c[k])) for k in a if np.size(a[k]) > 1)
  assert op.choose_config(a) in op.candidate_configs(a)
  ref = op.reference(a)
  assert set(ref) == set(op.definition.outputs)
  registry.check_tensors(op.definition, ref, op.definition.full_axes(axes), kind="outputs")


def test_ops_module_exposes_implemented_families():
  ops = jaxkern.ops
  assert callable(ops.dense_gemm) and callable(ops.attention)
