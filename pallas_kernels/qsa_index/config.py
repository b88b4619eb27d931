"""Configs of the qsa_index kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.config_rules import (
  DOT_BLOCK,
  NUM_STAGES,
  NUM_WARPS,
  KernelConfig,
  field,
  instance_of,
  multiple_of,
)
from pallas_kernels.shared.radix_select import SelectStage


@dataclasses.dataclass(frozen=True)
class ScoreStage(KernelConfig):
  """Stage 1 tiling: `block_keys` ids per step (also a multiple of the
  page's P keys: checked at launch), `chunk_keys` ids per program."""

  block_keys: int = field(128, DOT_BLOCK)
  chunk_keys: int = field(1024, DOT_BLOCK, multiple_of("block_keys"))
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class QsaIndexConfig(KernelConfig):
  """`score`: stage 1's tiling; `select`: the radix selection's passes."""

  score: ScoreStage = field(ScoreStage(), instance_of(ScoreStage))
  select: SelectStage = field(SelectStage(), instance_of(SelectStage))
