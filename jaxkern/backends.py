"""Which kernel backend and config a call runs: the one `select` path of
`jaxkern.ops` (through `jaxkern.dispatch`), the registry's `Op.kernel`,
replay, sweep and aot.

Backend names (`backend=`): `"xla"` (the family's reference, no kernel),
a kernel backend (`"triton"`, `"mosaic_gpu"`: `pallas_kernels.shared.kernel.
BACKENDS`), or `"pallas"`: the best available kernel, in the order

  1. the backend whose tuned entry (this device kind, this shape bucket) is
     the fastest, when the tuned table has one;
  2. the family's default order (its `KERNELS` mapping: Triton first).

`select` yields one `Choice` (backend, config, where the config came from)
per backend in that order; `first_supported` runs them until one kernel
takes the inputs (a launcher refuses with `Unsupported`) and otherwise
raises one error naming the op's backends and why each refused.

Configs: the caller's (its class names the backend), else the tuned
table's entry for (kernel, backend, shape bucket), else the backend's
heuristic for these shapes: each computed at most once per call, from the
call's own shapes and constant axes (no dataset is read).

The default backend of `jaxkern.ops` (what `backend=None` means) can be set
for a scope: `with jaxkern.backend("mosaic_gpu"): ...` (`scope`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from jaxkern import tuning
from jaxkern.family import bind_axes, bound_values
from pallas_kernels.shared.kernel import BACKENDS, Kernel, Unsupported

XLA, PALLAS = "xla", "pallas"
NAMES = (XLA, PALLAS, *BACKENDS)


@dataclasses.dataclass(frozen=True)
class Choice:
  """A kernel backend and its config for one call; `source`: where the
  config came from (`tuning.EXPLICIT`, `TUNED` or `HEURISTIC`)."""

  backend: str
  config: Any
  source: str


def check_name(backend: str | None) -> None:
  """Raises ValueError unless `backend` is None or one of `NAMES`."""
  if backend is not None and backend not in NAMES:
    raise ValueError(f"backend must be None or one of {', '.join(map(repr, NAMES))}, got {backend!r}")


_SCOPED: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxkern_backend", default=None)


@contextlib.contextmanager
def scope(backend: str | None) -> Iterator[str | None]:
  """`with jaxkern.backend(name):` every `jaxkern.ops` call in the block that
  passes no `backend=` (or `backend=None`) runs on `name` (one of `NAMES`;
  None restores the automatic default: `"pallas"` on a GPU, `"xla"`
  without). A call's own `backend=` wins over the scope.

  Scopes nest (the innermost holds; leaving it restores the outer one, also
  on an exception) and are per thread and per asyncio task: the setting is
  a `contextvars.ContextVar`. A thread started inside a scope does not
  inherit it (Python starts threads in an empty context): it sees the
  automatic default unless it enters its own scope, or runs in a copy of
  the starting context (`contextvars.copy_context().run`).

  The backend is chosen when an op is traced: a `jax.jit` function traced
  inside one scope keeps that choice for its cached trace (jit again, or
  pass `backend=` explicitly, to change it). Raises ValueError for an
  unknown name."""
  check_name(backend)
  token = _SCOPED.set(backend)
  try:
    yield backend
  finally:
    _SCOPED.reset(token)


def scoped() -> str | None:
  """The backend of the innermost `scope` around this call (None outside any)."""
  return _SCOPED.get()


def _matching(kernels: Mapping[str, Kernel], config: Any, op: str) -> list[str]:
  found = [b for b, k in kernels.items() if isinstance(config, k.config_class)]
  if not found:
    classes = ", ".join(f"{b}: {k.config_class.__name__}" for b, k in kernels.items())
    raise TypeError(f"{op}: config {type(config).__name__} is no config of its kernels ({classes})")
  return found


def order(
  kernels: Mapping[str, Kernel],
  backend: str,
  *,
  op: str,
  config: Any = None,
  tuned: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
  """The backends to try, in order, for `backend` (a kernel backend or
  `"pallas"`); `tuned`: the tuned entries of this shape bucket by backend.
  Raises ValueError naming the op's backends when `backend` is not one."""
  if backend != PALLAS and backend not in kernels:
    raise ValueError(f"{op} has no {backend!r} kernel; its backends: {', '.join(kernels)} (and 'xla', 'pallas')")
  candidates = list(kernels) if backend == PALLAS else [backend]
  if config is not None:
    return _matching({b: kernels[b] for b in candidates}, config, op)
  tuned = tuned or {}
  fastest = sorted(
    (b for b in tuned if b in candidates),
    key=lambda b: (tuned[b].get("latency_ms") is None, tuned[b].get("latency_ms") or 0.0),
  )
  return list(dict.fromkeys([*fastest[:1], *candidates]))


def bucket_of(
  kernels: Mapping[str, Kernel],
  shapes: Mapping[str, Any],
  const_axes: Mapping[str, int],
  axis_params: Mapping[str, str],
) -> str:
  """The tuned table's shape bucket of a call: the inputs' shapes and the
  constant values the default kernel's heuristic takes (`tuning.shape_bucket`)."""
  first = next(iter(kernels.values()))
  return tuning.shape_bucket(shapes, bound_values(first.choose_config, const_axes, axis_params))


def select(
  kernels: Mapping[str, Kernel],
  shapes: Mapping[str, Any],
  *,
  op: str,
  const_axes: Mapping[str, int] | None = None,
  axis_params: Mapping[str, str] | None = None,
  backend: str = PALLAS,
  config: Any = None,
  tuned: bool = True,
  device_kind: str | None = None,
) -> Iterator[Choice]:
  """The `Choice` of each backend to try for a call on `shapes` (input name
  -> array or `jax.ShapeDtypeStruct`), in order (module docstring); lazily,
  so a backend's heuristic runs only when that backend is reached."""
  const_axes, axis_params = dict(const_axes or {}), dict(axis_params or {})
  first = next(iter(kernels.values()))
  entries = {}
  if tuned and config is None:
    entries = tuning.lookup(first.name, bucket_of(kernels, shapes, const_axes, axis_params), device_kind)
  for name in order(kernels, backend, op=op, config=config, tuned=entries):
    kernel = kernels[name]
    if config is not None:
      yield Choice(name, config, tuning.EXPLICIT)
    elif name in entries:
      yield Choice(name, tuning.config_from_json(entries[name]["config"], kernel.config_class()), tuning.TUNED)
    else:
      yield Choice(name, bind_axes(kernel.choose_config, const_axes, axis_params)(shapes), tuning.HEURISTIC)


def first_supported(
  choices: Iterator[Choice],
  call: Callable[[Choice], Any],
  *,
  op: str,
  kernels: Mapping[str, Kernel],
  refused: list[str] | None = None,
) -> tuple[Choice, Any]:
  """(choice, `call(choice)`) for the first choice whose kernel takes the
  inputs; raises `Unsupported` naming the op's backends and each refusal
  when none does. `refused` (optional) collects `"<backend>: <why>"` of
  each kernel that refused before the one that ran."""
  refused = [] if refused is None else refused
  for choice in choices:
    try:
      return choice, call(choice)
    except Unsupported as e:
      refused.append(f"{choice.backend}: {e}")
  raise Unsupported(f"{op}: no kernel takes these inputs (backends: {', '.join(kernels)}); " + "; ".join(refused))
