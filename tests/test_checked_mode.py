"""Checked mode: `jaxkern.ops.<op>(..., checks=True)` asserts the
family's preconditions (`OpImpl.preconditions`) with checkify. Every bad
index or length input of the fuzz cases (`fuzz_inputs.py`) raises an error
naming the op, the argument, an offending element and value and the valid
range, under jit (`ops.checked`) and eagerly on both paths; valid inputs
pass and get the unchecked answer; without `checks` no check is traced."""

import functools
import re

import jax
import numpy as np
import pytest
from fuzz_inputs import TARGETS, draws
from jax.experimental import checkify

from jaxkern import ops

INVALID = [pytest.param(t, c, id=f"{t.name}-{c.label}") for t in TARGETS for c in t.cases if c.bad]
CHECKED_OPS = [pytest.param(t, id=t.name) for t in TARGETS if t.impl.preconditions is not None]
UNCHECKED_OPS = [pytest.param(t, id=t.name) for t in TARGETS if t.impl.preconditions is None]


def first_inputs(target, case):
  inputs, _ = next(draws(target, case, 1))
  return inputs


TARGET = {t.name: t for t in TARGETS}


@functools.cache
def xla_path(name: str, checks: bool):
  """The op's XLA path under jit (one compile per shape), checked or not."""
  f = jax.jit(lambda x: TARGET[name].call(x, backend="xla", checks=checks))
  return ops.checked(f) if checks else f


def floats_as_f32(x):
  """bf16 NaNs compare unequal in NumPy's array_equal; f32 ones match."""
  x = np.asarray(x)
  return x.astype(np.float32) if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else x


def assert_names(error: Exception, target, argument: str, inputs) -> None:
  """The message names the op's family, `argument`, an element of it whose
  value is the one reported, and a valid range."""
  family = target.impl.reference.__module__.rpartition(".")[2]
  match = re.match(rf"{family}: {argument}(?:\[([\d, ]+)\])? = (-?\d+) is outside its valid range: \S", str(error))
  assert match, str(error)
  value, given = int(match.group(2)), np.asarray(inputs[argument])
  where = tuple(int(i) for i in match.group(1).split(",")) if match.group(1) else ()
  if len(where) == given.ndim:
    assert given[where] == value, (where, given[where], value)
  else:  # the op reshaped the argument (sparse MLA's [M, 1, TOPK] indices)
    assert value in given, value


@pytest.mark.parametrize("target,case", INVALID)
def test_each_bad_index_input_raises_the_named_error_under_jit_and_eagerly(target, case):
  inputs = first_inputs(target, case)
  with pytest.raises(checkify.JaxRuntimeError) as under_jit:
    xla_path(target.name, True)(inputs)
  assert_names(under_jit.value, target, case.bad, inputs)
  for backend in ("xla", "pallas"):  # eager: raised before either path runs
    with pytest.raises(checkify.JaxRuntimeError) as eager:
      target.call(inputs, backend=backend, checks=True)
    assert str(eager.value) == str(under_jit.value)


@pytest.mark.parametrize("target", CHECKED_OPS)
def test_valid_inputs_pass_and_get_the_unchecked_answer(target):
  """Every valid case of the op, zero sizes included, under one jit each."""
  for case in target.cases:
    if case.bad:
      continue
    inputs = first_inputs(target, case)
    got, want = xla_path(target.name, True)(inputs), xla_path(target.name, False)(inputs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(floats_as_f32(g), floats_as_f32(w), err_msg=case.label)


def test_the_pallas_path_runs_checked_under_jit():
  target = next(t for t in TARGETS if t.name == "sparse_mla_prefill")
  inputs = first_inputs(target, target.cases[0])
  got = ops.checked(jax.jit(lambda x: target.call(x, backend="pallas", checks=True)))(inputs)
  want = jax.jit(lambda x: target.call(x, backend="pallas"))(inputs)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(floats_as_f32(g), floats_as_f32(w))


def traced_checks(target, checks: bool) -> int:
  """How many checkify checks the op's jaxpr holds."""
  inputs = first_inputs(target, target.cases[0])
  jaxpr = jax.make_jaxpr(lambda x: target.call(x, backend="xla", checks=checks))(inputs)
  return str(jaxpr).count("check[")


@pytest.mark.parametrize("target", CHECKED_OPS)
def test_checks_are_off_by_default_and_traced_when_asked(target):
  assert traced_checks(target, False) == 0
  assert traced_checks(target, True) >= 1


@pytest.mark.parametrize("target", UNCHECKED_OPS)
def test_ops_without_index_inputs_accept_checks_and_trace_none(target):
  assert traced_checks(target, True) == 0


def test_checks_under_a_plain_jit_ask_for_functionalization():
  target = next(t for t in TARGETS if t.name == "grouped_gemm_fp8_fp4")
  inputs = first_inputs(target, target.cases[0])
  with pytest.raises(ValueError, match="checkify"):
    jax.jit(lambda x: target.call(x, backend="xla", checks=True))(inputs)
