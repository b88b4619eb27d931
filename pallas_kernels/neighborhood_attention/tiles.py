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

Coordinates past the grid are clamped for the address and masked by the
window test (keys) or an in-grid test (queries): such rows are computed but
never stored and never counted.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp
import numpy as np

from pallas_kernels.shared.common import cdiv

Dims = tuple[int, int, int]


def window_start(i, length: int, k: int):
  """NATTEN's window start `clamp(i - k // 2, 0, length - k)`."""
  return jnp.minimum(jnp.maximum(i - k // 2, 0), length - k)


def first_query(j, k: int):
  """The first query whose window holds key `j` (`s(i) > j - k`): 0 for
  `j < k`, else `j - k + k // 2 + 1` (ints or arrays)."""
  return (j >= k) * (j - k + k // 2 + 1)


def last_query(j, length: int, k: int, minimum=jnp.minimum):
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
  return tuple(extent(n, k, b) for n, k, b in zip(dims, window, tile))


def halo_box(tile: Dims, window: Dims) -> Dims:
  """Extents of the key box of a query tile: `block + k - 1` per axis."""
  return tuple(b + w - 1 for b, w in zip(tile, window))


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


def in_window(key, start, k: int):
  """`0 <= key - start < k` as one unsigned compare."""
  return as_unsigned(key - start) < k


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
  first = (lax.div(pid, tiles_y * tiles_x) * tile[0], lax.rem(lax.div(pid, tiles_x), tiles_y) * tile[1],
           lax.rem(pid, tiles_x) * tile[2])
  offsets = unravel(jnp.arange(math.prod(tile), dtype=jnp.int32), tile)
  points = [f + o for f, o in zip(first, offsets)]
  in_grid = (points[0] < dims[0]) & (points[1] < dims[1]) & (points[2] < dims[2])
  coords = tuple(jnp.minimum(p, n - 1) for p, n in zip(points, dims))
  return TilePoints(first, coords, flat_rows(coords, dims), in_grid)


def walk_halo(step: Callable[..., Any], carry: Any, k_ref, v_ref, queries: TilePoints, dims: Dims,
              window: Dims, tile: Dims, block_k: int) -> Any:
  """Folds `step(k, v, visible, carry)` over the halo of a query tile in
  chunks of `block_k` keys: `k`, `v` `[block_k, D]` gathered from the
  `[N, D]` refs, `visible [P, block_k]` the window test.

  The box starts at the tile's first window start on each axis; each
  query's window starts `rel` into it, `rel` in `[0, block - 1]` (`s` grows
  by at most 1 per index), so `block + k - 1` keys per axis cover it.
  Clamped duplicates and the last chunk's padding lie outside every
  window."""
  box = [window_start(f, n, w) for f, n, w in zip(queries.first, dims, window)]
  rel = [(window_start(c, n, w) - b)[:, None] for c, n, w, b in zip(queries.coords, dims, window, box)]
  halo = halo_box(tile, window)

  def body(chunk, carry):
    offsets = unravel(chunk * block_k + jnp.arange(block_k, dtype=jnp.int32), halo)
    rows = flat_rows([jnp.minimum(b + o, n - 1) for b, o, n in zip(box, offsets, dims)], dims)
    visible = (in_window(offsets[0][None, :], rel[0], window[0])
               & in_window(offsets[1][None, :], rel[1], window[1])
               & in_window(offsets[2][None, :], rel[2], window[2]))
    return step(k_ref[rows, :], v_ref[rows, :], visible, carry)

  return lax.fori_loop(0, cdiv(math.prod(halo), block_k), body, carry)


def walk_query_box(step: Callable[..., Any], carry: Any, keys: TilePoints, dims: Dims, window: Dims,
                   tile: Dims, block_q: int) -> Any:
  """Folds `step(rows, visible, carry)` over the queries that may see a key
  of the tile, in chunks of `block_q`: `rows [block_q]` the queries' grid
  rows (clamped), `visible [P, block_q]` (key, query) pairs in the query's
  window, False for queries past the grid or the box."""
  box = [first_query(f, w) for f, w in zip(keys.first, window)]
  extents = query_box(dims, window, tile)
  size = math.prod(extents)

  def body(chunk, carry):
    flat = chunk * block_q + jnp.arange(block_q, dtype=jnp.int32)
    points = [b + o for b, o in zip(box, unravel(flat, extents))]
    coords = [jnp.minimum(p, n - 1) for p, n in zip(points, dims)]
    ok = (flat < size) & (points[0] < dims[0]) & (points[1] < dims[1]) & (points[2] < dims[2])
    visible = ok[None, :]
    for key, query, n, w in zip(keys.coords, coords, dims, window):
      visible &= in_window(key[:, None], window_start(query, n, w)[None, :], w)
    return step(flat_rows(coords, dims), visible, carry)

  return lax.fori_loop(0, cdiv(size, block_q), body, carry)


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
  in_grid = ((first[0] + jnp.arange(tile[0]) < dims[0])[:, None, None]
             & (first[1] + jnp.arange(tile[1]) < dims[1])[None, :, None]
             & (first[2] + jnp.arange(tile[2]) < dims[2])[None, None, :])
  plgpu.store(ref, x, mask=in_grid if x.ndim == 3 else in_grid[..., None])
