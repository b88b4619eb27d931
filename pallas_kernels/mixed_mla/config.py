"""Configs of the mixed_mla kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.config_rules import KernelConfig, field, instance_of, pow2
from pallas_kernels.shared.split_kv import CombineStage, SplitStage


CHUNK = 128   # dims per FP8 scale group, and per dequantization chunk
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
