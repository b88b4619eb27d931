"""Configs of the neighborhood_attention kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.common import MIN_DOT_DIM
from pallas_kernels.shared.config_rules import (
  DOT_BLOCK,
  NUM_STAGES,
  NUM_WARPS,
  KernelConfig,
  at_least,
  field,
  instance_of,
  pow2,
)


@dataclasses.dataclass(frozen=True)
class NeighborhoodAttentionConfig(KernelConfig):
  """Tiling: a query tile of `block_t x block_y x block_x` grid points (each a
  power of two, `block_queries` >= 16 in all: the rows of both dots), key
  chunks of `block_k` halo keys."""

  _derived_rules = {"block_queries": (at_least(MIN_DOT_DIM),)}
  block_t: int = field(1, pow2())
  block_y: int = field(8, pow2())
  block_x: int = field(8, pow2())
  block_k: int = field(64, DOT_BLOCK)
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)

  @property
  def tile(self) -> tuple[int, int, int]:
    return (self.block_t, self.block_y, self.block_x)

  @property
  def block_queries(self) -> int:
    return self.block_t * self.block_y * self.block_x


@dataclasses.dataclass(frozen=True)
class NeighborhoodAttentionBwdConfig(KernelConfig):
  """Tilings of the backward kernels: `dq` as the forward's (query tiles,
  key chunks); `dkdv` with its tile a key tile and `block_k` the queries
  walked per chunk."""

  dq: NeighborhoodAttentionConfig = field(NeighborhoodAttentionConfig(), instance_of(NeighborhoodAttentionConfig))
  dkdv: NeighborhoodAttentionConfig = field(NeighborhoodAttentionConfig(), instance_of(NeighborhoodAttentionConfig))
