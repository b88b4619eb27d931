"""Static box geometry of the Mosaic GPU neighborhood attention forward
(`mosaic_gpu.py`): the CTA's key box, each consumer's run of box rows, the
chunks a run is scored in, and the window-bit tables of the test. NumPy on
static shapes (trace time), except the per-query probes, which the launcher
builds with jnp from small per-axis tables.

A CTA owns two consumer query tiles of `block_t x block_y x block_x` = 64
points stacked along y (consumer c: lines `[y0 + c * block_y, y0 + (c + 1)
* block_y)`). Its key box covers both tiles' windows: per axis `extent =
block + k - 1` (`2 * block_y + ky - 1` along y), at most the grid's length
on t and y, and along x rounded up to a multiple of 8 (so that every box
line is whole (8, 64) tiles of a wgmma operand). The box starts at the
first query's window start, clamped so that the box ends inside the grid
(`box_origin`): windows shift inward at the borders, so it still covers
them. Where the grid is shorter than the box (x rounded up, or a grid
smaller than the tile), the box reads past its end; TMA fills those keys
with zeros and no window reaches them.

The box is walked plane by plane (t): one TMA box of K and one of V per
plane, `[extent_y, extent_x, D]`, i.e. `plane_rows` keys in C order (line,
x). Both consumers need every plane, but only the lines their own windows
reach, which are consecutive rows of the plane: consumer c scores the run
of `run` rows (`(block_y + ky - 1) * extent_x` rounded up to whole chunks)
that starts at the line its first window starts on (`run_start`, moved back
where it would overrun the plane), in chunks of `chunks` (offset, keys):
multiples of 64 keys (`KEY_QUANTUM`, the K groups of the P V wgmma with
the 128-byte swizzle) of at most `max_chunk_keys`. At 11^3 with 8x2x4
consumer tiles the plane is 14 lines of 16 keys and each consumer scores
12 of them (192 keys) per plane.

Window test (the slot tables' idea, `tiles.halo_slots`): a pair is visible
iff for each axis `0 <= o - r < k`, `o` the key's box coordinate and `r`
the query's window start in box coordinates, `r` in `[0, extent - k]`.
Each key gets one bit per (axis, `r`) that sees it (`widths[axis] =
extent - k + 1` bits per axis, fields in t, y, x order, at most
`WINDOW_BITS` in all) and each query one bit per axis (its probe, `probes`);
the pair is visible iff `key_bits & probe == probe`. The y and x bits of a
plane's rows are a static table (`row_bits`); the t bits are the same for a
whole plane (`plane_bits`, computed in the kernel).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels.neighborhood_attention.tiles import WINDOW_BITS, Dims
from pallas_kernels.shared.common import cdiv

CONSUMERS = 2
# Box extents along x are multiples of this (a wgmma operand's (8, 64) row tile).
ROW_TILE = 8
# A chunk's keys are a multiple of this: the K of the P V wgmma comes in
# groups of the 128-byte swizzle's 64 bf16.
KEY_QUANTUM = 64
# The most keys one chunk may hold (wgmma's largest N).
MAX_CHUNK_KEYS = 256


def window_starts(i, length: int, k: int):
  """NATTEN's window start `clamp(i - k // 2, 0, length - k)` (ints or
  NumPy arrays)."""
  return np.clip(i - k // 2, 0, length - k)


def box_origin(first, length: int, k: int, extent: int):
  """Where a box of `extent` keys starts whose first query is `first`: its
  window start, clamped so that the box ends inside the grid (0 when the
  grid is shorter than the box)."""
  return np.minimum(window_starts(first, length, k), max(length - extent, 0))


@dataclasses.dataclass(frozen=True)
class BoxPlan:
  """The static geometry of one problem and tiling (`plan`).

  `tile`: a consumer's query tile; `extents`: the key box (t, y, x);
  `widths`: window-bit field widths per axis; `run`: the rows of a plane
  each consumer scores; `chunks`: `(offset in the run, keys)` of the run's
  chunks."""

  dims: Dims
  window: Dims
  tile: Dims
  extents: Dims
  widths: Dims
  run: int
  chunks: tuple[tuple[int, int], ...]

  @property
  def tiles(self) -> Dims:
    """CTA tiles per axis (a CTA holds two consumer tiles along y)."""
    (t, y, x), (bt, by, bx) = self.dims, self.tile
    return cdiv(t, bt), cdiv(y, CONSUMERS * by), cdiv(x, bx)

  @property
  def plane_rows(self) -> int:
    """Keys in one plane of the box (a ring slot)."""
    return self.extents[1] * self.extents[2]

  @property
  def max_chunk_keys(self) -> int:
    return max(keys for _, keys in self.chunks)

  def scored_pairs(self) -> int:
    """(query, key) pairs one (batch row, head) scores: every CTA's two
    consumer tiles, each against its run of every plane."""
    return math.prod(self.tiles) * CONSUMERS * math.prod(self.tile) * self.extents[0] * self.run

  def run_start(self, first_line, origin):
    """The first plane row of the run of a consumer whose first query line
    is `first_line` (clamped into the grid) in a box starting at line
    `origin`: the row its first window starts on, moved back so that the
    run ends inside the plane (ints, NumPy or jnp arrays)."""
    y_len, ky = self.dims[1], self.window[1]
    start = jnp.clip(first_line - ky // 2, 0, y_len - ky) - origin
    return jnp.minimum(start * self.extents[2], self.plane_rows - self.run)

  def row_bits(self) -> np.ndarray:
    """`[plane_rows]` int32: the y and x window bits of each key of a plane
    (C order over (line, x))."""
    wt, wy, wx = self.widths
    _, ky, kx = self.window
    rows = np.arange(self.plane_rows)
    o_y, o_x = rows // self.extents[2], rows % self.extents[2]
    bits = np.zeros(rows.shape, np.int64)
    for r in range(wy):
      bits |= ((o_y >= r) & (o_y - r < ky)).astype(np.int64) << (wt + r)
    for r in range(wx):
      bits |= ((o_x >= r) & (o_x - r < kx)).astype(np.int64) << (wt + wy + r)
    return bits.astype(np.int32)


def plane_bits(p, kt: int, width_t: int):
  """The t window bits of plane `p` of the box (bits `r` in `[max(p - kt +
  1, 0), min(p, width_t - 1)]`: the window starts that see the plane);
  ints or traced scalars."""
  low = jnp.maximum(p - kt + 1, 0)
  high = jnp.minimum(p, width_t - 1)
  return (2 << high) - (1 << low)


def plan(dims: Dims, window: Dims, tile: Dims, max_chunk_keys: int) -> BoxPlan:
  """The geometry of a problem (`dims` T, Y, X; `window`) with consumer
  tiles `tile` and chunks of at most `max_chunk_keys` keys (a multiple of
  `KEY_QUANTUM`, at most `MAX_CHUNK_KEYS`). Raises ValueError when the tiling
  does not fit: more than `WINDOW_BITS` window bits, or a box line longer
  than `MAX_CHUNK_KEYS`."""
  if max_chunk_keys % KEY_QUANTUM or not KEY_QUANTUM <= max_chunk_keys <= MAX_CHUNK_KEYS:
    raise ValueError(f"max_chunk_keys={max_chunk_keys} must be a multiple of {KEY_QUANTUM} <= {MAX_CHUNK_KEYS}")
  (t_len, y_len, x_len), (kt, ky, kx), (bt, by, bx) = dims, window, tile
  ex = min(cdiv(bx + kx - 1, ROW_TILE), cdiv(x_len, ROW_TILE)) * ROW_TILE
  if ex > MAX_CHUNK_KEYS:
    raise ValueError(f"tile {tile} with window {window}: a box line of {ex} keys exceeds {MAX_CHUNK_KEYS}")
  run = cdiv((by + ky - 1) * ex, KEY_QUANTUM) * KEY_QUANTUM
  ey = max(min(CONSUMERS * by + ky - 1, y_len), cdiv(run, ex))
  extents = (min(bt + kt - 1, t_len), ey, ex)
  widths = (extents[0] - kt + 1, extents[1] - ky + 1, extents[2] - kx + 1)
  if sum(widths) > WINDOW_BITS:
    raise ValueError(f"tile {tile} with window {window}: {sum(widths)} window bits, more than {WINDOW_BITS}")
  units, per_chunk = run // KEY_QUANTUM, max_chunk_keys // KEY_QUANTUM
  parts = cdiv(units, per_chunk)
  chunks, offset = [], 0
  for i in range(parts):
    keys = (units // parts + (i < units % parts)) * KEY_QUANTUM
    chunks.append((offset, keys))
    offset += keys
  return BoxPlan(dims=dims, window=window, tile=tile, extents=extents, widths=widths, run=run, chunks=tuple(chunks))


def probes(box: BoxPlan):
  """`[tiles, CONSUMERS, 64]` int32 (jnp): each query's probe (one bit per
  axis: its window start in box coordinates, in that axis's field), tiles
  in C order (x fastest), a consumer's queries in C order of its tile.
  Queries past the grid take the last grid point's probe (their rows are
  computed and never stored)."""
  (bt, by, bx), (wt, wy, _) = box.tile, box.widths
  tiles = box.tiles
  fields = (0, wt, wt + wy)

  def axis_bits(axis: int, first, offsets):
    length, k = box.dims[axis], box.window[axis]
    origin = box_origin(first, length, k, box.extents[axis])
    q = np.minimum(first[:, None] + offsets, length - 1)
    return (1 << (window_starts(q, length, k) - origin[:, None] + fields[axis])).astype(np.int32)

  t_bits = axis_bits(0, np.arange(tiles[0]) * bt, np.arange(bt))  # [tiles_t, bt]
  y_first = np.arange(tiles[1]) * CONSUMERS * by
  y_bits = axis_bits(1, y_first, np.arange(CONSUMERS * by)).reshape(tiles[1], CONSUMERS, by)
  x_bits = axis_bits(2, np.arange(tiles[2]) * bx, np.arange(bx))  # [tiles_x, bx]
  t = jnp.asarray(t_bits)[:, None, None, None, :, None, None]
  y = jnp.asarray(y_bits)[None, :, None, :, None, :, None]
  x = jnp.asarray(x_bits)[None, None, :, None, None, None, :]
  return (t | y | x).reshape(math.prod(tiles), CONSUMERS, bt * by * bx)
