"""jaxkern: replay recorded serving workloads on Pallas GPU kernels.

jaxkern.registry   one Op per definition (make_inputs, reference, kernel, compare)
jaxkern.dataset    typed definitions and workloads, validation, import
jaxkern.ops        model-friendly, jit-compatible kernel entry points
jaxkern.replay     the replay app (python -m jaxkern.replay --config configs/replay.py)
jaxkern.backend    `with jaxkern.backend("mosaic_gpu"):` the default backend of every op in a scope
jaxkern.explain    `jaxkern.explain(op, *args)`: the backend, kernel and config a call would run, and why
jaxkern.InputError what every backend of every op raises for inputs outside its contract
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# command_line and contract import no jax: `import jaxkern` imports no jax.
from jaxkern import command_line
from jaxkern.contract import InputError

if TYPE_CHECKING:
  from collections.abc import Callable
  from contextlib import AbstractContextManager

  from jaxkern.dispatch import Explanation

__version__ = "0.1.0"

# A quiet start: skip the CUDA plugin's runtime check on a host with no
# NVIDIA device (`jaxkern.command_line.quiet_cuda_probe`: on a GPU host it
# still runs). It takes effect when jaxkern is imported before jax
# initializes its backends.
command_line.quiet_cuda_probe()

_SUBMODULES = ("compare", "dataset", "ops", "registry", "replay")
__all__ = [*_SUBMODULES, "InputError", "backend", "explain", "__version__"]  # pyright: ignore[reportUnsupportedDunderAll] (it reads only literals)


def backend(name: str | None) -> AbstractContextManager[str | None]:
  """`with jaxkern.backend(name):` sets the default backend of every
  `jaxkern.ops` call in the block (`jaxkern.backends.scope` has the rules:
  nesting, per thread, a call's own `backend=` wins)."""
  from jaxkern import backends

  return backends.scope(name)


def explain(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Explanation:
  """Which backend, kernel and config `op(*args, **kwargs)` would run, and
  why, without running it (`jaxkern.dispatch.explain`)."""
  from jaxkern import dispatch

  return dispatch.explain(op, *args, **kwargs)


def __getattr__(name: str):
  # Lazy, so that `python -m jaxkern.<module>` does not import it twice and
  # `import jaxkern` imports no jax.
  if name in _SUBMODULES:
    return importlib.import_module(f"jaxkern.{name}")
  raise AttributeError(f"module 'jaxkern' has no attribute {name!r}")
