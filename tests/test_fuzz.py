"""Differential fuzz of every public op: the Pallas path
(interpret mode) against the XLA path (the references) on seeded random
inputs inside and outside each op's contract (`fuzz_inputs.py`): the same
answer under SPEC 5 and the family's policies, or the same error. On the
XLA path alone: cases that hide NaN/Inf ("masked") give the clean inputs'
answer (the references select hidden values away), and inputs outside the
contract give the answer of their documented equivalent (`Case.same_as`).

Kernel-side failures of other owners' ops are listed in `KNOWN_FAILURES`
and run as strict xfails naming the owner, so each turns into a failure
(XPASS) when its fix lands and the entry must go.
"""

import functools

import jax
import pytest
from fuzz_inputs import TARGETS, Case, Target, draws

from jaxkern import compare, registry

SEEDS = 2  # random draws per case (same shapes: compiled once per op and shape)

# (op, case) -> what the Pallas path does instead (found on main 63cc452);
# the owner is the target's. Remove an entry when its fix lands.
KNOWN_FAILURES: dict[tuple[str, str], str] = {
  # grad: dense GEMM, attention, NATTEN
  ("block_causal_attention", "nan_in_a_later_segment"): "NaN values of a later segment reach earlier rows",
  (
    "neighborhood_attention_3d",
    "nan_in_one_value",
  ): "one NaN value reaches queries whose window excludes it (halo tile: p=0 x NaN)",
}


def params():
  for target in TARGETS:
    for case in target.cases:
      why = KNOWN_FAILURES.get((target.name, case.label))
      marks = [pytest.mark.xfail(strict=True, reason=f"kernel of helper {target.owner!r}: {why}")] if why else []
      yield pytest.param(target, case, id=f"{target.name}-{case.label}", marks=marks)


TARGET = {t.name: t for t in TARGETS}


@functools.cache
def jitted(name: str, backend: str):
  """The op under jit on one path (one compile per shape)."""
  return jax.jit(lambda x: TARGET[name].call(x, backend=backend))


@functools.cache
def output_specs(name: str):
  """The op's outputs (names, dtypes) from a definition it implements."""
  impl = TARGET[name].impl
  return next(op.definition.outputs for op in map(registry.get, registry.names()) if op.impl is impl)


def run(target: Target, inputs, backend: str):
  """(named outputs, None) or (None, the exception)."""
  try:
    out = jax.block_until_ready(jitted(target.name, backend)(inputs))
  except Exception as e:  # an error is an outcome to compare
    return None, e
  values = out if isinstance(out, tuple) else (out,)
  return dict(zip(output_specs(target.name), values)), None


def assert_agree(target: Target, out, ref, inputs, what: str) -> None:
  cmp = compare.compare(output_specs(target.name), out, ref, inputs=inputs, policies=target.impl.policies)
  assert cmp.passed, (what, {k: o.message for k, o in cmp.outputs.items() if o.message})


@pytest.mark.parametrize("target,case", list(params()))
def test_pallas_path_agrees_with_xla_path(target: Target, case: Case):
  for inputs, _ in draws(target, case, SEEDS):
    ref, ref_error = run(target, inputs, "xla")
    out, out_error = run(target, inputs, "pallas")
    if ref_error or out_error:
      assert type(ref_error) is type(out_error), f"XLA path: {ref_error!r}; Pallas path: {out_error!r}"
      continue
    assert_agree(target, out, ref, inputs, "Pallas vs XLA")


MASKED = [pytest.param(t, c, id=f"{t.name}-{c.label}") for t in TARGETS for c in t.cases if c.kind == "masked"]
OUTSIDE = [pytest.param(t, c, id=f"{t.name}-{c.label}") for t in TARGETS for c in t.cases if c.same_as]


@pytest.mark.parametrize("target,case", MASKED)
def test_xla_path_selects_hidden_values_away(target: Target, case: Case):
  """NaN/Inf where the contract hides them change nothing (the references
  select with `where`, never multiply by zero)."""
  for inputs, clean in draws(target, case, SEEDS):
    (poisoned, error), (want, clean_error) = run(target, inputs, "xla"), run(target, clean, "xla")
    assert error is None and clean_error is None, (error, clean_error)
    assert_agree(target, poisoned, want, clean, "XLA path with hidden NaN/Inf vs without")


@pytest.mark.parametrize("target,case", OUTSIDE)
def test_xla_path_outside_the_contract_answers_as_documented(target: Target, case: Case):
  """Inputs outside the valid range answer as the op's contract says: as the
  equivalent inputs inside it (`Case.same_as`)."""
  for inputs, _ in draws(target, case, SEEDS):
    (got, error), (want, same_error) = run(target, inputs, "xla"), run(target, case.same_as(inputs), "xla")
    assert error is None and same_error is None, (error, same_error)
    assert_agree(target, got, want, inputs, "outside the contract vs its equivalent")


def test_every_op_is_fuzzed_with_valid_and_masked_or_invalid_inputs():
  from jaxkern import ops

  public = {n for n in ops.__all__ if n not in ("Backend", "InputError", "checked")}
  assert public == set(TARGET), public ^ set(TARGET)
  for target in TARGETS:
    kinds = {c.kind for c in target.cases}
    assert "valid" in kinds and len(target.cases) >= 4, target.name
  assert all(key in {(t.name, c.label) for t in TARGETS for c in t.cases} for key in KNOWN_FAILURES)
