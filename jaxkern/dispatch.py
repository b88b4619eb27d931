"""One dispatch for every public op of `jaxkern.ops`.

A family's public function (in `jaxkern/families/<name>.py`) only normalizes
its arguments (batch dimensions, default scales, optional inputs) into the
definition's input names and calls `run` once with its `OpImpl`. `run`:

1. picks the path (`use_pallas`): `backend=None` is `"pallas"` on a GPU and
   `"xla"` elsewhere; `"pallas"` the best available kernel, `"triton"` or
   `"mosaic_gpu"` that backend's kernel (interpret mode without a GPU);
   `"xla"` the XLA path; anything else is a ValueError;
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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax.numpy as jnp
from jax.experimental import checkify

from jaxkern import autodiff, backends, spmd
from jaxkern.family import OpImpl, bind_axes
from pallas_kernels.shared.common import has_gpu, resolve_interpret

Backend = Literal["xla", "pallas", "triton", "mosaic_gpu"] | None


def use_pallas(backend: Backend) -> bool:
  """Whether `backend` means a kernel here (None: on a GPU)."""
  backends.check_name(backend)
  if backend is None:
    return has_gpu()
  return backend != backends.XLA


def kernel_backend(backend: Backend) -> str:
  """The kernel backend name `select` takes for a kernel path: None means `"pallas"`."""
  return backends.PALLAS if backend is None else backend


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
  pallas = use_pallas(backend)
  interpret = resolve_interpret(interpret)
  reference = bind_axes(impl.reference, const_axes, impl.axis_params)
  op = autodiff.op_name(impl.reference)

  def call(shard: Mapping[str, Any]) -> Any:  # on one shard's arrays (all of them off a mesh)
    arrays, statics = autodiff.split_arrays({**shard, **params})
    if not pallas:
      return autodiff.xla_path(reference, arrays, statics)
    choices = backends.select(
      impl.kernels,
      shard,
      op=op,
      const_axes=const_axes,
      axis_params=impl.axis_params,
      backend=kernel_backend(backend),
      config=config,
    )
    _, out = backends.first_supported(
      choices,
      lambda c: call_kernel(impl, c, arrays, statics, const_axes=const_axes, interpret=interpret),
      op=op,
      kernels=impl.kernels,
    )
    return out

  # Interpret mode in its own shard_map skips the vma check: an interpreted
  # kernel would otherwise run once per shard on every device (common.pallas_call).
  return spmd.run(impl.split, impl.reference.__name__, call, given, pallas=pallas, check_vma=not (pallas and interpret))
