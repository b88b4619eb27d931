"""jaxkern: replay recorded serving workloads on Pallas GPU kernels.

jaxkern.registry   one Op per definition (make_inputs, reference, kernel, compare)
jaxkern.dataset    typed definitions and workloads, validation, import
jaxkern.ops        model-friendly, jit-compatible kernel entry points
jaxkern.replay     the replay app (python -m jaxkern.replay --config configs/replay.py)
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("compare", "dataset", "ops", "registry", "replay")
__all__ = [*_SUBMODULES, "__version__"]


def __getattr__(name: str):
  # Lazy, so that `python -m jaxkern.<module>` does not import it twice.
  if name in _SUBMODULES:
    return importlib.import_module(f"jaxkern.{name}")
  raise AttributeError(f"module 'jaxkern' has no attribute {name!r}")
