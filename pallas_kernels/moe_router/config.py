"""Configs of the moe_router kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.config_rules import (
  DOT_BLOCK,
  NUM_STAGES,
  NUM_WARPS,
  KernelConfig,
  Rule,
  at_least,
  field,
  instance_of,
  pow2,
)


@dataclasses.dataclass(frozen=True)
class RouterGemmStage(KernelConfig):
  """The logits GEMM: `block_m` tokens x `block_e` experts per program,
  `block_d` hidden columns per step, `split_d` requested D ranges (their
  partial logits summed by the epilogue)."""

  block_m: int = field(64, DOT_BLOCK)
  block_e: int = field(128, DOT_BLOCK)
  block_d: int = field(64, DOT_BLOCK)
  split_d: int = field(1, at_least(1))
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(3, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class RouterEpilogueStage(KernelConfig):
  """The reduce + routing: `block_m` rows routed at once, their several
  [rows, next_pow2(E)] fp32/bool temporaries in registers (16 rows need 8
  warps to stay spill-free on sm_90a, 8 rows fit 4). There is no dot here,
  so any power of two of rows works (decode uses 1 row). Two launches: the
  reduce-and-route kernel's row tile and warps; one launch: the rows the
  last GEMM program of a row block routes per step, on the GEMM's warps."""

  block_m: int = field(16, pow2())
  num_warps: int = field(8, NUM_WARPS)


# One launch runs the routing on the launch's (the GEMM stage's) warps.
_ONE_WARP_COUNT = Rule(
  "True: with one_launch, epilogue.num_warps must equal gemm.num_warps (one launch, one warp count)",
  lambda v, _: v is True,
)


@dataclasses.dataclass(frozen=True)
class MoeRouterConfig(KernelConfig):
  """Tiling of the router, one part per kernel. `one_launch`: the GEMM
  and the routing in one kernel (the last GEMM program of each row block
  reduces its partial logits and routes it); otherwise two launches, the
  GEMM, then the reduce-and-route kernel."""

  gemm: RouterGemmStage = field(RouterGemmStage(), instance_of(RouterGemmStage))
  epilogue: RouterEpilogueStage = field(RouterEpilogueStage(), instance_of(RouterEpilogueStage))
  one_launch: bool = field(False, instance_of(bool))

  _derived_rules = {"warps_consistent": (_ONE_WARP_COUNT,)}

  @property
  def warps_consistent(self) -> bool:
    return not self.one_launch or self.epilogue.num_warps == self.gemm.num_warps
