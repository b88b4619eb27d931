"""One dispatch for every public op of `jaxkern.ops`.

A family's public function (in `jaxkern/families/<name>.py`) only normalizes
its arguments (batch dimensions, default scales, optional inputs) into the
definition's input names and calls `run` once with its `OpImpl`. `run`:

1. picks the path (`resolve_backend`): the call's `backend=`, else the
   innermost `jaxkern.backend(...)` scope's (`backends.scope`), else
   `"pallas"` on a GPU and `"xla"` elsewhere; `"pallas"` the best available
   kernel, `"triton"` or `"mosaic_gpu"` that backend's kernel (interpret mode
   without a GPU); `"xla"` the XLA path; anything else is a ValueError.
   The op's inputs were validated before (`jaxkern.contract`: the same
   `InputError` on every path);
2. on a kernel path, picks the backend and config (`jaxkern.backends.select`:
   the caller's config, else the tuned table's entry for the kernel and the
   call's shape bucket, else the backend's heuristic, from the call's own
   shapes) and falls back along the family's backends when a kernel refuses
   the inputs (`backends.first_supported`); resolves interpret mode;
3. calls the kernel, or the family's reference, which is the XLA path: the
   definition's own math, never a second hand-written copy; on sharded
   inputs per shard where the family's `split` allows (`jaxkern.spmd`), the
   config then chosen for the shard's shapes.

Checked mode (`checks=True`, off by default): before either path, each of
the family's `OpImpl.preconditions` (valid ranges of index and length
inputs) becomes a `checkify.check` whose message names the op, the
argument, the first offending element and value, and the valid range.
Eager calls on concrete arrays raise `checkify.JaxRuntimeError` at once;
under `jit` the checks must be functionalized: `checked(jax.jit(f))` (or
`checkify.checkify` and `Error.throw()` by hand) raises the same error.

Everything that applies to every op call belongs here, so that it is one
edit: a checked mode that validates index preconditions
(`jax.experimental.checkify` around the call), sharding (`shard_map` of the
call over a mesh), gradients (`jaxkern.autodiff`: a kernel with its own
`jax.custom_vjp` is called as is, any other is differentiated through its
reference; both paths raise the same clear error where an op has no
gradient).

`explain(op, *args, **kwargs)` (`jaxkern.explain`) traces one call
abstractly and says which backend, kernel and config it would run, and why.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxkern import autodiff, backends, spmd, tuning
from jaxkern.family import OpImpl, bind_axes
from pallas_kernels.shared.common import has_gpu, resolve_interpret

Backend = Literal["xla", "pallas", "triton", "mosaic_gpu"] | None


def resolve_backend(backend: Backend) -> tuple[str, str]:
  """(the backend a call runs on, why): the call's `backend=`, else the
  enclosing `jaxkern.backend` scope's, else `"pallas"` on a GPU and `"xla"`
  without one. Raises ValueError for an unknown name."""
  backends.check_name(backend)
  if backend is not None:
    return backend, "the call's backend= argument"
  scoped = backends.scoped()
  if scoped is not None:
    return scoped, "the enclosing jaxkern.backend scope"
  if has_gpu():
    return backends.PALLAS, "the default on a GPU (no backend= and no jaxkern.backend scope)"
  return backends.XLA, "the default without a GPU (no backend= and no jaxkern.backend scope)"


def use_pallas(backend: Backend) -> bool:
  """Whether `backend` means a kernel here (None: the scope's, else on a GPU)."""
  return resolve_backend(backend)[0] != backends.XLA


def call_kernel(
  impl: OpImpl,
  choice: backends.Choice,
  arrays: Mapping[str, Any],
  statics: Mapping[str, Any],
  *,
  const_axes: Mapping[str, int],
  interpret: bool,
) -> Any:
  """The chosen kernel on `arrays`: its own VJP where it has one, else
  differentiated through the family's reference (`jaxkern.autodiff`)."""
  kernel = impl.kernels[choice.backend]
  launch = functools.partial(
    bind_axes(kernel.launch, const_axes, impl.axis_params), config=choice.config, interpret=interpret
  )
  if kernel.own_vjp:
    return launch(**arrays, **statics)
  return autodiff.pallas_path(
    launch, bind_axes(impl.reference, const_axes, impl.axis_params), dict(arrays), dict(statics)
  )


def check_preconditions(impl: OpImpl, inputs: Mapping[str, Any], const_axes: Mapping[str, int]) -> None:
  """Checked mode: one `checkify.check` per precondition of `impl`, naming
  the first invalid element of its argument, the value there and the valid
  range (`OpImpl.preconditions`)."""
  if impl.preconditions is None:
    return
  op = impl.reference.__module__.rpartition(".")[2]
  for rule in bind_axes(impl.preconditions, const_axes, impl.axis_params)(inputs):
    valid = jnp.asarray(rule.valid, bool)
    value = jnp.asarray(inputs[rule.argument])
    if valid.shape != value.shape:
      raise ValueError(f"{op}: precondition of {rule.argument} is shaped {valid.shape}, the input {value.shape}")
    if valid.size == 0:
      continue
    first = jnp.argmin(valid.reshape(-1))  # the first False (0 if none)
    where = jnp.unravel_index(first, valid.shape)
    index = f"[{', '.join(['{}'] * valid.ndim)}]" if valid.ndim else ""
    expected = rule.expected.replace("{", "{{").replace("}", "}}")
    checkify.check(
      jnp.all(valid),
      f"{op}: {rule.argument}{index} = {{}} is outside its valid range: {expected}",
      *where,
      value.reshape(-1)[first],
    )


def checked(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` (jitted or not) with the checks of the ops it calls with
  `checks=True` functionalized (`checkify.checkify`) and raised after the
  call: a failing check raises `checkify.JaxRuntimeError`."""
  functionalized = checkify.checkify(fn)

  @functools.wraps(fn)
  def run_checked(*args, **kwargs):
    error, out = functionalized(*args, **kwargs)
    error.throw()
    return out

  return run_checked


def run(
  impl: OpImpl,
  inputs: Mapping[str, Any],
  *,
  backend: Backend = None,
  config: Any = None,
  const_axes: Mapping[str, int] | None = None,
  params: Mapping[str, Any] | None = None,
  interpret: bool | None = None,
  checks: bool = False,
) -> Any:
  """One op call: `impl`'s kernel or reference on `inputs`.

  `inputs`: the definition's input names (an optional input may be None);
  `const_axes`: constant axes the call sets (bound to keyword-only parameters
  like the registry does); `params`: keyword arguments both paths take that
  are not inputs of the definition (the attention ops' `sm_scale`, the GEMM's
  `out_dtype`); `checks`: checked mode (module docstring)."""
  const_axes = dict(const_axes or {})
  given = {k: v for k, v in inputs.items() if v is not None}
  params = dict(params or {})
  if checks:
    check_preconditions(impl, given, const_axes)
  chosen, why = resolve_backend(backend)
  pallas = chosen != backends.XLA
  interpret = resolve_interpret(interpret)
  reference = bind_axes(impl.reference, const_axes, impl.axis_params)
  op = autodiff.op_name(impl.reference)
  explaining = _EXPLAINING.get()

  def call(shard: Mapping[str, Any]) -> Any:  # on one shard's arrays (all of them off a mesh)
    arrays, statics = autodiff.split_arrays({**shard, **params})
    if not pallas:
      if explaining is not None:
        explaining.append(
          Explanation(op, chosen, backends.XLA, why, f"reference {impl.reference.__name__}", None, "", ())
        )
      return autodiff.xla_path(reference, arrays, statics)
    choices = backends.select(
      impl.kernels,
      shard,
      op=op,
      const_axes=const_axes,
      axis_params=impl.axis_params,
      backend=chosen,
      config=config,
    )
    refused: list[str] = []
    choice, out = backends.first_supported(
      choices,
      lambda c: call_kernel(impl, c, arrays, statics, const_axes=const_axes, interpret=interpret),
      op=op,
      kernels=impl.kernels,
      refused=refused,
    )
    if explaining is not None:
      kernel = impl.kernels[choice.backend]
      source = _config_source(choice.source, backends.bucket_of(impl.kernels, shard, const_axes, impl.axis_params))
      explaining.append(
        Explanation(
          op, chosen, choice.backend, why, f"{kernel.name} ({choice.backend})", choice.config, source, tuple(refused)
        )
      )
    return out

  # Interpret mode in its own shard_map skips the vma check: an interpreted
  # kernel would otherwise run once per shard on every device (common.pallas_call).
  return spmd.run(impl.split, impl.reference.__name__, call, given, pallas=pallas, check_vma=not (pallas and interpret))


# ---------------------------------------------------------------------------
# explain: which backend, kernel and config a call would run.


@dataclasses.dataclass(frozen=True)
class Explanation:
  """What one op call runs (`explain`).

  `op`: the op's reference name; `requested`: the backend asked for
  (`"pallas"`: the best kernel); `backend`: the path that runs (`"xla"` or
  the kernel backend chosen); `why_backend`: where `requested`
  came from (the call's `backend=`, a `jaxkern.backend` scope, the GPU
  default); `kernel`: the kernel family and backend, or the XLA reference
  function; `config`: the kernel's config (None on the XLA path);
  `config_source`: the tuned table's entry (its shape bucket), the
  backend's heuristic (no tuned entry for the bucket) or the caller's;
  `fallbacks`: `"<backend>: <why>"` of each kernel that refused the inputs
  before this one (`backend="pallas"`)."""

  op: str
  requested: str
  backend: str
  why_backend: str
  kernel: str
  config: Any
  config_source: str
  fallbacks: tuple[str, ...]

  def __str__(self) -> str:
    lines = [
      f"{self.op}: backend {self.backend!r} (asked {self.requested!r}: {self.why_backend}); kernel {self.kernel}"
    ]
    if self.config is not None:
      lines.append(f"  config {self.config!r}: {self.config_source}")
    lines += [f"  fell back: {f}" for f in self.fallbacks]
    return "\n".join(lines)


_EXPLAINING: contextvars.ContextVar[list[Explanation] | None] = contextvars.ContextVar(
  "jaxkern_explaining", default=None
)


def _config_source(source: str, bucket: str) -> str:
  if source == tuning.TUNED:
    return f"the tuned table's entry for this device kind and shape bucket {bucket}"
  if source == tuning.HEURISTIC:
    return f"the backend's heuristic (the tuned table has no entry for shape bucket {bucket})"
  return "the caller's config="


def explain(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Explanation:
  """Which backend, kernel and config `op(*args, **kwargs)` (a `jaxkern.ops`
  op) would run, and why, without running it: the call is traced
  abstractly (`jax.eval_shape`; arrays may be `jax.ShapeDtypeStruct`s),
  through the same validation, backend choice, config choice and kernel
  fallback as a real call, in the current `jaxkern.backend` scope.
  Raises what the call would raise (an `InputError`, an `Unsupported`
  when no kernel takes the inputs); ValueError when `op` runs no op or
  several."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  dynamic = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))]

  def traced(*arrays):
    values = list(leaves)
    for i, x in zip(dynamic, arrays):
      values[i] = x
    a, kw = jax.tree.unflatten(tree, values)
    return op(*a, **kw)

  shapes = [jax.ShapeDtypeStruct(np.shape(leaves[i]), leaves[i].dtype) for i in dynamic]
  seen: list[Explanation] = []
  token = _EXPLAINING.set(seen)
  try:
    jax.eval_shape(traced, *shapes)
  finally:
    _EXPLAINING.reset(token)
  if len(seen) != 1:
    name = getattr(op, "__name__", repr(op))
    raise ValueError(f"explain takes one jaxkern.ops op; {name} ran {len(seen)} op calls")
  return seen[0]
