"""Configs of the grouped_gemm kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.config_rules import (
  DOT_BLOCK,
  NUM_STAGES,
  NUM_WARPS,
  KernelConfig,
  Rule,
  at_least,
  field,
  instance_of,
  one_of,
  only_with,
)


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig(KernelConfig):
  """Tiling of the grouped GEMM; `block_k` is whole 32-k scale groups;
  `expert_slots` programs share each (row tile, N tile), one expert each
  in turn (more slots: more parallelism for tiles of many experts, more
  programs that find nothing to do). `expert_items`: instead of row tiles,
  items of up to `block_m` rows of one expert from a work list built
  before the launch (each weight tile decoded once per item; the slots
  are unused). `fold_scales`: f16 dots with both operands' scales folded
  in exactly, one accumulation over K (no per-group promotion); items
  whose scales do not fold run the fp8 dots (`triton` module docstring)."""

  block_m: int = field(64, DOT_BLOCK)
  block_n: int = field(128, DOT_BLOCK)
  block_k: int = field(128, one_of(32, 64, 128))
  expert_slots: int = field(2, at_least(1))
  swap_ab: bool = field(False, instance_of(bool))
  expert_items: bool = field(False, instance_of(bool))
  fold_scales: bool = field(False, only_with("expert_items", "swap_ab"))
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(3, NUM_STAGES)


def _grid_rule() -> Rule:
  return Rule(
    "None (the device's SM count) or an int >= 1",
    lambda v, _: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
  )


@dataclasses.dataclass(frozen=True)
class MosaicGroupedGemmConfig(KernelConfig):
  """Tiling of the Mosaic GPU grouped GEMM (`mosaic_gpu` module docstring).

  `block_m`: the most activation rows of one item (one expert's
  consecutive rows), the wgmma's N side; `block_n`: weight rows (output
  columns) of a CTA's unit, split between the two consumer warpgroups in
  64-row wgmma halves; `stages`: the shared-memory ring depth (64 k a
  step); `grid`: the persistent CTA count (None: the SM count)."""

  block_m: int = field(64, one_of(8, 16, 32, 64))
  block_n: int = field(256, one_of(128, 256))
  stages: int = field(4, at_least(2))
  grid: int | None = field(None, _grid_rule())
