"""The contract between a definition and its implementation (`OpImpl`, one
per family shape), and the helpers family modules share.

A family module `jaxkern/families/<name>.py` (kernels: `pallas_kernels/<name>/`)
exports `IMPLS`, a tuple of `OpImpl`, the reference functions its definition
files name (`"reference": "jaxkern.families.<name>:<function>"`) and its
public op functions (re-exported by `jaxkern.ops`, dispatched by
`jaxkern.dispatch`). The registry pairs a definition with the `OpImpl` whose
`reference` is the function it names, so another shape of an existing family
(another GEMM N/K, another head count) is a definition JSON and its records,
no code. Each public op is wrapped by `jaxkern.contract.public_op(validate)`:
its `validate` checks the arguments against the op's contract before
dispatch, the same on every backend (tensors positional, everything else
keyword-only).

Conventions:
* `reference(**inputs)` and each kernel's launcher `launch(**inputs, config=,
  interpret=)` (`kernels`: backend -> `pallas_kernels.shared.kernel.Kernel`,
  the family's `KERNELS` in its default order) take the definition's input names and return one array or a tuple in the
  definition's output order. Scalars arrive as 0-d arrays. The reference is
  plain jnp and the family's own math: it never calls into
  `pallas_kernels`, so a kernel bug cannot pass its own check.
* Constant axes reach functions as keyword-only parameters: a parameter named
  like a constant axis (`KT`), or mapped to one by `axis_params`
  (`{"top_k": "TOPK"}`), receives the definition's value. This holds for
  `reference` and each kernel's `launch`, `choose_config` and
  `candidate_configs`.
* `make_inputs(axes, key, record) -> dict`: `axes` holds every axis (var and
  const); `record` is the raw workload dict or None. The record's own axes may
  be larger than `axes` (a scaled run): provenance is rescaled to fit.
* A kernel's `choose_config(shapes)` / `candidate_configs(shapes)`: `shapes`
  maps input name to `jax.ShapeDtypeStruct` (arrays work too); candidates
  start with the heuristic's choice.
* `cpu_axes(axes) -> axes`: a shrunk copy that keeps the structure but fits an
  interpret-mode CPU budget (`shrink_rows` and `shrink_until` help).
* `cost(definition, axes, *, inputs=None, record=None, config=None) ->
  jaxkern.roofline.Work`: the roofline work of one run. `axes` are every axis
  of the run; `inputs` (the run's arrays, when at hand) and `record` let a
  formula count what the data decides (visible keys, routed experts, valid
  slots, referenced pages) instead of a bound from the axes; `config` (the
  kernel's, when at hand) which MMA instructions the kernel runs, so the
  FLOPs are judged against the matching peak.
* `policies`: output name -> `jaxkern.compare.Policy` for outputs not
  compared by their dtype alone (top-k selections, paired values, states).
* `split`: how the op splits across devices (`jaxkern.spmd.Split`: the
  dimensions it is independent along); None: never.
* A kernel's `own_vjp`: its launcher carries its own VJP (Pallas backward
  kernels); see `jaxkern.autodiff` for every other kernel's gradient.
* `preconditions(inputs) -> list[Precondition]`: the valid ranges of the
  index and length inputs (constant axes as keyword-only parameters, like
  `reference`), which checked mode (`jaxkern.ops.<op>(..., checks=True)`,
  `jaxkern.dispatch`) asserts with `jax.experimental.checkify`. Inputs
  outside them still get the answer the reference defines; checked mode
  reports them instead. None: the family has no such inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jaxkern.spmd import Split
from pallas_kernels.shared.common import varying_axes
from pallas_kernels.shared.kernel import Kernel

Inputs = Mapping[str, jax.Array]
Shapes = Mapping[str, jax.ShapeDtypeStruct]
# -> jaxkern.roofline.Work (flops, bytes, dtype_class, gather_bytes, counted_from).
CostFormula = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Precondition:
  """One checked-mode rule: every element of input `argument` must be valid.
  `valid`: bool, shaped like the argument (True = valid); `expected`: the
  valid range in words, with the sizes it depends on (the error names the
  first invalid element, its value and this)."""

  argument: str
  valid: jax.Array
  expected: str


@dataclasses.dataclass(frozen=True)
class OpImpl:
  reference: Callable[..., Any]
  kernels: Mapping[str, Kernel]
  make_inputs: Callable[[Mapping[str, int], jax.Array, dict | None], dict[str, jax.Array]]
  cpu_axes: Callable[[Mapping[str, int]], dict[str, int]]
  cost: CostFormula | None = None
  policies: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  axis_params: Mapping[str, str] = dataclasses.field(default_factory=dict)  # parameter -> const axis
  split: Split | None = None
  preconditions: Callable[..., list[Precondition]] | None = None

  def __post_init__(self):
    if not self.kernels:
      raise ValueError(f"OpImpl of {self.reference.__name__}: no kernels")
    for backend, kernel in self.kernels.items():
      if kernel.backend != backend:
        raise ValueError(f"OpImpl of {self.reference.__name__}: kernels[{backend!r}] is a {kernel.backend} kernel")

  @property
  def default(self) -> Kernel:
    """The first kernel of the family's default order."""
    return next(iter(self.kernels.values()))


def _axis_values(
  fn: Callable[..., Any], const_axes: Mapping[str, int], axis_params: Mapping[str, str], *, defaults: bool
) -> dict[str, Any]:
  values = {}
  for name, p in inspect.signature(fn).parameters.items():
    if p.kind is not inspect.Parameter.KEYWORD_ONLY:
      continue
    axis = axis_params.get(name, name)
    if axis in const_axes:
      values[name] = const_axes[axis]
    elif defaults and p.default is not inspect.Parameter.empty:
      values[name] = p.default
  return values


def bind_axes(
  fn: Callable[..., Any], const_axes: Mapping[str, int], axis_params: Mapping[str, str]
) -> Callable[..., Any]:
  """`fn` with its keyword-only constant-axis parameters filled in."""
  bound = _axis_values(fn, const_axes, axis_params, defaults=False)
  return functools.partial(fn, **bound) if bound else fn


def bound_values(
  fn: Callable[..., Any], const_axes: Mapping[str, int], axis_params: Mapping[str, str]
) -> dict[str, Any]:
  """The value each keyword-only parameter of `fn` gets from `const_axes`
  (named like the parameter or mapped by `axis_params`), else its default."""
  return _axis_values(fn, const_axes, axis_params, defaults=True)


def in_range(x: jax.Array, lo: Any, hi: Any) -> jax.Array:
  """`lo <= x < hi` elementwise (bounds broadcast against x)."""
  return (x >= lo) & (x < hi)


def cdiv(a: int, b: int) -> int:
  """ceil(a / b) for integers (the families' own: references and synthesis
  import nothing from `pallas_kernels`)."""
  return -(-a // b)


def varying_like(x: Any, *like: Any) -> Any:
  """`x` (an array or a pytree of them) made to vary over the manual mesh axes (inside `jax.shard_map`) any
  of `like` varies over: a loop carry that starts from a constant must have
  the type the loop body gives it (the inputs' axes). Outside a shard_map,
  `x` itself."""
  target = varying_axes(*like)

  def vary(leaf):
    axes = tuple(sorted(target - varying_axes(leaf)))
    return jax.lax.pcast(leaf, axes, to="varying") if axes else leaf

  return jax.tree.map(vary, x)


def shrink_rows(n: int, base: int = 64) -> int:
  """A row count at CPU scale: `base + n % base` above `base` (ragged counts
  stay ragged: 4125 -> 93), `n` itself at or below it."""
  return n if n <= base else base + n % base


def shrink_until(
  axes: Mapping[str, int],
  fits: Callable[[dict[str, int]], bool],
  shrink: Callable[[dict[str, int]], dict[str, int]],
  *,
  max_steps: int = 64,
) -> dict[str, int]:
  """Applies `shrink` to a copy of `axes` until `fits` holds (or nothing
  changes any more)."""
  out = dict(axes)
  for _ in range(max_steps):
    if fits(out):
      break
    smaller = shrink(dict(out))
    if smaller == out:
      break
    out = smaller
  return out
