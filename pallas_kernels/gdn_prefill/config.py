"""Configs of the gdn_prefill kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.shared.config_rules import (
  DOT_BLOCK,
  NUM_STAGES,
  NUM_WARPS,
  KernelConfig,
  field,
  instance_of,
  one_of,
)


@dataclasses.dataclass(frozen=True)
class DvStage(KernelConfig):
  """Launch 1: `block_v` columns of dO per program."""

  block_v: int = field(64, DOT_BLOCK)
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(1, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class StateBwdStage(KernelConfig):
  """Launch 2: `block_v` state rows (V) per program, as the forward's state pass."""

  block_v: int = field(32, DOT_BLOCK)
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class ChunkBwdStage(KernelConfig):
  """Launch 3: `block_v` columns of V per step of the program's V loop;
  `solve_block`: block of the triangular inverse (as the forward's)."""

  block_v: int = field(16, DOT_BLOCK)
  solve_block: int = field(16, DOT_BLOCK)
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(1, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class DqkStage(KernelConfig):
  """Launch 4: `block_k` columns of dq and dk per program, `block_v`
  columns of V per step of its V loop."""

  block_k: int = field(32, DOT_BLOCK)
  block_v: int = field(32, DOT_BLOCK)
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(1, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class GdnPrefillBwdConfig(KernelConfig):
  """The backward's chunk (the recomputed forward launches use it too,
  whatever the forward's form) and its four launches."""

  chunk: int = field(64, DOT_BLOCK)
  dv: DvStage = field(DvStage(), instance_of(DvStage))
  state: StateBwdStage = field(StateBwdStage(), instance_of(StateBwdStage))
  chunk_grads: ChunkBwdStage = field(ChunkBwdStage(), instance_of(ChunkBwdStage))
  dqk: DqkStage = field(DqkStage(), instance_of(DqkStage))


_DOT_PRECISIONS = ("bf16x3", "bf16")


_FORMS = ("chunked", "serial")


@dataclasses.dataclass(frozen=True)
class IntraStage(KernelConfig):
  """Launch 1: `block_d` columns of K and V per step of the program's column
  loop (fewer live fp32 tiles); `solve_block`: block of the inverse."""

  block_d: int = field(64, DOT_BLOCK)
  solve_block: int = field(16, DOT_BLOCK)
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(1, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class StateStage(KernelConfig):
  """Launch 2: `block_v` state rows (V) per program; two stages prefetch
  the next chunk's rows while the current one runs."""

  block_v: int = field(32, DOT_BLOCK)
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class OutputStage(KernelConfig):
  """Launch 3: `block_v` output columns (V) per program."""

  block_v: int = field(64, DOT_BLOCK)
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(1, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class SerialStage(KernelConfig):
  """Form "serial": `block_v` state rows per program."""

  block_v: int = field(32, DOT_BLOCK)
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(1, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class GdnPrefillConfig(KernelConfig):
  """`form`: "chunked" (three launches) or "serial" (one); `chunk`: tokens per
  chunk of either form; `dot_precision`: how dots with an fp32 operand are
  split into bf16 dots ("bf16" misses the bf16 output tolerance on
  correlated keys with beta ~ 1 and decay ~ 1: docs/perf/kernel_notes.md).
  The stage of the other form is unused. `backward`: the gradient's
  launches (`gdn_prefill_bwd`), whatever the forward's form."""

  form: str = field("chunked", one_of(*_FORMS))
  chunk: int = field(64, DOT_BLOCK)
  dot_precision: str = field("bf16x3", one_of(*_DOT_PRECISIONS))
  intra: IntraStage = field(IntraStage(), instance_of(IntraStage))
  state: StateStage = field(StateStage(), instance_of(StateStage))
  output: OutputStage = field(OutputStage(), instance_of(OutputStage))
  serial: SerialStage = field(SerialStage(), instance_of(SerialStage))
  backward: GdnPrefillBwdConfig = field(GdnPrefillBwdConfig(), instance_of(GdnPrefillBwdConfig))
