"""Configs of the qsa_sparse_gqa kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.config_rules import DOT_BLOCK, KernelConfig, field, instance_of, pow2
from pallas_kernels.shared.split_kv import SplitStage


@dataclasses.dataclass(frozen=True)
class QsaDecodeConfig(KernelConfig):
  """`split`: a key slot is one id slot (C tokens): `block_k` slots per
  step (C * block_k tokens, fitted to >= 16 for the dots), `keys_per_split`
  slots per program; `block_h` is the kv head's query group, padded to >= 16
  (fitted, not a choice). `block_dv`: value columns per split program (D /
  block_dv programs share a split's ids). `merge_block`: splits per step of
  the merge that the last split program of each (sequence, kv head, value
  block) runs (`split_kv.merge_splits`)."""

  split: SplitStage = field(
    SplitStage(block_k=16, keys_per_split=64, num_warps=4, num_stages=2), instance_of(SplitStage)
  )
  block_dv: int = field(256, DOT_BLOCK)
  merge_block: int = field(4, pow2())
