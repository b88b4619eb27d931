"""Configs of the gdn_decode kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.config_rules import NUM_STAGES, NUM_WARPS, KernelConfig, field, pow2


@dataclasses.dataclass(frozen=True)
class GdnDecodeConfig(KernelConfig):
  """`block_v`: state rows (V) per program (capped to V)."""

  block_v: int = field(32, pow2())
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(1, NUM_STAGES)
