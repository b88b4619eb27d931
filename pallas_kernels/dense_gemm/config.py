"""Configs of the dense_gemm kernels (the dataclasses their launchers, heuristics
and sweeps share)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from pallas_kernels.shared import device
from pallas_kernels.shared.config_rules import (
  DOT_BLOCK,
  NUM_STAGES,
  NUM_WARPS,
  KernelConfig,
  Rule,
  at_least,
  field,
  one_of,
)
from pallas_kernels.shared.mosaic_gpu import NUM_CONSUMERS


@dataclasses.dataclass(frozen=True)
class DenseGemmConfig(KernelConfig):
  """Tiling of the NT GEMM; `group_m` M-tiles per group in the grouped
  program order."""

  block_m: int = field(128, DOT_BLOCK)
  block_n: int = field(256, DOT_BLOCK)
  block_k: int = field(64, DOT_BLOCK)
  group_m: int = field(8, at_least(1))
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(3, NUM_STAGES)


def _multiple_of_64(minimum: int) -> Rule:
  return Rule(
    f"a multiple of 64 >= {minimum}",
    lambda v, _: isinstance(v, int) and not isinstance(v, bool) and v >= minimum and v % 64 == 0,
  )


def _grid_rule() -> Rule:
  return Rule(
    "None (the device's SM count) or an int >= 1",
    lambda v, _: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
  )


@dataclasses.dataclass(frozen=True)
class MosaicGemmConfig(KernelConfig):
  """Tiling of the warp-specialized NT GEMM.

  `block_m x block_n` is the CTA tile, split between the two consumer
  warpgroups along `split` ("m": each owns block_m / 2 rows, "n": block_n / 2
  columns); `block_k` the K step; `stages` the shared-memory ring depth;
  `group_m` M-tiles per group in the grouped tile order; `epilogue_n` the
  width of one TMA store; `grid` the persistent CTA count (None: the SM
  count, `num_sms()`)."""

  block_m: int = field(128, _multiple_of_64(64))
  block_n: int = field(256, _multiple_of_64(64))
  block_k: int = field(64, one_of(64, 128))
  stages: int = field(4, at_least(2))
  group_m: int = field(8, at_least(1))
  split: str = field("m", one_of("m", "n"))
  epilogue_n: int = field(64, one_of(64, 128))
  grid: int | None = field(None, _grid_rule())

  @property
  def consumer_tile(self) -> tuple[int, int]:
    """(rows, cols) of C one consumer warpgroup accumulates per tile."""
    if self.split == "m":
      return self.block_m // NUM_CONSUMERS, self.block_n
    return self.block_m, self.block_n // NUM_CONSUMERS

  @property
  def accumulator_elements(self) -> int:
    rows, cols = self.consumer_tile
    return rows * cols

  @property
  def shared_memory_bytes(self) -> int:
    """The ring (A and B per slot) plus the epilogue slots, in bytes (the
    barriers add a few dozen bytes)."""
    ring = self.stages * (self.block_m + self.block_n) * self.block_k * 2
    epilogue = NUM_CONSUMERS * 2 * self.consumer_tile[0] * self.epilogue_n * 2
    return ring + epilogue

  @property
  def consumer_rows(self) -> int:
    return self.consumer_tile[0]

  @property
  def consumer_cols(self) -> int:
    return self.consumer_tile[1]

  # A consumer's fp32 accumulator takes accumulator_elements / 128 registers
  # per thread: 128 leaves room under 232 for addresses and the epilogue.
  _derived_rules = {
    "accumulator_elements": (Rule("<= 16384 (128 fp32 registers per consumer thread)", lambda v, _: v <= 128 * 128),),
    "consumer_rows": (Rule("a multiple of 64 (wgmma's M per warpgroup)", lambda v, _: v % 64 == 0),),
    "consumer_cols": (
      Rule("a multiple of epilogue_n and <= 256 (wgmma's N)", lambda v, c: v % c.epilogue_n == 0 and v <= 256),
    ),
    "shared_memory_bytes": (
      Rule(f"<= {device.SHARED_MEMORY_PER_BLOCK} (227 KiB per CTA)", lambda v, _: v <= device.SHARED_MEMORY_PER_BLOCK),
    ),
  }


class DenseGemmSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""

  m: int
  n: int
  k: int

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> DenseGemmSizes:
    m, k = shapes["A"].shape
    return cls(int(m), int(shapes["B"].shape[0]), int(k))


def tile_coords(pid, num_pid_m: int, num_pid_n: int, group_m: int):
  """Maps the 1-D program id to (tile_m, tile_n) in grouped order.

  Programs walk `group_m` M-tiles down one N column before moving right, so
  concurrently running programs share B tiles (and A tiles across columns).
  """
  programs_per_group = group_m * num_pid_n
  group = lax.div(pid, programs_per_group)
  first_m = group * group_m
  group_rows = jnp.minimum(num_pid_m - first_m, group_m)
  within = lax.rem(pid, programs_per_group)
  return first_m + lax.rem(within, group_rows), lax.div(within, group_rows)
