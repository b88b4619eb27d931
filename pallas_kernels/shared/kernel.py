"""A kernel as an object with a backend.

`Kernel` is what one backend module of a family (`pallas_kernels/<family>/
triton.py`, `mosaic_gpu.py`) offers: its launcher, its config class and
heuristic, which lowering it produces and whether it differentiates itself.
A family maps backend -> Kernel (`KERNELS` in `pallas_kernels/<family>/
__init__.py`, in its default order); `jaxkern.dispatch` picks one.

A launcher that cannot take some inputs (a dtype, a shape its tiling does
not cover) raises `Unsupported` while it is traced, before it launches
anything: the dispatch then falls back to the family's next backend.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from pallas_kernels.shared import lowering

TRITON, MOSAIC_GPU = "triton", "mosaic_gpu"
# Kernel backends, each with the custom call its lowering emits and the parser of those calls.
BACKENDS: Mapping[str, Callable[[str], list[Any]]] = {
  TRITON: lowering.triton_calls,
  MOSAIC_GPU: lowering.mosaic_gpu_calls,
}


class Unsupported(ValueError):
  """Raised by a launcher for inputs its backend does not handle (the
  message says which input and what the backend needs)."""


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One backend's kernel of a family.

  `name`: the family (the tuned table's key); `backend`: one of `BACKENDS`;
  `launch(*inputs, config=None, interpret=None, **params)`: the launcher,
  `config=None` meaning its own heuristic; `config_class`: the type of its
  configs; `choose_config(shapes)` / `candidate_configs(shapes)`: the
  heuristic's config and the sweep's candidates (the heuristic's first);
  `own_vjp`: the launcher is a `jax.custom_vjp` with its own backward
  kernels (otherwise `jaxkern.autodiff` differentiates it through the
  family's reference)."""

  name: str
  backend: str
  launch: Callable[..., Any]
  config_class: type
  choose_config: Callable[..., Any]
  candidate_configs: Callable[..., list[Any]]
  own_vjp: bool = False

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"Kernel {self.name!r}: backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")

  def calls(self, stablehlo: str) -> list[Any]:
    """The launches of this backend in a lowered module's text
    (`lowering.lower_for_h100`): `TritonCall`s or `MosaicGpuCall`s."""
    return BACKENDS[self.backend](stablehlo)

  @classmethod
  def of(cls, module: Any, *, launch: Callable[..., Any] | None = None, own_vjp: bool = False) -> Kernel:
    """The kernel of a backend module `pallas_kernels.<family>.<backend>`:
    family and backend from the module's name, `launch` (default: the
    module's `kernel`), its `choose_config` and `candidate_configs`, and
    the config class `choose_config` is annotated to return."""
    family, _, backend = module.__name__.rpartition(".")
    choose = module.choose_config
    config_class = inspect.get_annotations(choose, eval_str=True).get("return")
    if not inspect.isclass(config_class):
      raise TypeError(f"{module.__name__}.choose_config must be annotated to return its config class")
    return cls(
      name=family.rpartition(".")[2],
      backend=backend,
      launch=launch or module.kernel,
      config_class=config_class,
      choose_config=choose,
      candidate_configs=module.candidate_configs,
      own_vjp=own_vjp,
    )


def kernels(*members: Kernel) -> dict[str, Kernel]:
  """A family's backend -> Kernel mapping, in the given (default) order;
  raises on two kernels of one backend or of different families."""
  out: dict[str, Kernel] = {}
  for k in members:
    if k.backend in out:
      raise ValueError(f"two {k.backend} kernels for {k.name}")
    if out and k.name != next(iter(out.values())).name:
      raise ValueError(f"kernels of different families in one mapping: {k.name}, {next(iter(out.values())).name}")
    out[k.backend] = k
  return out
