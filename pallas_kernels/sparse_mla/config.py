"""Configs of the sparse_mla kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.config_rules import (
  DOT_BLOCK,
  NUM_STAGES,
  NUM_WARPS,
  KernelConfig,
  at_least,
  field,
  instance_of,
  one_of,
)
from pallas_kernels.shared.split_kv import CombineStage


@dataclasses.dataclass(frozen=True)
class SparseMlaPrefillConfig(KernelConfig):
  """Tiling of the sparse MLA prefill kernel.

  block_h: heads per program (divides H; 64 = one wgmma row tile).
  block_k: index slots (gathered rows) per step.
  block_d: columns per chunk of D (divides D): gathers and dots run per chunk.
  splits: programs per query row over its slot blocks (1 = no split; more
    write partials that `split_kv.combine_splits` merges).
  prefetch: the loop carries the next block's indices, loaded a step before
    its gather; False leaves the index loads to Triton's pipeliner (which
    then stages them through shared memory: fewer registers).
  """

  block_h: int = field(32, DOT_BLOCK)
  block_k: int = field(64, DOT_BLOCK)
  block_d: int = field(128, DOT_BLOCK)
  splits: int = field(1, at_least(1))
  prefetch: bool = field(False, one_of(True, False))
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)
  combine: CombineStage = field(CombineStage(block_h=16, block_d=128, block_s=2), instance_of(CombineStage))


@dataclasses.dataclass(frozen=True)
class MosaicSparseMlaConfig(KernelConfig):
  """Tiling of the Mosaic GPU sparse MLA prefill (64 heads per CTA, one wgmma
  row tile): `block_k` index slots gathered per step, through a ring of
  `stages` wgmma-tiled slots (beside one untiled staging buffer the
  producer gathers into); `splits` CTAs per query row over its slot
  blocks (1 = none; more write fp32 partials that `combine`, the shared
  `split_kv.combine_splits`, merges). `block_k` is 64 only: the
  producer's copy into the ring moves 64-row chunks (Mosaic GPU's WGMMA
  register layout has 64 rows; 32-row steps would need the copy in pairs
  of steps).

  half_slots: each consumer scores half of a step's slots and the two
  swap their row maxima through shared memory (the score wgmma is done
  once, not by both consumers); False: both score all of them. The
  operands then use the 64-byte swizzle ((8, 32)-element tiles), which a
  32-slot probability half fills exactly."""

  block_k: int = field(64, one_of(64))
  stages: int = field(1, at_least(1))
  splits: int = field(1, at_least(1))
  half_slots: bool = field(True, one_of(True, False))
  combine: CombineStage = field(CombineStage(block_h=16, block_d=128, block_s=2), instance_of(CombineStage))
