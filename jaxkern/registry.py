"""The definition registry: one `Op` per definition.

An `Op` joins a definition (data, from `datasets/definitions`) with its
implementation (`jaxkern.family.OpImpl`), found through the function its
`reference` field names; only modules inside `jaxkern.families` are imported.
Definitions whose family module does not exist yet still have an `Op`; its
`reference`, `kernel` and `make_inputs` raise NotImplementedError naming the
missing module. An `Op` is what a definition's operator is (validation,
synthesis, reference, kernel, configs, cost, comparison); how a recorded
workload is run lives on the replay side (`jaxkern.plan`).

Backends and configs: `Op.config_for(inputs, config, backend=)` and
`Op.kernel(..., backend=)` go through `jaxkern.backends.select`, the path
`jaxkern.ops` takes too: the caller's config, else the tuned table of the
current device kind (`jaxkern.tuning`), else the backend's heuristic.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxkern import backends, dataset, roofline
from jaxkern import compare as compare_lib
from jaxkern.family import OpImpl, bind_axes
from pallas_kernels.shared.common import resolve_interpret
from pallas_kernels.shared.kernel import Kernel

FAMILIES_PACKAGE = "jaxkern.families"


def family_packages() -> tuple[str, ...]:
  """Packages a definition's `reference` may import from: `jaxkern.families`,
  plus out-of-tree ones named in JAXKERN_FAMILY_PACKAGES (comma-separated)."""
  extra = [p.strip() for p in os.environ.get("JAXKERN_FAMILY_PACKAGES", "").split(",") if p.strip()]
  return (FAMILIES_PACKAGE, *extra)


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

  def _bound(self, fn_name: str):
    impl = self._require()
    return bind_axes(getattr(impl, fn_name), self.definition.const_axes, impl.axis_params)

  # -- axes and inputs -----------------------------------------------------

  def validated_axes(self, axes: Mapping[str, int]) -> dict[str, int]:
    """`axes` validated like a record's (types, constants, constraints) and
    completed with the constant axes; raises DatasetError naming the axis."""
    rec = {"uuid": "<axes>", "definition": self.name, "axes": dict(axes)}
    w = dataset.validate_record(rec, {self.name: self.definition}, file=f"{self.name} axes")
    return self.definition.full_axes(w.axes)

  def input_shapes(self, axes: Mapping[str, int]) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract inputs at `axes`: enough for configs and lowering, no data."""
    full = self.validated_axes(axes)
    return {n: jax.ShapeDtypeStruct(t.concrete_shape(full), t.np_dtype) for n, t in self.definition.inputs.items()}

  def make_inputs(
    self, axes: Mapping[str, int], seed: int = 0, record: dict | None = None, *, allow_shrunk_constants: bool = False
  ) -> dict[str, jax.Array]:
    """Deterministic, structurally valid inputs for `axes` (var axes suffice).

    `allow_shrunk_constants=True` accepts constant axes smaller than the
    definition's (the output of `cpu_axes`, which may shrink a constant that
    would otherwise allocate gigabytes)."""
    impl = self._require()
    full = self.definition.full_axes(axes) if allow_shrunk_constants else self.validated_axes(axes)
    inputs = impl.make_inputs(full, jax.random.key(seed), record)
    check_tensors(self.definition, inputs, full, kind="inputs")
    return inputs

  def cpu_axes(self, axes: Mapping[str, int], *, validated: bool = False) -> dict[str, int]:
    """The family's CPU-budget copy of `axes` (validated first, unless the
    caller already did)."""
    return self._require().cpu_axes(dict(axes) if validated else self.validated_axes(axes))

  # -- running -------------------------------------------------------------

  def name_outputs(self, result: Any) -> dict[str, jax.Array]:
    """A kernel's or reference's return value (one array or a tuple in the
    definition's output order) as a dict by output name."""
    names = list(self.definition.outputs)
    values = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    if len(values) != len(names):
      raise ValueError(f"{self.name}: expected {len(names)} outputs {names}, got {len(values)}")
    return dict(zip(names, values))

  def reference(self, inputs: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    return self.name_outputs(self._bound("reference")(**inputs))

  def kernel(
    self, inputs: Mapping[str, jax.Array], interpret: bool | None = None, config: Any = None, backend: str | None = None
  ) -> dict[str, jax.Array]:
    """A kernel's outputs: `backend` one of the family's kernel backends
    (`"triton"`, `"mosaic_gpu"`), or None / `"pallas"` for the best
    available (`jaxkern.backends`); `config=None` takes `config_for`'s
    choice. Raises `Unsupported` naming each backend's refusal when no
    kernel takes the inputs."""
    interpret = resolve_interpret(interpret)
    impl = self._require()

    def launch(choice: backends.Choice):
      fn = self._bound_kernel(choice.backend, "launch")
      return fn(**inputs, config=choice.config, interpret=interpret)

    _, out = backends.first_supported(
      self.choices(inputs, config, backend=backend), launch, op=self.name, kernels=impl.kernels
    )
    return self.name_outputs(out)

  # -- backends and configs --------------------------------------------------

  @property
  def backends(self) -> tuple[str, ...]:
    """The family's kernel backends, in its default order."""
    return tuple(self._require().kernels)

  def kernel_of(self, backend: str | None = None) -> Kernel:
    """The family's kernel of `backend` (None: its default one)."""
    impl = self._require()
    if backend is None:
      return impl.default
    backends.order(impl.kernels, backend, op=self.name)  # raises naming the backends it has
    return impl.kernels[backend]

  def _bound_kernel(self, backend: str | None, fn_name: str):
    impl = self._require()
    return bind_axes(getattr(self.kernel_of(backend), fn_name), self.definition.const_axes, impl.axis_params)

  def choose_config(self, inputs: Mapping[str, Any], backend: str | None = None) -> Any:
    """A backend's heuristic config for these inputs (or shapes)."""
    return self._bound_kernel(backend, "choose_config")(_shapes(inputs))

  def candidate_configs(self, inputs: Mapping[str, Any], backend: str | None = None) -> list[Any]:
    """A backend's sweep candidates (the heuristic's first)."""
    return self._bound_kernel(backend, "candidate_configs")(_shapes(inputs))

  def bucket(self, inputs: Mapping[str, Any]) -> str:
    """The tuned table's shape bucket of these inputs (`backends.bucket_of`)."""
    impl = self._require()
    return backends.bucket_of(impl.kernels, _shapes(inputs), self.definition.const_axes, impl.axis_params)

  def var_axes_of(self, inputs: Mapping[str, Any]) -> dict[str, int]:
    """The variable axes that input shapes imply."""
    found: dict[str, int] = {}
    for name, spec in self.definition.inputs.items():
      if spec.shape is None or name not in inputs:
        continue
      for axis, size in zip(spec.shape, np.shape(inputs[name])):
        found.setdefault(axis, int(size))
    return {a: found[a] for a in self.definition.var_axes if a in found}

  def choices(
    self,
    inputs: Mapping[str, Any],
    config: Any = None,
    *,
    backend: str | None = None,
    tuned: bool = True,
    device_kind: str | None = None,
  ):
    """`backends.select` for these inputs: the (backend, config, source) of
    each backend to try, in order."""
    impl = self._require()
    return backends.select(
      impl.kernels,
      _shapes(inputs),
      op=self.name,
      const_axes=self.definition.const_axes,
      axis_params=impl.axis_params,
      backend=backend or backends.PALLAS,
      config=config,
      tuned=tuned,
      device_kind=device_kind,
    )

  def config_for(
    self,
    inputs: Mapping[str, Any],
    config: Any = None,
    *,
    backend: str | None = None,
    tuned: bool = True,
    device_kind: str | None = None,
  ) -> backends.Choice:
    """The backend `kernel` runs, with its config: the first of `choices`
    whose kernel takes these inputs (traced on their shapes when there is a
    backend to fall back to). Its config: the caller's, else (with `tuned`)
    the tuned table's for the current device kind and this shape bucket,
    else the heuristic's."""
    choices = self.choices(inputs, config, backend=backend, tuned=tuned, device_kind=device_kind)
    if len(self._require().kernels) == 1 or (backend or backends.PALLAS) != backends.PALLAS:
      return next(choices)
    shapes = _shapes(inputs)

    def trace(choice: backends.Choice):
      launch = self._bound_kernel(choice.backend, "launch")
      return jax.eval_shape(lambda x: launch(**x, config=choice.config, interpret=False), shapes)

    return backends.first_supported(choices, trace, op=self.name, kernels=self._require().kernels)[0]

  def cost(
    self,
    axes: Mapping[str, int],
    *,
    inputs: Mapping[str, jax.Array] | None = None,
    record: Mapping[str, Any] | None = None,
    config: Any = None,
  ) -> roofline.Cost:
    """FLOPs and minimum HBM bytes of a run at `axes` (the family's formula,
    `OpImpl.cost`). Variable axes suffice; constant axes not given take the
    definition's values, given ones win (a run with shrunk constants).
    `inputs` (the run's arrays) and `record` (the workload record) let the
    formula count what the data decides; `config` (the kernel's) which
    instructions, hence which peak, the kernel runs."""
    impl = self._require()
    if impl.cost is None:
      raise NotImplementedError(f"{self.name}: the family has no cost formula (OpImpl.cost)")
    full = {**self.definition.const_axes, **{k: int(v) for k, v in axes.items()}}
    work = impl.cost(self.definition, full, inputs=inputs, record=record, config=config)
    return roofline.Cost(
      flops=int(work.flops),
      bytes=int(work.bytes),
      dtype_class=work.dtype_class,
      family=impl.cost.__name__,
      gather_bytes=int(work.gather_bytes),
      counted_from=work.counted_from,
    )

  def compare(
    self,
    out: Mapping[str, jax.Array],
    ref: Mapping[str, jax.Array],
    *,
    inputs: Mapping[str, jax.Array] | None = None,
    tolerances: Mapping[str, Any] | None = None,
  ) -> compare_lib.Comparison:
    """The comparison rule (`jaxkern.compare`) with the family's per-output policies. Top-k outputs are
    tie-aware only when `inputs` is given; otherwise exact."""
    return compare_lib.compare(
      self.definition.outputs,
      out,
      ref,
      inputs=inputs,
      policies=self.impl.policies if self.impl else {},
      tolerances=tolerances,
    )


def _shapes(inputs: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
  return {k: jax.ShapeDtypeStruct(tuple(np.shape(v)), v.dtype) for k, v in inputs.items()}


def check_tensors(
  definition: dataset.Definition,
  tensors: Mapping[str, Any],
  axes: Mapping[str, int],
  *,
  kind: str = "inputs",
  source: str = "",
) -> None:
  """Raises DatasetError unless `tensors` has exactly the definition's names,
  shapes and dtypes for `axes`."""
  specs = getattr(definition, kind)
  where = source or f"{definition.name} {kind}"
  if set(tensors) != set(specs):
    raise dataset.DatasetError(
      "tensor names differ from the definition", file=where, field=kind, expected=sorted(specs), got=sorted(tensors)
    )
  for name, spec in specs.items():
    x = tensors[name]
    shape = spec.concrete_shape(axes)
    if tuple(np.shape(x)) != shape:
      raise dataset.DatasetError(
        "wrong shape", file=where, field=f"{kind}.{name}", expected=shape, got=tuple(np.shape(x))
      )
    if np.dtype(x.dtype) != spec.np_dtype:
      raise dataset.DatasetError(
        "wrong dtype", file=where, field=f"{kind}.{name}", expected=spec.dtype, got=str(x.dtype)
      )


def _load_impl(definition: dataset.Definition) -> tuple[OpImpl | None, str]:
  """The OpImpl whose reference is the function the definition names."""
  module_name, sep, func = definition.reference.partition(":")
  allowed = family_packages()
  inside = any(module_name == p or module_name.startswith(p + ".") for p in allowed)
  if not (sep and func.isidentifier() and inside and all(part.isidentifier() for part in module_name.split("."))):
    raise dataset.DatasetError(
      "reference must name a function of a family module",
      file=definition.name,
      field="reference",
      expected=f"'<module>:<function>' with the module inside {allowed}",
      got=definition.reference,
    )
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name and module_name.startswith(e.name):
      return None, f"module {module_name} does not exist"
    raise
  fn = getattr(module, func, None)
  if fn is None:
    raise dataset.DatasetError(
      f"{module_name} has no function {func}",
      file=definition.name,
      field="reference",
      expected="an existing function",
      got=definition.reference,
    )
  for impl in getattr(module, "IMPLS", ()):
    if impl.reference is fn:
      return impl, ""
  return None, f"{module_name}.IMPLS has no OpImpl for {func}"


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
