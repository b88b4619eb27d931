"""Configs of the qsa_sparse_gqa kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.config_rules import DOT_BLOCK, KernelConfig, field, instance_of
from pallas_kernels.shared.split_kv import CombineStage, SplitStage


@dataclasses.dataclass(frozen=True)
class QsaDecodeConfig(KernelConfig):
  """`split`: a key slot is one selected id (C tokens): `block_k` ids per
  step (C * block_k tokens, fitted to >= 16 for the dots), `keys_per_split`
  ids per program; `block_h` is the kv head's query group, padded to >= 16
  (fitted, not a choice). `block_dv`: value columns per split program (D /
  block_dv programs share a split's ids). `combine`: `split_kv.combine_splits`'
  tiling."""
  split: SplitStage = field(SplitStage(block_k=16, keys_per_split=64, num_warps=4, num_stages=2),
                            instance_of(SplitStage))
  combine: CombineStage = field(CombineStage(), instance_of(CombineStage))
  block_dv: int = field(256, DOT_BLOCK)
