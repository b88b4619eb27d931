"""Window geometry and tile walks of the 3-D neighborhood attention kernels
(forward, dQ and dK/dV), NATTEN semantics (stride 1, dilation 1,
non-causal).

Along an axis of length `L` with window `k`, query `i` sees keys
`[s(i), s(i) + k)` with `s(i) = clamp(i - k // 2, 0, L - k)`. `s` is
nondecreasing, so the queries that see key `j` are a run
`[first_query(j), last_query(j)]`: `k` queries inside the grid, up to
`k + k // 2` near its borders, where windows shift inward.

* `walk_halo` (forward and dQ): a tile of queries walks the box of keys that
  covers the union of its windows (the halo), gathered `block_k` keys at a
  time, each (query, key) pair tested against the window.
* `walk_query_box` (dK/dV): a tile of keys walks the box of queries that
  covers every query seeing one of its keys, gathered `block_q` queries at
  a time, each pair tested the same way.

Slot tables. A box's shape is static, so everything about its `s`-th slot
(the flat box index, C order) that does not depend on where the box starts
is computed once, at trace time, with NumPy (`halo_slots`,
`query_box_slots`) and passed to the kernel as small int32 operands, read
one chunk at a time: the slot's row offset `(o_t * Y + o_y) * X + o_x`
(so a gathered row is `base + offset`, no division by the box's extents)
and either its window bits (`halo_slots`, tiles of at most 31 points along
the three axes together: one bit per (axis, query start offset) that sees
the slot, so a pair's whole window test is one `and` and one compare) or
its packed box coordinates. Slots past the box (the last chunk's padding)
have offset 0 and coordinates that fail every test.

Rows past the grid: `base + offset` of a slot beyond the grid's end on some
axis is a row of another line of the grid (or past the last row: clamped
to it), never one a window of the tile holds: every such pair fails the
window test (it is done on box coordinates, not rows), so it is computed,
masked, and never counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.shared.common import cdiv

Dims = tuple[int, int, int]


def window_start(i, length: int, k: int):
  """NATTEN's window start `clamp(i - k // 2, 0, length - k)`."""
  return jnp.minimum(jnp.maximum(i - k // 2, 0), length - k)


def first_query(j, k: int):
  """The first query whose window holds key `j` (`s(i) > j - k`): 0 for
  `j < k`, else `j - k + k // 2 + 1` (ints or arrays)."""
  return (j >= k) * (j - k + k // 2 + 1)


def last_query(j, length: int, k: int, minimum: Callable[[Any, Any], Any] = jnp.minimum):
  """The last query whose window holds key `j` (`s(i) <= j`): `L - 1` for
  `j >= L - k`, else `min(j + k // 2, L - 1)` (`np.minimum` for numpy
  arrays: static geometry)."""
  return minimum(j + k // 2 + (j >= length - k) * length, length - 1)


def query_box(dims: Dims, window: Dims, tile: Dims) -> Dims:
  """Static extents of the query box of a key tile: per axis the most
  queries that see some key of one tile (`first_query` of its first key to
  `last_query` of its last), over every tile position."""

  def extent(length, k, block):
    first_keys = np.arange(0, length, block)
    last_keys = np.minimum(first_keys + block, length) - 1
    return int(np.max(last_query(last_keys, length, k, np.minimum) - first_query(first_keys, k))) + 1

  t, y, x = (extent(n, k, b) for n, k, b in zip(dims, window, tile))
  return t, y, x


def halo_box(tile: Dims, window: Dims) -> Dims:
  """Extents of the key box of a query tile: `block + k - 1` per axis."""
  t, y, x = (b + w - 1 for b, w in zip(tile, window))
  return t, y, x


def as_unsigned(x):
  """int32 -> uint32 bits: negative values become >= 2**31."""
  return lax.bitcast_convert_type(x, jnp.uint32)


def unravel(flat, dims: Dims):
  """C-order coordinates of nonnegative flat indices over static `dims`."""
  _, ny, nx = dims
  return lax.div(flat, ny * nx), lax.rem(lax.div(flat, nx), ny), lax.rem(flat, nx)


def flat_rows(coords, dims: Dims):
  """Row indices of the flattened grid `[T * Y * X]` of in-grid coordinates."""
  t, y, x = coords
  return (t * dims[1] + y) * dims[2] + x


def in_window(key, start, k):
  """`0 <= key - start < k` as one unsigned compare (`k` an int or a
  nonnegative int32 array)."""
  return as_unsigned(key - start) < (k if isinstance(k, int) else as_unsigned(k))


class TilePoints(NamedTuple):
  """The grid points of the program's tile (`block_t x block_y x block_x`
  from the first grid axis): first point, coordinates clamped into the
  grid (`[P]` each), their rows and whether each is in the grid."""

  first: tuple[Any, Any, Any]
  coords: tuple[Any, Any, Any]
  rows: Any
  in_grid: Any


def tile_points(dims: Dims, tile: Dims) -> TilePoints:
  """The points of the tile `pl.program_id(0)` (tiles in C order)."""
  tiles_y, tiles_x = cdiv(dims[1], tile[1]), cdiv(dims[2], tile[2])
  pid = pl.program_id(0)
  first = (
    lax.div(pid, tiles_y * tiles_x) * tile[0],
    lax.rem(lax.div(pid, tiles_x), tiles_y) * tile[1],
    lax.rem(pid, tiles_x) * tile[2],
  )
  offsets = unravel(jnp.arange(math.prod(tile), dtype=jnp.int32), tile)
  points = [f + o for f, o in zip(first, offsets)]
  in_grid = (points[0] < dims[0]) & (points[1] < dims[1]) & (points[2] < dims[2])
  t, y, x = (jnp.minimum(p, n - 1) for p, n in zip(points, dims))
  coords = (t, y, x)
  return TilePoints(first, coords, flat_rows(coords, dims), in_grid)


WINDOW_BITS = 31  # bits of an int32 slot mask (the sign bit unused)


class SlotTables(NamedTuple):
  """Static per-slot data of a box walked in chunks (module docstring):
  `offsets` the row offset of each slot; `tests` its window bits
  (`bits=True`) or its packed box coordinates (`shifts` per axis). Both
  `[chunks * chunk]` int32, slots past the box padded."""

  offsets: np.ndarray
  tests: np.ndarray
  bits: bool
  shifts: tuple[int, int, int]


def _slot_offsets(dims: Dims, box: Dims, chunk: int):
  """Box coordinates `[3, size]` of every slot, the padded slot count and
  the row offsets `[slots]` (0 past the box)."""
  size = math.prod(box)
  slots = cdiv(size, chunk) * chunk
  coords = np.stack(np.unravel_index(np.arange(size), box)).astype(np.int64)
  offsets = np.zeros(slots, np.int32)
  offsets[:size] = (coords[0] * dims[1] + coords[1]) * dims[2] + coords[2]
  return coords, slots, offsets


def _packed(coords: np.ndarray, slots: int, limits: Dims) -> tuple[np.ndarray, tuple[int, int, int]]:
  """Coordinates packed into one int32 each (`shifts` per axis, fields wide
  enough for 0..limit), padding slots at each axis's `limit`. A
  ValueError when the fields do not fit in 31 bits (extents near 1024 on
  every axis at once: grids of about 2**30 points)."""
  widths = [int(limit).bit_length() for limit in limits]
  if sum(widths) > WINDOW_BITS:
    raise ValueError(f"box extents {limits} do not pack into {WINDOW_BITS} bits")
  shifts = (widths[1] + widths[2], widths[2], 0)
  packed = np.zeros(slots, np.int64)
  padded = np.array(limits, np.int64)[:, None].repeat(slots, 1)
  padded[:, : coords.shape[1]] = coords
  for axis in range(3):
    packed |= padded[axis] << shifts[axis]
  return packed.astype(np.int32), shifts


def unpack(packed, shifts: tuple[int, int, int]):
  """The three box coordinates of packed slot codes (`_packed`)."""
  t = packed >> shifts[0]
  y = (packed >> shifts[1]) & ((1 << (shifts[0] - shifts[1])) - 1)
  x = packed & ((1 << shifts[1]) - 1)
  return t, y, x


def halo_slots(dims: Dims, window: Dims, tile: Dims, block_k: int) -> SlotTables:
  """Slot tables of a query tile's halo (`walk_halo`). Window bits when the
  tile's sides fit in `WINDOW_BITS`: bit `field(axis) + r` of a slot is set
  iff a query whose window starts `r` into the box on that axis sees it
  (`0 <= o - r < k`), fields in axis order, `tile[axis]` bits each."""
  halo = halo_box(tile, window)
  coords, slots, offsets = _slot_offsets(dims, halo, block_k)
  if sum(tile) > WINDOW_BITS:
    packed, shifts = _packed(coords, slots, halo)
    return SlotTables(offsets, packed, False, shifts)
  bits = np.zeros(slots, np.int64)
  field = 0
  for axis, (block, k) in enumerate(zip(tile, window)):
    for r in range(block):
      seen = (coords[axis] >= r) & (coords[axis] < r + k)
      bits[: coords.shape[1]] |= seen.astype(np.int64) << (field + r)
    field += block
  return SlotTables(offsets, bits.astype(np.int32), True, (0, 0, 0))


def window_probe(rel: Sequence[jax.Array], tile: Dims) -> jax.Array:
  """Each query's bits for `halo_slots`' window bits: one bit per axis,
  `field(axis) + rel[axis]` (`rel` its window starts into the box)."""
  field, probe = 0, 0
  for r, block in zip(rel, tile):
    probe = probe | (1 << (field + r))
    field += block
  return cast(jax.Array, probe)  # an array: the 0 it starts from is OR-ed with rel's three


def query_box_slots(dims: Dims, window: Dims, tile: Dims, block_q: int) -> SlotTables:
  """Slot tables of a key tile's query box (`walk_query_box`): row offsets
  and packed box coordinates (padding at the box's extents)."""
  box = query_box(dims, window, tile)
  coords, slots, offsets = _slot_offsets(dims, box, block_q)
  packed, shifts = _packed(coords, slots, box)
  return SlotTables(offsets, packed, False, shifts)


def slot_operands(tables: SlotTables):
  """The tables as kernel operands and the BlockSpecs (whole, shared by
  every program of a `(tiles, B, H)` grid) that pass them."""
  arrays = [jnp.asarray(tables.offsets), jnp.asarray(tables.tests)]
  return arrays, [pl.BlockSpec(a.shape, lambda i, b, h: (0,)) for a in arrays]


def walk_halo(
  step: Callable[..., Any],
  carry: Any,
  k_ref,
  v_ref,
  slot_refs,
  tables: SlotTables,
  queries: TilePoints,
  dims: Dims,
  window: Dims,
  tile: Dims,
  block_k: int,
) -> Any:
  """Folds `step(k, v, visible, carry)` over the halo of a query tile in
  chunks of `block_k` keys: `k`, `v` `[block_k, D]` gathered from the
  `[N, D]` refs, `visible [P, block_k]` the window test; `slot_refs` the
  `halo_slots` tables' refs, `tables` their static description.

  The box starts at the tile's first window start on each axis; each
  query's window starts `rel` into it, `rel` in `[0, block - 1]` (`s` grows
  by at most 1 per index), so `block + k - 1` keys per axis cover it."""
  offsets_ref, tests_ref = slot_refs
  box = [window_start(f, n, w) for f, n, w in zip(queries.first, dims, window)]
  rel = [window_start(c, n, w) - b for c, n, w, b in zip(queries.coords, dims, window, box)]
  base = flat_rows(box, dims)
  last_row = math.prod(dims) - 1
  if tables.bits:
    probe = window_probe(rel, tile)[:, None]

  def body(chunk, carry):
    slots = pl.ds(chunk * block_k, block_k)
    rows = jnp.minimum(base + offsets_ref[slots], last_row)
    if tables.bits:
      visible = (tests_ref[slots][None, :] & probe) == probe
    else:
      offsets = unpack(tests_ref[slots], tables.shifts)
      visible = (
        in_window(offsets[0][None, :], rel[0][:, None], window[0])
        & in_window(offsets[1][None, :], rel[1][:, None], window[1])
        & in_window(offsets[2][None, :], rel[2][:, None], window[2])
      )
    return step(k_ref[rows, :], v_ref[rows, :], visible, carry)

  return lax.fori_loop(0, len(tables.offsets) // block_k, body, carry)


def walk_query_box(
  step: Callable[..., Any],
  carry: Any,
  slot_refs,
  tables: SlotTables,
  keys: TilePoints,
  dims: Dims,
  window: Dims,
  block_q: int,
) -> Any:
  """Folds `step(rows, visible, carry)` over the queries that may see a key
  of the tile, in chunks of `block_q`: `rows [block_q]` the queries' grid
  rows (`query_box_slots`: rows past the grid belong to no window of these
  keys), `visible [P, block_q]` (key, query) pairs in the query's window.

  Key `j` is seen by the queries `[first_query(j), last_query(j)]` on each
  axis, so with `o` a slot's box coordinate the test is
  `0 <= o - (first_query(j) - box) < last_query(j) - first_query(j) + 1`:
  queries past the grid (`o` beyond `last_query`) and padding slots (`o` at
  the box's extent) fail it."""
  offsets_ref, tests_ref = slot_refs
  box = [first_query(f, w) for f, w in zip(keys.first, window)]
  low = [(first_query(j, w) - b)[:, None] for j, w, b in zip(keys.coords, window, box)]
  runs = [(last_query(j, n, w) - first_query(j, w) + 1)[:, None] for j, n, w in zip(keys.coords, dims, window)]
  base = flat_rows(box, dims)
  last_row = math.prod(dims) - 1

  def body(chunk, carry):
    slots = pl.ds(chunk * block_q, block_q)
    rows = jnp.minimum(base + offsets_ref[slots], last_row)
    offsets = unpack(tests_ref[slots], tables.shifts)
    visible = (
      in_window(offsets[0][None, :], low[0], runs[0])
      & in_window(offsets[1][None, :], low[1], runs[1])
      & in_window(offsets[2][None, :], low[2], runs[2])
    )
    return step(rows, visible, carry)

  return lax.fori_loop(0, len(tables.offsets) // block_q, body, carry)


def tile_spec(dims: Dims, tile: Dims, head_dim: int | None) -> pl.BlockSpec:
  """The block of tile `i` (grid `(tiles, B, H)`, tiles in C order) of one
  (batch row, head): of `[B, T, Y, X, H, D]`, or with `head_dim` None of
  `[B, H, T, Y, X]` (one number per grid point)."""
  tiles_y, tiles_x = cdiv(dims[1], tile[1]), cdiv(dims[2], tile[2])

  def tile_index(i):
    return i // (tiles_y * tiles_x), (i // tiles_x) % tiles_y, i % tiles_x

  if head_dim is None:
    return pl.BlockSpec((None, None, *tile), lambda i, b, h: (b, h, *tile_index(i)))
  return pl.BlockSpec((None, *tile, None, head_dim), lambda i, b, h: (b, *tile_index(i), h, 0))


def store_tile(ref, x, points: TilePoints, dims: Dims, tile: Dims) -> None:
  """Stores `x` (`[P]` or `[P, D]`, rows in tile order) into a `tile_spec`
  block, the grid's points only (a block store: no two lanes write one
  address, as the clamped rows of a scatter would)."""
  x = x.reshape(*tile, *x.shape[1:])
  if not any(n % b for n, b in zip(dims, tile)):
    ref[...] = x
    return
  first = points.first
  in_grid = (
    (first[0] + jnp.arange(tile[0]) < dims[0])[:, None, None]
    & (first[1] + jnp.arange(tile[1]) < dims[1])[None, :, None]
    & (first[2] + jnp.arange(tile[2]) < dims[2])[None, None, :]
  )
  plgpu.store(ref, x, mask=in_grid if x.ndim == 3 else in_grid[..., None])
