"""The dataset-driven test kit: every implemented definition, found through
the registry, with axes taken from its own records (nothing copied by hand).

* every candidate config lowers for an abstract H100 at the largest recorded
  axes (shapes only, no data);
* the kernel matches the reference (interpret mode) at `cpu_axes` of one
  record per recorded variant;
* `make_inputs` is deterministic, seed-dependent and matches the definition;
* the implementation matches the definition file (outputs, config seam).

Family test files keep only their family's edge cases.
"""

import functools
import importlib

import jax
import numpy as np
import pytest

from jaxkern import dataset
from jaxkern import plan as plan_lib
from jaxkern import registry
from jaxkern import selection
from jaxkern import tuning
from pallas_kernels.common import assert_lowers_to_triton

IMPLEMENTED = [n for n in registry.names() if registry.get(n).implemented]


@functools.cache
def largest_recorded_axes(name: str) -> dict[str, int]:
  return selection.largest_recorded_axes(registry.get(name).definition)


@functools.cache
def one_record_per_variant(name: str) -> list[dataset.Workload]:
  by_variant: dict = {}
  for w in dataset.load_workloads(name):
    by_variant.setdefault(w.variant, w)
  return list(by_variant.values())


VARIANT_CASES = [(n, i) for n in IMPLEMENTED for i in range(len(one_record_per_variant(n)))]


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_every_candidate_lowers_for_h100_at_largest_recorded_axes(name):
  op = registry.get(name)
  shapes = op.input_shapes(largest_recorded_axes(name))
  configs = op.candidate_configs(shapes)
  assert configs and configs[0] == op.choose_config(shapes), "the heuristic's config comes first"
  for config in configs:
    assert_lowers_to_triton(lambda x, config=config: op.kernel(x, interpret=False, config=config), shapes)


@pytest.mark.parametrize("name,index", VARIANT_CASES)
def test_kernel_matches_reference_at_cpu_axes_per_variant(name, index):
  op = registry.get(name)
  w = one_record_per_variant(name)[index]
  plan = plan_lib.plan(op, w, size="smoke", seed=7, on_gpu=False, tuned=False)
  assert plan.choice.source == tuning.HEURISTIC
  out = jax.jit(lambda x: op.kernel(x, interpret=True, config=plan.choice.config))(plan.inputs)
  ref = jax.jit(op.reference)(plan.inputs)
  cmp = op.compare(out, ref, inputs=plan.inputs)
  assert cmp.passed, (w.uuid, plan.axes_run, {k: o.message for k, o in cmp.outputs.items()})


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_make_inputs_deterministic_and_valid(name):
  op = registry.get(name)
  w = one_record_per_variant(name)[0]
  axes = op.cpu_axes(w.axes)
  assert set(axes) == set(op.definition.axes)
  a = op.make_inputs(axes, seed=3, record=w.record, allow_shrunk_constants=True)
  b = op.make_inputs(axes, seed=3, record=w.record, allow_shrunk_constants=True)
  c = op.make_inputs(axes, seed=4, record=w.record, allow_shrunk_constants=True)
  for k in a:
    np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
  assert any(not np.array_equal(np.asarray(a[k]), np.asarray(c[k])) for k in a if np.size(a[k]) > 1)
  # Without a record too: synthesis works from the axes alone.
  registry.check_tensors(op.definition, op.make_inputs(axes, seed=0, allow_shrunk_constants=True),
                         op.definition.full_axes(axes))


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_implementation_matches_definition_file(name):
  """Reference and kernel name the definition's outputs with its shapes and
  dtypes (checked abstractly); the config round-trips through JSON."""
  op = registry.get(name)
  shapes = op.input_shapes(largest_recorded_axes(name))
  full = op.validated_axes(largest_recorded_axes(name))
  config = op.choose_config(shapes)
  reference = lambda x: op._bound("reference")(**x)  # pylint: disable=protected-access  # noqa: E731
  kernel = lambda x: op._bound("kernel")(**x, config=config, interpret=True)  # pylint: disable=protected-access  # noqa: E731
  for fn in (reference, kernel):
    # One array, or a tuple in the definition's output order.
    outs = jax.eval_shape(fn, shapes)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert len(outs) == len(op.definition.outputs)
    for out, (out_name, spec) in zip(outs, op.definition.outputs.items()):
      assert out.shape == spec.concrete_shape(full), out_name
      assert out.dtype == spec.np_dtype, out_name
  assert tuning.config_from_json(tuning.config_to_json(config), config) == config
  module, _, func = op.definition.reference.partition(":")
  assert getattr(importlib.import_module(module), func) is op.impl.reference
