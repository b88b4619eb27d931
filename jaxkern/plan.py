"""Run planning (replay side): at which axes, on which inputs and with which
config one recorded workload runs.

Run sizes: `auto` runs the recorded axes on a GPU and the family's
`cpu_axes` without one; `full` always the recorded axes; `smoke` always the
`cpu_axes`. (The replay's config field for it keeps its original name,
`--config.scale`.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from jaxkern import backends, blobs, dataset, registry
from pallas_kernels.shared.common import has_gpu

RUN_SIZES = ("auto", "full", "smoke")


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """How one workload runs: at which axes, on which inputs, with which config."""

  axes: dict[str, int]  # every axis the run uses
  axes_run: dict[str, int]  # the var axes, and const axes that differ from the definition
  scaled: bool  # axes differ from the recorded ones
  inputs: dict[str, jax.Array]
  inputs_source: str  # "blobs" | "synthesized"
  expected: dict[str, jax.Array] | None  # recorded outputs, only at recorded sizes
  choice: backends.Choice  # the kernel backend and config the run uses


def run_axes(op: registry.Op, recorded_axes: Mapping[str, int], size: str, on_gpu: bool) -> dict[str, int]:
  """Axes a workload runs at, from its validated recorded axes: as recorded
  with `full` or with `auto` on a GPU, the family's CPU budget otherwise."""
  if size not in RUN_SIZES:
    raise ValueError(f"run size must be one of {RUN_SIZES}, got {size!r}")
  if size == "full" or (size == "auto" and on_gpu):
    return dict(recorded_axes)
  return op.cpu_axes(recorded_axes, validated=True)


def axes_run(op: registry.Op, axes: Mapping[str, int]) -> dict[str, int]:
  """What a result records of a run's axes: the var axes, and the const axes
  that differ from the definition."""
  const = op.definition.const_axes
  return {k: v for k, v in axes.items() if k not in const or v != const[k]}


def plan(
  op: registry.Op,
  w: dataset.Workload,
  *,
  size: str = "auto",
  seed: int = 0,
  blob_root: str = "",
  on_gpu: bool | None = None,
  config: Any = None,
  tuned: bool = True,
  backend: str | None = None,
) -> RunPlan:
  """Everything needed to run one workload: recorded tensors when the blob
  root has them (always at recorded sizes), else synthesized inputs at the
  run size's axes with the record's scalar inputs where it gives them; and
  the kernel backend (`backend`: a kernel backend, or None / "pallas" for
  the best available) and config, with its source."""
  on_gpu = has_gpu() if on_gpu is None else on_gpu
  recorded_axes = op.validated_axes(w.axes)
  inputs, expected = blobs.load_recorded(op.definition, w, blob_root, recorded_axes)
  if inputs is not None:
    axes, source = recorded_axes, "blobs"
  else:
    axes, source = run_axes(op, recorded_axes, size, on_gpu), "synthesized"
    inputs = jax.block_until_ready(
      {
        **op.make_inputs(axes, seed=seed, record=w.record, allow_shrunk_constants=True),
        **blobs.recorded_scalars(op.definition, w),
      }
    )
  scaled = axes != recorded_axes
  return RunPlan(
    axes=axes,
    axes_run=axes_run(op, axes),
    scaled=scaled,
    inputs=inputs,
    inputs_source=source,
    expected=None if scaled else expected,
    choice=op.config_for(inputs, config, backend=backend, tuned=tuned),
  )
