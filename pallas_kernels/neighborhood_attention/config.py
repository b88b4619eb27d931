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
  multiple_in,
  one_of,
  pow2,
)


class _Tile:
  """The `block_t x block_y x block_x` query tile of a config."""

  block_t: int
  block_y: int
  block_x: int

  @property
  def tile(self) -> tuple[int, int, int]:
    return (self.block_t, self.block_y, self.block_x)

  @property
  def block_queries(self) -> int:
    return self.block_t * self.block_y * self.block_x


@dataclasses.dataclass(frozen=True)
class NeighborhoodAttentionConfig(_Tile, KernelConfig):
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


@dataclasses.dataclass(frozen=True)
class NeighborhoodAttentionBwdConfig(KernelConfig):
  """Tilings of the backward kernels: `dq` as the forward's (query tiles,
  key chunks); `dkdv` with its tile a key tile and `block_k` the queries
  walked per chunk."""

  dq: NeighborhoodAttentionConfig = field(NeighborhoodAttentionConfig(), instance_of(NeighborhoodAttentionConfig))
  dkdv: NeighborhoodAttentionConfig = field(NeighborhoodAttentionConfig(), instance_of(NeighborhoodAttentionConfig))


@dataclasses.dataclass(frozen=True)
class MosaicNeighborhoodConfig(_Tile, KernelConfig):
  """Tiling of the Mosaic GPU forward: each of a CTA's two consumer
  warpgroups owns a query tile of `block_t x block_y x block_x` = 64 grid
  points (the two stacked along y, `block_x` >= 4: lse rows of 16 bytes);
  the key box comes a t-plane at a time through a ring of `stages` slots,
  and each consumer scores its run of a plane's rows in chunks of at most
  `max_chunk_keys` keys (multiples of 64); `ping_pong`: the consumers take
  turns on the tensor cores (FlashAttention-3's schedule) instead of
  running freely."""

  _derived_rules = {"block_queries": (one_of(64),)}
  block_t: int = field(4, pow2())
  block_y: int = field(4, pow2())
  block_x: int = field(4, pow2(4))
  max_chunk_keys: int = field(256, multiple_in(64, 64, 256))
  stages: int = field(3, at_least(2))
  ping_pong: bool = field(True, instance_of(bool))
