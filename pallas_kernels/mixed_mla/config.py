"""Configs of the mixed_mla kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.config_rules import KernelConfig, at_least, field, instance_of, one_of, pow2
from pallas_kernels.shared.split_kv import CombineStage, SplitStage

CHUNK = 128  # dims per FP8 scale group, and per dequantization chunk
HALF = CHUNK // 2


@dataclasses.dataclass(frozen=True)
class MixedMlaSplitStage(SplitStage):
  """`SplitStage` plus `block_d`: output columns per program (a multiple of
  64 dividing D; D = no column split). Every program computes the scores
  over all D dims."""

  block_d: int = field(512, pow2(HALF))


@dataclasses.dataclass(frozen=True)
class MixedMlaDecodeConfig(KernelConfig):
  """`split`: a program gathers `block_k` token slots per step for `block_h`
  heads (both >= 16: dot dimensions) and `block_d` output columns,
  `keys_per_split` slots in all; `combine`: `split_kv.combine_splits`'
  tiling."""

  split: MixedMlaSplitStage = field(MixedMlaSplitStage(), instance_of(MixedMlaSplitStage))
  combine: CombineStage = field(CombineStage(), instance_of(CombineStage))


@dataclasses.dataclass(frozen=True)
class MosaicMixedMlaConfig(KernelConfig):
  """Tiling of the Mosaic GPU mixed MLA decode (all 64 heads of a sequence
  in one wgmma row tile): `block_k` key slots gathered and dequantized per
  step (64 only: the producer's copy into the ring moves 64-row register
  tiles), through a ring of `stages` wgmma-tiled slots; `splits` CTAs per
  sequence over its slot blocks (the FP8 window's, then the FP4 ones; 1 =
  none; more write fp32 partials that `combine`, the shared
  `split_kv.combine_splits`, merges)."""

  block_k: int = field(64, one_of(64))
  stages: int = field(1, at_least(1))
  splits: int = field(1, at_least(1))
  combine: CombineStage = field(CombineStage(block_h=16, block_d=128, block_s=2), instance_of(CombineStage))
