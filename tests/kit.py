"""The shared test kit (not a test file): what every family is checked for,
driven by data.

`tests/test_definitions.py` runs these checks on every implemented
definition and each of its kernel backends. A family adds its data through
hooks, module-level names of its test file `tests/test_<family>.py`
(`<family>`: the name of its module in `jaxkern.families` and its package in
`pallas_kernels`):

  launches(config, axes) -> list[TritonCall]   (required)
      the Triton calls the family's Triton kernel makes with `config` at
      `axes` (every axis, constants included): names, grids, num_warps,
      num_stages, worked out by the test, not by the kernel; every lowering
      check compares with it.
  launches_<backend>(config, axes)   (one per further backend)
      the same for another backend's kernel: `launches_mosaic_gpu` returns
      the `MosaicGpuCall`s (operand and result types) it lowers to.
  KERNEL_CASES: list[Case]
      edge cases run in interpret mode and compared with the reference under
      SPEC 5 and the family's policies.
  LOWERING_CASES: list[Case]
      further axes (and configs) whose lowering for an H100 is checked against
      `launches`, beside every candidate at the largest recorded axes.
  SWEEP_CASE: Case
      small axes where every candidate config runs in interpret mode (default:
      the CPU axes of the definition's first record); `SWEEP_CASE_<BACKEND>`
      (e.g. `SWEEP_CASE_MOSAIC_GPU`) replaces it for one backend.

The family file keeps only this data and the checks that are truly its own
(the reference against float64 NumPy, synthesis structure, heuristics).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jaxkern import registry, tuning
from jaxkern.family import bind_axes
from pallas_kernels.shared.kernel import TRITON
from pallas_kernels.shared.lowering import MosaicGpuCall, TritonCall, lower_for_h100

__all__ = ["Case", "EVERY_CANDIDATE", "MosaicGpuCall", "TritonCall"]

# `Case.config` value: each of the op's candidate configs in turn.
EVERY_CANDIDATE = "every candidate"


@dataclasses.dataclass(frozen=True)
class Case:
  """Data of one check on one definition.

  `axes`: var axes; constant axes given here override the definition's (a
  shrunk or other shape of the family; they also reach keyword-only
  parameters such as a window). `inputs`: builds an edge case's inputs by
  input name instead of synthesizing them at `axes`. `config`: None for the
  heuristic's, `EVERY_CANDIDATE`, or a config. `omit`: optional inputs the
  call leaves out (the kernel's path without them). `check(out, ref,
  inputs)`: further assertions on the named outputs after the comparison
  passed. `backend`: the kernel backend checked (None: the family's
  default one)."""

  definition: str
  axes: Mapping[str, int] = dataclasses.field(default_factory=dict)
  inputs: Callable[[], dict[str, jax.Array]] | None = None
  config: Any = None
  record: Mapping[str, Any] | None = None
  omit: tuple[str, ...] = ()
  check: Callable[[dict, dict, dict], None] | None = None
  id: str = ""
  backend: str | None = None

  @property
  def label(self) -> str:
    if self.id:
      return self.id
    return ",".join(f"{k}={v}" for k, v in self.axes.items()) or self.definition


# ---------------------------------------------------------------------------
# Families and their hooks.


def family_of(name: str) -> str:
  """The family module's name of a definition (`jaxkern.families.<family>`)."""
  module = registry.get(name).definition.reference.partition(":")[0]
  return module.rsplit(".", 1)[-1]


@functools.cache
def family_tests(family: str):
  """`tests/test_<family>.py`, imported for its hooks (None if missing:
  test_definitions.py says so)."""
  try:
    return importlib.import_module(f"test_{family}")
  except ModuleNotFoundError as e:
    if e.name != f"test_{family}":
      raise
    return None


def hook(name: str, hook_name: str, default: Any = None) -> Any:
  return getattr(family_tests(family_of(name)), hook_name, default)


def launches_hook(backend: str) -> str:
  """The name of the hook that gives a backend's launches."""
  return "launches" if backend == TRITON else f"launches_{backend}"


def cases(hook_name: str, implemented: list[str]) -> list[Case]:
  """Every family's `hook_name` cases, for the implemented definitions."""
  out = []
  for family in sorted({family_of(n) for n in implemented}):
    for case in getattr(family_tests(family), hook_name, ()):
      if case.definition not in implemented:
        raise AssertionError(f"test_{family}.{hook_name}: {case.definition!r} is no implemented definition")
      out.append(case)
  return out


# ---------------------------------------------------------------------------
# Running a case.


def full_axes(op: registry.Op, axes: Mapping[str, int]) -> dict[str, int]:
  """Every axis: `axes` over the definition's constants (given ones win)."""
  full = op.definition.full_axes(axes)
  missing = set(op.definition.axes) - set(full)
  if missing:
    raise AssertionError(f"{op.name}: case axes miss {sorted(missing)}")
  return full


def bound(op: registry.Op, fn_name: str, axes: Mapping[str, int], backend: str | None = None) -> Callable[..., Any]:
  """The family's `reference`, or a kernel's (`backend`; None: the default
  one) `launch`, `choose_config` or `candidate_configs`, with its
  constant-axis parameters from `axes`."""
  const = {**op.definition.const_axes, **{a: v for a, v in axes.items() if a in op.definition.const_axes}}
  owner = op.impl if fn_name == "reference" else op.kernel_of(backend)
  return bind_axes(getattr(owner, fn_name), const, op.impl.axis_params)


def shapes_at(op: registry.Op, axes: Mapping[str, int], omit: tuple[str, ...] = ()) -> dict[str, jax.ShapeDtypeStruct]:
  full = full_axes(op, axes)
  return {
    n: jax.ShapeDtypeStruct(t.concrete_shape(full), t.np_dtype)
    for n, t in op.definition.inputs.items()
    if n not in omit
  }


def configs_of(op: registry.Op, case: Case, shapes: Mapping[str, Any]) -> list[Any]:
  if case.config is None:
    return [bound(op, "choose_config", case.axes, case.backend)(shapes)]
  if isinstance(case.config, str) and case.config == EVERY_CANDIDATE:
    return bound(op, "candidate_configs", case.axes, case.backend)(shapes)
  return [case.config]


def case_inputs(op: registry.Op, case: Case, seed: int = 0) -> dict[str, jax.Array]:
  if case.inputs is not None:
    return case.inputs()
  inputs = op.make_inputs(
    full_axes(op, case.axes), seed=seed, record=dict(case.record) if case.record else None, allow_shrunk_constants=True
  )
  return {k: v for k, v in inputs.items() if k not in case.omit}


def run_kernel(
  op: registry.Op, axes: Mapping[str, int], inputs: Mapping[str, jax.Array], config: Any, backend: str | None = None
) -> dict:
  kernel = bound(op, "launch", axes, backend)
  return op.name_outputs(jax.jit(lambda x: kernel(**x, config=config, interpret=True))(inputs))


def run_reference(op: registry.Op, axes: Mapping[str, int], inputs: Mapping[str, jax.Array]) -> dict:
  reference = bound(op, "reference", axes)
  return op.name_outputs(jax.jit(lambda x: reference(**x))(inputs))


def assert_matches(op: registry.Op, out: Mapping, ref: Mapping, inputs: Mapping, what: Any = "") -> None:
  """SPEC 5 with the family's policies (tie-aware top-k: inputs given)."""
  cmp = op.compare(out, ref, inputs=inputs)
  assert cmp.passed, (op.name, what, {k: o.message for k, o in cmp.outputs.items() if o.message})


def check_kernel_case(case: Case) -> None:
  """The kernel (interpret mode) against the reference on one case, for its
  config(s); then the case's own assertions."""
  op = registry.get(case.definition)
  inputs = case_inputs(op, case)
  ref = run_reference(op, case.axes, inputs)
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in inputs.items()}
  for config in configs_of(op, case, shapes):
    out = run_kernel(op, case.axes, inputs, config, case.backend)
    assert_matches(op, out, ref, inputs, config)
    if case.check is not None:
      case.check(out, ref, inputs)


def interpret_equivalent(config: Any) -> str:
  """A config's fields that matter in interpret mode (all but num_warps and
  num_stages, at any nesting), as a key: candidates that differ only there
  compute the same thing on a CPU."""

  def strip(x):
    if isinstance(x, dict):
      return {k: strip(v) for k, v in x.items() if k not in ("num_warps", "num_stages")}
    return x

  return json.dumps(strip(tuning.config_to_json(config)), sort_keys=True)


def check_every_candidate_runs(case: Case) -> int:
  """Every distinct candidate (for interpret mode) at the case's axes matches
  the reference; returns how many ran."""
  op = registry.get(case.definition)
  inputs = case_inputs(op, case)
  ref = run_reference(op, case.axes, inputs)
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in inputs.items()}
  candidates = bound(op, "candidate_configs", case.axes, case.backend)(shapes)
  distinct = {interpret_equivalent(c): c for c in reversed(candidates)}
  for config in distinct.values():
    assert_matches(op, run_kernel(op, case.axes, inputs, config, case.backend), ref, inputs, config)
  return len(distinct)


# ---------------------------------------------------------------------------
# Lowering.


def lowered_calls(
  op: registry.Op, axes: Mapping[str, int], config: Any, omit: tuple[str, ...] = (), backend: str | None = None
) -> list:
  """The launches (`Kernel.calls`: Triton or Mosaic GPU calls) of a
  backend's kernel with `config`, lowered for an abstract H100 at `axes`
  (shapes only)."""
  kernel = bound(op, "launch", axes, backend)
  shapes = shapes_at(op, axes, omit)
  return op.kernel_of(backend).calls(lower_for_h100(lambda x: kernel(**x, config=config, interpret=False), shapes))


def check_lowering(
  op: registry.Op, axes: Mapping[str, int], config: Any, omit: tuple[str, ...] = (), backend: str | None = None
) -> None:
  """Lowers, then compares the backend's launches (Triton: count, names,
  grids, warps, stages) with the family's hook for it (`launches_hook`)."""
  name = launches_hook(op.kernel_of(backend).backend)
  expected = hook(op.name, name)(config, full_axes(op, axes))
  got = lowered_calls(op, axes, config, omit, backend)
  assert sorted(got) == sorted(expected), (op.name, backend, dict(axes), config, got, expected)
