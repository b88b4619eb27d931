"""The dataset-driven test kit (`kit.py`): every implemented definition, found
through the registry, with axes taken from its own records, plus the data its
family's test file adds (`tests/test_<family>.py`, see `kit.py`):

* lowering for an abstract H100, every candidate of each kernel backend at
  the largest recorded axes and each family `LOWERING_CASES` entry: the
  launches (Triton calls: count, names, grids, num_warps, num_stages) are
  those the family's `launches` hook for that backend says the config
  implies;
* the kernel matches the reference (interpret mode) at `cpu_axes` of one
  record per recorded variant, on every family `KERNEL_CASES` edge case, and
  with every distinct candidate config at small axes (`SWEEP_CASE`);
* `make_inputs` is deterministic, seed-dependent and matches the definition;
* the implementation matches the definition file (outputs, config seam),
  and every family has its test file and hooks.
"""

import dataclasses
import functools
import importlib
import inspect
import pathlib

import jax
import kit
import numpy as np
import pytest

from jaxkern import dataset, registry, selection, tuning
from jaxkern import plan as plan_lib

IMPLEMENTED = [n for n in registry.names() if registry.get(n).implemented]
FAMILIES = sorted({kit.family_of(n) for n in IMPLEMENTED})
# Every implemented definition with each of its kernel backends.
BACKENDS = [(n, b) for n in IMPLEMENTED for b in registry.get(n).backends]
FAMILY_BACKENDS = sorted({(kit.family_of(n), b) for n, b in BACKENDS})
TESTS = pathlib.Path(__file__).resolve().parent


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
KERNEL_CASES = kit.cases("KERNEL_CASES", IMPLEMENTED)
LOWERING_CASES = kit.cases("LOWERING_CASES", IMPLEMENTED)


def sweep_case(family: str, backend: str) -> kit.Case:
  """The family's `SWEEP_CASE_<BACKEND>` (e.g. `SWEEP_CASE_MOSAIC_GPU`),
  else its `SWEEP_CASE`, else its first definition's first record at CPU
  axes."""
  tests = kit.family_tests(family)
  case = getattr(tests, f"SWEEP_CASE_{backend.upper()}", None) or getattr(tests, "SWEEP_CASE", None)
  if case is not None:
    return case
  name = next(n for n in IMPLEMENTED if kit.family_of(n) == family)
  w = one_record_per_variant(name)[0]
  return kit.Case(name, registry.get(name).cpu_axes(w.axes), record=w.record)


def test_every_family_has_its_test_file_and_launches_hooks():
  for family, backend in FAMILY_BACKENDS:
    assert (TESTS / f"test_{family}.py").exists(), family
    hook = kit.launches_hook(backend)
    assert callable(getattr(kit.family_tests(family), hook, None)), f"test_{family}.{hook}"


# ---------------------------------------------------------------------------
# Lowering for an abstract H100.


# H100 lowering on the GPU machine's jax (the lane); the main environment's jax
# lowers and compiles the heuristic configs in tests/test_aot.py.
@pytest.mark.lane_only
@pytest.mark.device_stack
@pytest.mark.parametrize("name,backend", BACKENDS)
def test_every_candidate_lowers_to_its_launches_at_largest_recorded_axes(name, backend):
  op = registry.get(name)
  axes = largest_recorded_axes(name)
  shapes = op.input_shapes(axes)
  configs = op.candidate_configs(shapes, backend=backend)
  assert configs and configs[0] == op.choose_config(shapes, backend=backend), "the heuristic's config comes first"
  assert len(configs) == len(set(configs)), "no candidate twice"
  for config in configs:
    kit.check_lowering(op, axes, config, backend=backend)


@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: f"{c.definition}-{c.label}")
def test_family_lowering_cases(case):
  op = registry.get(case.definition)
  for config in kit.configs_of(op, case, kit.shapes_at(op, case.axes, case.omit)):
    kit.check_lowering(op, case.axes, config, case.omit, case.backend)


# ---------------------------------------------------------------------------
# Kernel against reference, interpret mode.


@pytest.mark.parametrize("name,index", VARIANT_CASES)
def test_kernel_matches_reference_at_cpu_axes_per_variant(name, index):
  op = registry.get(name)
  w = one_record_per_variant(name)[index]
  plan = plan_lib.plan(op, w, size="smoke", seed=7, on_gpu=False, tuned=False)
  assert plan.choice.source == tuning.HEURISTIC
  out = jax.jit(lambda x: op.kernel(x, interpret=True, config=plan.choice.config, backend=plan.choice.backend))(
    plan.inputs
  )
  ref = jax.jit(op.reference)(plan.inputs)
  kit.assert_matches(op, out, ref, plan.inputs, (w.uuid, plan.axes_run))


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c.definition}-{c.label}")
def test_family_kernel_cases(case):
  kit.check_kernel_case(case)


@pytest.mark.parametrize("family,backend", FAMILY_BACKENDS)
def test_every_candidate_config_runs_in_interpret_mode(family, backend):
  case = sweep_case(family, backend)
  assert kit.check_every_candidate_runs(dataclasses.replace(case, backend=case.backend or backend)) >= 1


# ---------------------------------------------------------------------------
# Synthesis and the definition file.


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
  registry.check_tensors(
    op.definition, op.make_inputs(axes, seed=0, allow_shrunk_constants=True), op.definition.full_axes(axes)
  )


@pytest.mark.parametrize("name,backend", BACKENDS)
def test_implementation_matches_definition_file(name, backend):
  """Reference and each backend's kernel name the definition's outputs with
  its shapes and dtypes (checked abstractly); the config round-trips
  through JSON; the family has a cost formula."""
  op = registry.get(name)
  shapes = op.input_shapes(largest_recorded_axes(name))
  full = op.validated_axes(largest_recorded_axes(name))
  config = op.choose_config(shapes, backend=backend)
  reference = kit.bound(op, "reference", full)
  kernel = kit.bound(op, "launch", full, backend)
  for fn in (lambda x: reference(**x), lambda x: kernel(**x, config=config, interpret=True)):
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
  assert op.impl.cost is not None
  # The contract's parameters: the reference takes the inputs positionally in
  # the definition's order; the kernel takes every input by name.
  names = list(op.definition.inputs)
  positional = [
    p.name for p in inspect.signature(op.impl.reference).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD
  ]
  assert positional[: len(names)] == names
  assert set(names) <= set(inspect.signature(op.kernel_of(backend).launch).parameters)
