"""Configs of the flash_attention kernels (the dataclasses their launchers, heuristics
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


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig(KernelConfig):
  """Tiling of the forward kernel: `block_q` query rows per program, keys
  walked `block_k` at a time."""

  block_q: int = field(128, DOT_BLOCK)
  block_k: int = field(64, DOT_BLOCK)
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(3, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class FlashAttentionBwdConfig(KernelConfig):
  """Tiling of the backward kernels: a dQ program owns `block_q_dq` query
  rows and walks the keys `block_k_dq` at a time; a dK/dV program owns
  `block_k_dkv` keys and walks the queries `block_q_dkv` at a time."""

  block_q_dq: int = field(64, DOT_BLOCK)
  block_k_dq: int = field(64, DOT_BLOCK)
  block_k_dkv: int = field(64, DOT_BLOCK)
  block_q_dkv: int = field(64, DOT_BLOCK)
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig(KernelConfig):
  """`block_q` query rows per consumer warpgroup (a CTA has two), keys walked
  `block_k` at a time through a ring of `stages` slots; `ping_pong`: the two
  consumers take turns on the tensor cores (one's softmax under the other's
  wgmma, FlashAttention-3's schedule) instead of running freely."""

  block_q: int = field(64, one_of(64))
  block_k: int = field(128, one_of(64, 128))
  stages: int = field(2, at_least(2))
  ping_pong: bool = field(True, instance_of(bool))
