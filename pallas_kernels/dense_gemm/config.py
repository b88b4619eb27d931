"""Configs of the dense_gemm kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.config_rules import DOT_BLOCK, KernelConfig, NUM_STAGES, NUM_WARPS, at_least, field


@dataclasses.dataclass(frozen=True)
class DenseGemmConfig(KernelConfig):
  """Tiling of the NT GEMM; `group_m` M-tiles per group in the grouped
  program order."""
  block_m: int = field(128, DOT_BLOCK)
  block_n: int = field(256, DOT_BLOCK)
  block_k: int = field(64, DOT_BLOCK)
  group_m: int = field(8, at_least(1))
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(3, NUM_STAGES)
