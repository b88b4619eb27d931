"""The definition registry: one `Op` per definition.

An `Op` joins a definition (data, from `datasets/definitions`) with its
implementation (`jaxkern.op.OpImpl`, found through the module named by the
definition's `reference` field). Definitions whose family is not implemented
yet still have an `Op`; its `reference`, `kernel` and `make_inputs` raise
NotImplementedError naming the missing module.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Any, Mapping

import jax
import numpy as np

from jaxkern import compare as compare_lib
from jaxkern import dataset
from jaxkern.op import OpImpl
from pallas_kernels.common import resolve_interpret

@dataclasses.dataclass(frozen=True)
class Op:
  definition: dataset.Definition
  impl: OpImpl | None
  missing: str = ""  # why `impl` is None

  @property
  def name(self) -> str:
    return self.definition.name

  @property
  def implemented(self) -> bool:
    return self.impl is not None

  def _require(self) -> OpImpl:
    if self.impl is None:
      raise NotImplementedError(f"{self.name}: no implementation yet ({self.missing})")
    return self.impl

  def full_axes(self, axes: Mapping[str, int]) -> dict[str, int]:
    """`axes` validated like a record's (types, constants, constraints) and
    completed with the constant axes; raises DatasetError naming the axis."""
    rec = {"uuid": "<axes>", "definition": self.name, "axes": dict(axes)}
    w = dataset.validate_record(rec, {self.name: self.definition}, file=f"{self.name} axes")
    return self.definition.full_axes(w.axes)

  def input_shapes(self, axes: Mapping[str, int]) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract inputs at `axes`: enough for configs and lowering, no data."""
    full = self.full_axes(axes)
    return {n: jax.ShapeDtypeStruct(t.concrete_shape(full), t.np_dtype)
            for n, t in self.definition.inputs.items()}

  def make_inputs(self, axes: Mapping[str, int], seed: int = 0, record: dict | None = None, *,
                  scaled: bool = False) -> dict[str, jax.Array]:
    """Deterministic, structurally valid inputs for `axes` (var axes suffice).

    `scaled=True` accepts constant axes that differ from the definition (the
    output of `cpu_axes`, which may shrink a constant to fit a CPU budget)."""
    impl = self._require()
    if scaled:
      full = self.definition.full_axes(axes)
    else:
      full = self.full_axes(axes)
    inputs = impl.make_inputs(full, jax.random.key(seed), record)
    check_tensors(self.definition, inputs, full, kind="inputs")
    return inputs

  def reference(self, inputs: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    return self._require().reference(**inputs)

  def kernel(self, inputs: Mapping[str, jax.Array], interpret: bool | None = None, config: Any = None):
    return self._require().kernel(**inputs, interpret=resolve_interpret(interpret), config=config)

  def choose_config(self, inputs: Mapping[str, Any]) -> Any:
    return self._require().choose_config(_shapes(inputs))

  def candidate_configs(self, inputs: Mapping[str, Any]) -> list[Any]:
    return self._require().candidate_configs(_shapes(inputs))

  def cpu_axes(self, axes: Mapping[str, int]) -> dict[str, int]:
    return self._require().cpu_axes(self.full_axes(axes))

  def compare(self, out: Mapping[str, jax.Array], ref: Mapping[str, jax.Array], *,
              inputs: Mapping[str, jax.Array] | None = None,
              tolerances: Mapping[str, Any] | None = None) -> compare_lib.Comparison:
    """SPEC section 5. Top-k outputs are tie-aware only when `inputs` is given
    (the scores of the kernel's selection come from them); otherwise exact."""
    impl = self.impl
    return compare_lib.compare(
        self.definition.outputs, out, ref, inputs=inputs,
        topk_scores=impl.topk_scores if impl else {},
        paired_outputs=impl.paired_outputs if impl else {},
        output_policies=impl.output_policies if impl else {},
        tolerances=tolerances)


def _shapes(inputs: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
  return {k: jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for k, v in inputs.items()}


def check_tensors(definition: dataset.Definition, tensors: Mapping[str, Any], axes: Mapping[str, int],
                  *, kind: str = "inputs", source: str = "") -> None:
  """Raises DatasetError unless `tensors` has exactly the definition's names,
  shapes and dtypes for `axes`."""
  specs = getattr(definition, kind)
  where = source or f"{definition.name} {kind}"
  if set(tensors) != set(specs):
    raise dataset.DatasetError("tensor names differ from the definition", file=where, field=kind,
                               expected=sorted(specs), got=sorted(tensors))
  for name, spec in specs.items():
    x = tensors[name]
    shape = spec.concrete_shape(axes)
    if tuple(np.shape(x)) != shape:
      raise dataset.DatasetError("wrong shape", file=where, field=f"{kind}.{name}", expected=shape,
                                 got=tuple(np.shape(x)))
    if np.dtype(x.dtype) != spec.np_dtype:
      raise dataset.DatasetError("wrong dtype", file=where, field=f"{kind}.{name}", expected=spec.dtype,
                                 got=str(x.dtype))


def _load_impl(definition: dataset.Definition) -> tuple[OpImpl | None, str]:
  module_name, _, func = definition.reference.partition(":")
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name and module_name.startswith(e.name):
      return None, f"module {module_name} does not exist"
    raise
  impl = getattr(module, "IMPLS", {}).get(definition.name)
  if impl is None:
    return None, f"{module_name}.IMPLS has no entry for {definition.name}"
  if getattr(module, func, None) is not impl.reference:
    raise RuntimeError(f"{definition.name}: reference field names {definition.reference}, "
                       f"but IMPLS registers a different function")
  return impl, ""


@functools.cache
def _ops(dataset_dir: str) -> dict[str, Op]:
  ops = {}
  for name, d in dataset.load_definitions(dataset_dir).items():
    impl, why = _load_impl(d)
    ops[name] = Op(definition=d, impl=impl, missing=why)
  return ops


def _all(dataset_dir: str | os.PathLike | None = None) -> dict[str, Op]:
  return _ops(str(dataset_dir or dataset.default_dataset_dir()))


def names(dataset_dir: str | os.PathLike | None = None) -> list[str]:
  """The definition names, sorted."""
  return sorted(_all(dataset_dir))


def get(name: str, dataset_dir: str | os.PathLike | None = None) -> Op:
  ops = _all(dataset_dir)
  if name not in ops:
    raise KeyError(f"unknown definition {name!r}; close matches: {dataset.close_matches(name, ops)}")
  return ops[name]
