"""3-D neighborhood attention (SPEC 4.7): the kit's data (launches; edge
cases for the kernel in interpret mode: every recorded window, extents equal
to and just above the window, ragged tiles, tiles larger than the grid,
B > 1) and the family's own checks: the kernel and the reference against a
brute-force float64 NumPy NATTEN, values outside the window, bounded
reference memory at the largest recorded grid, the heuristic, input
synthesis and CPU scaling; the gradients (custom VJP, dQ and dK/dV
kernels) against the XLA path and float64 finite differences, and their
lowering. (The checks themselves: test_definitions.py and kit.py.)"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os

import gradients
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kit import EVERY_CANDIDATE, Case, MosaicGpuCall, TritonCall
from numerics import assert_bf16_close

from jaxkern import ops
from jaxkern.families import neighborhood_attention as fam
from pallas_kernels.neighborhood_attention import tiles
from pallas_kernels.neighborhood_attention import triton as na
from pallas_kernels.neighborhood_attention.config import MosaicNeighborhoodConfig
from pallas_kernels.shared.lowering import lower_for_h100, triton_calls

DEFINITIONS_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "datasets", "definitions")
WORKLOADS_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "datasets", "workloads")
NAMES = (
  "neighborhood_attention_3d_h32_d64_kt3_ky7_kx7",
  "neighborhood_attention_3d_h16_d64_kt3_ky7_kx7",
  "neighborhood_attention_3d_h8_d64_kt3_ky5_kx5",
  "neighborhood_attention_3d_h4_d64_kt11_ky11_kx11",
)
WINDOWS = {"kt3_ky7_kx7": (3, 7, 7), "kt3_ky5_kx5": (3, 5, 5), "kt11_ky11_kx11": (11, 11, 11)}


@functools.cache
def definition(name):
  with open(os.path.join(DEFINITIONS_DIR, f"{name}.json")) as f:
    return json.load(f)


@functools.cache
def records(name):
  with open(os.path.join(WORKLOADS_DIR, f"{name}.jsonl")) as f:
    return [json.loads(line) for line in f]


def const_axes(name):
  return {a: spec["value"] for a, spec in definition(name)["axes"].items() if spec["type"] == "const"}


def window_of(name):
  c = const_axes(name)
  return c["KT"], c["KY"], c["KX"]


def qkv(shape, seed=0, dtype=jnp.bfloat16):
  """q ~ N(0, 1/D) (pre-scaled), k, v ~ N(0, 1); numpy, not jax.random (no
  compilation per shape)."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal(shape, np.float32) * shape[-1] ** -0.5
  k, v = rng.standard_normal((2, *shape), np.float32)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def natten_numpy(q, k, v, window):
  """Brute-force float64 NATTEN na3d with scale 1: per query, gather its
  window `[s, s + k)`, `s = clamp(i - k//2, 0, L - k)` per axis."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  batch, *dims, heads, head_dim = q.shape
  start = lambda i, n, w: min(max(i - w // 2, 0), n - w)
  o = np.zeros_like(q)
  for t, y, x in np.ndindex(*dims):
    box = tuple(slice(start(i, n, w), start(i, n, w) + w) for i, n, w in zip((t, y, x), dims, window))
    keys = k[(slice(None), *box)].reshape(batch, -1, heads, head_dim)
    values = v[(slice(None), *box)].reshape(batch, -1, heads, head_dim)
    s = np.einsum("bhd,bnhd->bhn", q[:, t, y, x], keys)
    p = np.exp(s - s.max(-1, keepdims=True))
    o[:, t, y, x] = np.einsum("bhn,bnhd->bhd", p / p.sum(-1, keepdims=True), values)
  return o


def kernel(q, k, v, window, config=None):
  kt, ky, kx = window
  return na.neighborhood_attention_3d(q, k, v, KT=kt, KY=ky, KX=kx, config=config, interpret=True)


def reference(q, k, v, window):
  kt, ky, kx = window
  return fam.neighborhood_attention_3d_reference(q, k, v, KT=kt, KY=ky, KX=kx)


SMALL_TILE = na.NeighborhoodAttentionConfig(block_t=1, block_y=4, block_x=4, block_k=16, num_warps=1, num_stages=1)


def launches(config, axes):
  """Grid (query tiles, B, H)."""
  tiles = math.prod(-(-axes[n] // b) for n, b in zip("TYX", config.tile))
  return [TritonCall("neighborhood_attention_3d", (tiles, axes["B"], axes["H"]), config.num_warps, config.num_stages)]


def launches_mosaic_gpu(config, axes):
  """One Mosaic GPU call, grid (CTA tiles, H, B), two consumer tiles a CTA
  stacked along y: q, k, v, the queries' window probes `[CTA tiles, 2, 64]`
  and the window bits of a plane's rows `[box lines, box x]` in (x: the
  tile plus the window, rounded up to 8, at most the grid rounded up; the
  lines: the CTA's two tiles plus the window, at most Y, at least a 64-key
  run of one tile's lines); o and lse `[B, H, T, Y, X]` (x a multiple of 4)
  out."""
  b, t, y, x, h, d = (axes[n] for n in ("B", "T", "Y", "X", "H", "D"))
  (bt, by, bx), (ky, kx) = config.tile, (axes["KY"], axes["KX"])
  up = lambda n, m: -(-n // m) * m  # noqa: E731
  box_x = min(up(bx + kx - 1, 8), up(x, 8))
  run = up((by + ky - 1) * box_x, 64)
  box_y = max(min(2 * by + ky - 1, y), -(-run // box_x))
  ctas = -(-t // bt) * -(-y // (2 * by)) * -(-x // bx)
  qkv_type = f"tensor<{b}x{t}x{y}x{x}x{h}x{d}xbf16>"
  operands = (qkv_type,) * 3 + (f"tensor<{ctas}x2x64xi32>", f"tensor<{box_y}x{box_x}xi32>")
  return [MosaicGpuCall(operands, (qkv_type, f"tensor<{b}x{h}x{t}x{y}x{up(x, 4)}xf32>"))]


def case_axes(shape, window):
  """Axes of a problem `[B, T, Y, X, H, D]` with its window (the constants a
  case overrides)."""
  return {**dict(zip(("B", "T", "Y", "X", "H", "D"), shape)), **dict(zip(("KT", "KY", "KX"), window))}


# Kit data: edge cases (kernel in interpret mode vs reference), lowering.
KERNEL_CASES = [
  Case(NAMES[0], case_axes(shape, window), id=label)
  for shape, window, label in [
    ((1, 3, 7, 7, 2, 64), (3, 7, 7), "extents_equal_windows"),  # nothing moves
    ((2, 4, 8, 8, 2, 64), (3, 7, 7), "just_above_b2"),
    ((1, 5, 11, 13, 1, 64), (3, 7, 7), "odd_no_tile_multiples"),
    ((1, 3, 5, 5, 2, 64), (3, 5, 5), "kt3_ky5_kx5_equal"),
    ((3, 6, 9, 17, 1, 64), (3, 5, 5), "b3_ragged"),
    ((1, 11, 11, 11, 1, 64), (11, 11, 11), "grid_is_every_window"),
    ((1, 12, 13, 11, 1, 64), (11, 11, 11), "just_above_on_two_axes"),
    ((2, 3, 20, 9, 1, 64), (3, 7, 7), "t_equal_kt_long_y"),
    ((1, 4, 6, 9, 2, 32), (1, 3, 4), "kt1_even_window_d32"),
    ((2, 1, 2, 3, 1, 16), (1, 2, 3), "six_points_mostly_masked_tile"),
  ]
]
# Tiles larger than the grid (a 64-point tile on a 3x7x7 grid, a 16x1x4 tile
# on 3 planes): most of the tile is off the grid and must not be stored.
_SMALL_GRID = case_axes((2, 3, 7, 7, 1, 64), (3, 7, 7))
_BIG_TILES = [
  na.NeighborhoodAttentionConfig(*tile, block_k=32) for tile in ((4, 4, 4), (16, 1, 4), (1, 1, 16), (1, 1, 32))
]
KERNEL_CASES += [
  Case(NAMES[0], _SMALL_GRID, config=c, id=f"tile_{'x'.join(map(str, c.tile))}_over_grid") for c in _BIG_TILES
]
LOWERING_CASES = [
  Case(NAMES[0], _SMALL_GRID, config=c, id=f"tile_{'x'.join(map(str, c.tile))}_over_grid") for c in _BIG_TILES
]
# Tiles longer than the halo's window bits (34 > 31 points along the axes):
# the halo walk tests packed coordinates instead.
KERNEL_CASES.append(
  Case(
    NAMES[0],
    case_axes((1, 4, 5, 45, 1, 32), (3, 3, 7)),
    id="long_tile_packed_halo_test",
    config=na.NeighborhoodAttentionConfig(1, 1, 32, block_k=32),
  )
)
SWEEP_CASE = Case(NAMES[0], case_axes((1, 4, 9, 11, 1, 64), (3, 7, 7)))
# The Mosaic GPU kernel through the op path (the rest of its edge cases:
# test_neighborhood_attention_mosaic.py): a ragged grid with B = 2 and an
# 11^3 window over a grid of its size, a sweep and lowerings at small grids
# (x neither a multiple of the tile nor of 8).
MOSAIC = "mosaic_gpu"
KERNEL_CASES += [
  Case(
    NAMES[2],
    case_axes((2, 4, 9, 10, 1, 64), (3, 5, 5)),
    config=MosaicNeighborhoodConfig(2, 4, 8, stages=2),
    id="mosaic_ragged_b2",
    backend=MOSAIC,
  ),
  Case(
    NAMES[3],
    case_axes((1, 11, 11, 11, 1, 64), (11, 11, 11)),
    config=MosaicNeighborhoodConfig(16, 1, 4, stages=2),
    id="mosaic_11_cubed_window_is_grid",
    backend=MOSAIC,
  ),
]
SWEEP_CASE_MOSAIC_GPU = Case(NAMES[2], case_axes((1, 3, 5, 8, 1, 64), (3, 5, 5)))
LOWERING_CASES += [
  Case(NAMES[3], case_axes((1, 13, 14, 13, 4, 64), (11, 11, 11)), config=EVERY_CANDIDATE, backend=MOSAIC),
  Case(NAMES[0], _SMALL_GRID, config=MosaicNeighborhoodConfig(4, 4, 4), id="mosaic_tile_over_grid", backend=MOSAIC),
]


# ---------------------------------------------------------------------------
# The kernel against float64 NATTEN, and the window.


@pytest.mark.parametrize("window", list(WINDOWS.values()))
def test_kernel_matches_float64_natten(window):
  shape = (2, *(w + 2 for w in window[:2]), window[2] + 3, 1, 64)
  q, k, v = qkv(shape, seed=1)
  assert_bf16_close(kernel(q, k, v, window, config=SMALL_TILE), natten_numpy(q, k, v, window))


def test_unaffected_by_values_outside_the_window():
  """Keys and values outside every window of a query do not change it:
  poison everything but the first query's window."""
  window = (3, 5, 5)
  q, k, v = qkv((1, 6, 9, 9, 1, 64), seed=4)
  out = kernel(q, k, v, window)
  mask = np.zeros(q.shape, bool)
  mask[:, :3, :5, :5] = True  # query (0, 0, 0) sees exactly this box
  k2 = jnp.where(mask, k, jnp.bfloat16(30.0))
  v2 = jnp.where(mask, v, jnp.bfloat16(-100.0))
  out2 = kernel(q, k2, v2, window)
  np.testing.assert_array_equal(np.asarray(out2[:, 0, 0, 0], np.float32), np.asarray(out[:, 0, 0, 0], np.float32))


@pytest.mark.parametrize(
  "dims,window,tile",
  [
    ((121, 80, 128), (11, 11, 11), (4, 4, 4)),
    ((9, 28, 48), (3, 7, 7), (2, 4, 8)),
    ((5, 6, 7), (2, 3, 4), (1, 8, 8)),
    ((4, 5, 45), (3, 3, 7), (1, 1, 32)),  # packed coordinates: 34 tile points > 31 window bits
  ],
)
def test_halo_slot_tables_are_the_window_test(dims, window, tile):
  """`halo_slots`: every slot's row offset is its box point's flat offset
  and its window test (bits against `window_probe`, or packed coordinates)
  says `0 <= o - rel < k` on every axis for every query start offset `rel`
  in the tile; padding slots pass no test."""
  block_k = 64
  halo = tiles.halo_box(tile, window)
  table = tiles.halo_slots(dims, window, tile, block_k)
  size = math.prod(halo)
  assert len(table.offsets) == -(-size // block_k) * block_k and table.bits == (sum(tile) <= 31)
  coords = np.stack(np.unravel_index(np.arange(size), halo))
  np.testing.assert_array_equal(table.offsets[:size], (coords[0] * dims[1] + coords[1]) * dims[2] + coords[2])
  rels = np.stack(np.meshgrid(*(np.arange(b) for b in tile), indexing="ij")).reshape(3, -1)
  want = np.ones((rels.shape[1], size), bool)
  for axis in range(3):
    d = coords[axis][None, :] - rels[axis][:, None]
    want &= (d >= 0) & (d < window[axis])
  if table.bits:
    probe = np.asarray(tiles.window_probe([jnp.asarray(r) for r in rels], tile))[:, None]
    got = (table.tests[None, :] & probe) == probe
  else:
    got = np.ones((rels.shape[1], len(table.offsets)), bool)
    for axis, offset in enumerate(tiles.unpack(table.tests, table.shifts)):
      d = offset[None, :] - rels[axis][:, None]
      got &= (d >= 0) & (d < window[axis])
  np.testing.assert_array_equal(got[:, :size], want)
  assert not got[:, size:].any() and not table.offsets[size:].any()


@pytest.mark.parametrize(
  "dims,window,tile",
  [((12, 13, 11), (11, 11, 11), (4, 4, 4)), ((9, 10, 17), (3, 7, 7), (2, 4, 8)), ((5, 6, 7), (2, 3, 4), (1, 8, 8))],
)
def test_query_box_slot_tables_are_the_window_test(dims, window, tile):
  """`query_box_slots` with `walk_query_box`'s test: for every key tile
  (edge tiles included), key j and slot o pass iff the query at
  `first_query(first key) + o` is in the grid and its window holds j."""
  box = tiles.query_box(dims, window, tile)
  table = tiles.query_box_slots(dims, window, tile, 64)
  size = math.prod(box)
  offsets = np.stack(tiles.unpack(table.tests, table.shifts))
  np.testing.assert_array_equal(offsets[:, :size], np.stack(np.unravel_index(np.arange(size), box)))
  start = lambda i, n, w: np.clip(i - w // 2, 0, n - w)  # noqa: E731
  for axis, (n, w, b) in enumerate(zip(dims, window, tile)):
    for first in range(0, n, b):
      keys = np.arange(first, min(first + b, n))
      low = np.asarray(tiles.first_query(keys, w)) - int(tiles.first_query(first, w))
      run = np.asarray(tiles.last_query(keys, n, w, np.minimum)) - np.asarray(tiles.first_query(keys, w)) + 1
      got = (offsets[axis][None, :] - low[:, None] >= 0) & (offsets[axis][None, :] - low[:, None] < run[:, None])
      query = int(tiles.first_query(first, w)) + offsets[axis]
      want = (
        (query < n)[None, :]
        & (start(query, n, w)[None, :] <= keys[:, None])
        & (keys[:, None] < start(query, n, w)[None, :] + w)
      )
      want[:, size:] = False  # padding slots
      np.testing.assert_array_equal(got, want, err_msg=f"axis {axis}, key tile at {first}")


# ---------------------------------------------------------------------------
# Reference vs float64 numpy.


@pytest.mark.parametrize(
  "shape,window",
  [
    ((2, 3, 7, 7, 3, 8), (3, 7, 7)),
    ((1, 5, 8, 10, 2, 8), (3, 5, 5)),
    ((1, 11, 12, 11, 1, 4), (11, 11, 11)),
    ((2, 4, 6, 9, 2, 8), (2, 3, 4)),
  ],
)
def test_reference_matches_float64(shape, window):
  q, k, v = qkv(shape, seed=5, dtype=jnp.float32)
  np.testing.assert_allclose(
    np.asarray(reference(q, k, v, window)), natten_numpy(q, k, v, window), atol=2e-5, rtol=1e-4
  )


def test_reference_groups_query_planes(monkeypatch):
  """Grouping of query t-planes (with a partial last group) changes nothing."""
  shape, window = (1, 7, 6, 6, 1, 8), (3, 5, 5)
  q, k, v = qkv(shape, seed=6, dtype=jnp.float32)
  monkeypatch.setattr(fam, "_REF_GROUP_ELEMENTS", 3 * 6 * 6 * 8)  # 3 planes: 3 + 3 + 1
  np.testing.assert_allclose(
    np.asarray(reference(q, k, v, window)), natten_numpy(q, k, v, window), atol=2e-5, rtol=1e-4
  )


def test_window_starts():
  np.testing.assert_array_equal(fam.window_starts(9, 3), [0, 0, 1, 2, 3, 4, 5, 6, 6])
  np.testing.assert_array_equal(fam.window_starts(13, 11), [0] * 6 + [1] + [2] * 6)
  np.testing.assert_array_equal(fam.window_starts(7, 7), [0] * 7)
  np.testing.assert_array_equal(fam.window_starts(6, 4), [0, 0, 0, 1, 2, 2])


def test_reference_memory_is_bounded_at_the_largest_recorded_grid():
  """B=4, T=121, 80x128, 11x11x11, H=4: inputs and output are 0.6 GiB
  each; the reference's temporaries stay under 0.5 GiB (compiled, not run)."""
  sds = jax.ShapeDtypeStruct((4, 121, 80, 128, 4, 64), jnp.bfloat16)
  fn = jax.jit(functools.partial(fam.neighborhood_attention_3d_reference, KT=11, KY=11, KX=11))
  stats = fn.lower(sds, sds, sds).compile().memory_analysis()
  assert stats.temp_size_in_bytes < 1 << 29, stats.temp_size_in_bytes


# ---------------------------------------------------------------------------
# Deviceless lowering for an H100 and the heuristic.


def input_avals(name, axes):
  a = {**axes, **const_axes(name)}
  shape = tuple(a[d] for d in ("B", "T", "Y", "X", "H", "D"))
  sds = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  return {"q": sds, "k": sds, "v": sds}


@pytest.mark.parametrize("name", NAMES)
def test_heuristic_at_every_recorded_size(name):
  window = window_of(name)
  for axes in (r["axes"] for r in records(name)):
    avals = input_avals(name, axes)
    config = na.choose_config(avals, KT=window[0], KY=window[1], KX=window[2])
    candidates = na.candidate_configs(avals, KT=window[0], KY=window[1], KX=window[2])
    assert config == candidates[0] and len(candidates) == len(set(candidates)) >= 4
    assert config.block_queries == 64 and config.num_warps == 4
    dims = (axes["T"], axes["Y"], axes["X"])
    useful = np.prod(window) * np.prod(dims) / na.scored_pairs(config, dims, window)
    # The best 64-point tile's halo share, less edge tiles (kernel docstring).
    assert useful > (0.45 if window == (11, 11, 11) else 0.18), (axes, config, useful)
    # No 64-point tile scores fewer pairs.
    for tile in na._tiles(64, dims):
      other = na.NeighborhoodAttentionConfig(*tile, block_k=64)
      assert na.scored_pairs(other, dims, window) >= na.scored_pairs(config, dims, window)


def test_config_validation():
  with pytest.raises(ValueError):
    na.NeighborhoodAttentionConfig(block_t=3)
  with pytest.raises(ValueError):
    na.NeighborhoodAttentionConfig(block_t=1, block_y=2, block_x=4)  # 8 points
  with pytest.raises(ValueError):
    na.NeighborhoodAttentionConfig(block_k=8)
  q, k, v = qkv((1, 3, 6, 7, 1, 64))
  with pytest.raises(ValueError):  # Y < KY
    kernel(q, k, v, (3, 7, 7))
  with pytest.raises(ValueError):
    kernel(q, k[..., :32], v, (3, 5, 5))
  with pytest.raises(ValueError):
    kernel(q[..., :24], k[..., :24], v[..., :24], (3, 5, 5))


# ---------------------------------------------------------------------------
# Family plumbing, input synthesis, CPU scale, the public op.


def test_impl_signatures_follow_the_contract():
  [impl] = fam.IMPLS
  for name in NAMES:
    assert definition(name)["reference"] == (
      "jaxkern.families.neighborhood_attention:neighborhood_attention_3d_reference"
    )
  inputs = list(definition(NAMES[0])["inputs"])
  for fn in (impl.reference, impl.default.launch):
    params = inspect.signature(fn).parameters
    positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    keyword_only = [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY]
    assert positional == inputs
    # Keyword-only parameters named like const axes receive their values.
    assert {"KT", "KY", "KX"} <= set(keyword_only)
  for fn in (impl.default.choose_config, impl.default.candidate_configs):
    params = inspect.signature(fn).parameters
    assert [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY] == ["KT", "KY", "KX"]


@pytest.mark.parametrize("name", NAMES)
def test_make_inputs_match_definition(name):
  [impl] = fam.IMPLS
  spec = definition(name)
  axes = {
    **const_axes(name),
    "B": 2,
    "T": const_axes(name)["KT"] + 1,
    "Y": const_axes(name)["KY"],
    "X": const_axes(name)["KX"] + 4,
  }
  a = impl.make_inputs(axes, jax.random.key(5), records(name)[0])
  b = impl.make_inputs(axes, jax.random.key(5), None)
  c = impl.make_inputs(axes, jax.random.key(6), None)
  assert list(a) == list(spec["inputs"])
  for input_name, tensor in spec["inputs"].items():
    assert a[input_name].shape == tuple(axes[d] for d in tensor["shape"])
    assert a[input_name].dtype == jnp.dtype(tensor["dtype"])
    np.testing.assert_array_equal(np.asarray(a[input_name], np.float32), np.asarray(b[input_name], np.float32))
    assert not np.array_equal(np.asarray(a[input_name], np.float32), np.asarray(c[input_name], np.float32))
  q, k = np.asarray(a["q"], np.float32), np.asarray(a["k"], np.float32)
  assert 0.9 < q.std() * 8 < 1.1 and 0.9 < k.std() < 1.1  # q carries the D**-0.5


@pytest.mark.parametrize("name", NAMES)
def test_cpu_axes_keep_structure(name):
  [impl] = fam.IMPLS
  window = dict(zip(("T", "Y", "X"), window_of(name)))
  cases = [{**r["axes"], **const_axes(name)} for r in records(name)]
  cases.append({**const_axes(name), "B": 3, **window})  # extents == windows
  cases.append({**const_axes(name), "B": 1, **{n: w + 1 for n, w in window.items()}})
  for full in cases:
    small = impl.cpu_axes(full)
    assert set(small) == set(full)
    assert all(small[n] == full[n] for n in ("H", "D", "KT", "KY", "KX"))
    assert 1 <= small["B"] <= min(full["B"], 2)
    for n, w in window.items():
      assert w <= small[n] <= full[n]
      assert (small[n] == w) == (full[n] == w)  # a still window stays still
      if full[n] - w > 3:
        assert small[n] - w >= 2  # borders and an interior remain
    assert fam._kernel_triples(small) <= fam._CPU_TRIPLE_BUDGET


def test_public_op_jits_on_both_backends():
  q, k, v = qkv((2, 4, 7, 9, 2, 64), seed=7)
  want = reference(q, k, v, (3, 5, 5))
  for backend in ("xla", "pallas"):
    f = jax.jit(functools.partial(ops.neighborhood_attention_3d, kernel_size=(3, 5, 5), backend=backend))
    assert_bf16_close(f(q, k, v), want)
  cube = ops.neighborhood_attention_3d(
    q[:, :3, :5, :5], k[:, :3, :5, :5], v[:, :3, :5, :5], kernel_size=3, backend="xla"
  )
  assert_bf16_close(cube, reference(q[:, :3, :5, :5], k[:, :3, :5, :5], v[:, :3, :5, :5], (3, 3, 3)))


# ---------------------------------------------------------------------------
# Gradients (custom VJP: dQ and dK/dV kernels over the forward's tiles).

SMALL_BWD = na.NeighborhoodAttentionBwdConfig(
  dq=SMALL_TILE,
  dkdv=na.NeighborhoodAttentionConfig(block_t=2, block_y=2, block_x=4, block_k=16, num_warps=1, num_stages=1),
)
GRAD_CASES = [  # (shape, window), ragged against both tilings
  ((1, 3, 7, 7, 2, 64), (3, 7, 7)),  # extents equal to the window: every query sees every key
  ((2, 4, 8, 9, 1, 64), (3, 5, 5)),
  ((1, 5, 6, 11, 1, 32), (1, 3, 5)),  # a window of 1 along T
  ((1, 2, 3, 17, 2, 16), (2, 3, 3)),  # even windows
]


def kernel_grad_fn(window, config=SMALL_TILE, backward_config=SMALL_BWD):
  kt, ky, kx = window
  return lambda q, k, v: na.neighborhood_attention_3d(  # noqa: E731
    q, k, v, KT=kt, KY=ky, KX=kx, config=config, backward_config=backward_config, interpret=True
  )


@pytest.mark.parametrize("shape,window", GRAD_CASES, ids=lambda x: "x".join(map(str, x)))
def test_kernel_gradients_match_xla_under_jit(shape, window):
  q, k, v = qkv(shape, seed=sum(shape))
  got = gradients.grads(kernel_grad_fn(window), (q, k, v), (0, 1, 2))
  want = gradients.grads(functools.partial(reference, window=window), (q, k, v), (0, 1, 2))
  gradients.assert_grads_close(got, want, ("dq", "dk", "dv"))


def test_public_op_gradients_match_xla_and_run_backward_kernels():
  q, k, v = qkv((1, 4, 7, 9, 2, 64), seed=5)
  op = lambda backend: functools.partial(
    ops.neighborhood_attention_3d,
    kernel_size=(3, 5, 5),  # noqa: E731
    backend=backend,
  )
  gradients.assert_grads_close(
    gradients.grads(op("pallas"), (q, k, v), (0, 1, 2)),
    gradients.grads(op("xla"), (q, k, v), (0, 1, 2)),
    ("dq", "dk", "dv"),
  )
  weights = gradients.weights_like(q.shape)
  names = gradients.pallas_calls(jax.grad(gradients.loss(op("pallas"), weights), (0, 1, 2)), q, k, v)
  assert sorted(names) == [
    "neighborhood_attention_3d",
    "neighborhood_attention_3d_bwd_dkdv",
    "neighborhood_attention_3d_bwd_dq",
  ]
  # Only the kernel a gradient needs launches.
  assert (
    gradients.pallas_calls(jax.grad(gradients.loss(op("pallas"), weights), 0), q, k, v)[-1]
    == "neighborhood_attention_3d_bwd_dq"
  )


def natten64(q, k, v, window):
  """float64 NATTEN (scale 1), vectorized over queries: each query's window
  as flat key indices."""
  batch, *dims, heads, head_dim = q.shape
  starts = [np.clip(np.arange(n) - w // 2, 0, n - w) for n, w in zip(dims, window)]
  offsets = np.stack(np.meshgrid(*(np.arange(w) for w in window), indexing="ij"), -1).reshape(-1, 3)
  points = np.stack(np.meshgrid(*(np.arange(n) for n in dims), indexing="ij"), -1).reshape(-1, 3)
  neighbours = np.stack([s[points[:, a]] for a, s in enumerate(starts)], -1)[:, None] + offsets[None]  # [N, W, 3]
  index = np.ravel_multi_index(tuple(np.moveaxis(neighbours, -1, 0)), dims)  # [N, W]
  flat = lambda a: a.reshape(batch, -1, heads, head_dim)  # noqa: E731
  kw, vw = flat(k)[:, index], flat(v)[:, index]  # [B, N, W, H, D]
  s = np.einsum("bnhd,bnwhd->bnhw", flat(q), kw)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bnhw,bnwhd->bnhd", p / p.sum(-1, keepdims=True), vw).reshape(q.shape)


def test_gradients_match_float64_finite_differences():
  """float32 inputs through the kernel (interpret mode, small tiles) against
  central differences of float64 NATTEN; the float64 NATTEN itself against
  the brute-force one."""
  shape, window = (1, 3, 4, 5, 1, 16), (3, 3, 3)
  q, k, v = (np.asarray(x, np.float64) for x in qkv(shape, seed=11, dtype=jnp.float32))
  np.testing.assert_allclose(natten64(q, k, v, window), natten_numpy(q, k, v, window), rtol=1e-12, atol=1e-12)
  weights = gradients.weights_like(shape)
  got = jax.grad(gradients.loss(kernel_grad_fn(window), weights), (0, 1, 2))(
    *(jnp.asarray(x, jnp.float32) for x in (q, k, v))
  )
  want = gradients.finite_difference_grads(
    functools.partial(natten64, window=window), [q, k, v], np.asarray(weights, np.float64)
  )
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-4, atol=1e-4)


def backward_launches(name, axes):
  """The forward (writing lse) and the two backward kernels of the
  heuristic's configs: grids (tiles, B, H) over their tilings."""
  a = {**axes, **const_axes(name)}
  window = window_of(name)
  avals = input_avals(name, axes)
  bwd = na.choose_backward_config(avals, KT=window[0], KY=window[1], KX=window[2])
  call = lambda kernel, c: TritonCall(kernel, launches(c, a)[0].grid, c.num_warps, c.num_stages)  # noqa: E731
  return [
    call("neighborhood_attention_3d", na.choose_config(avals, KT=window[0], KY=window[1], KX=window[2])),
    call("neighborhood_attention_3d_bwd_dq", bwd.dq),
    call("neighborhood_attention_3d_bwd_dkdv", bwd.dkdv),
  ]


@pytest.mark.parametrize("name", NAMES)
def test_backward_lowers_at_the_largest_recorded_size(name):
  axes = max((r["axes"] for r in records(name)), key=lambda a: a["B"] * a["T"] * a["Y"] * a["X"])
  window = window_of(name)
  avals = input_avals(name, axes)
  loss = lambda q, k, v: jnp.sum(
    na.neighborhood_attention_3d(  # noqa: E731
      q, k, v, KT=window[0], KY=window[1], KX=window[2], interpret=False
    ).astype(jnp.float32)
  )
  calls = triton_calls(lower_for_h100(jax.grad(loss, (0, 1, 2)), avals["q"], avals["k"], avals["v"]))
  assert sorted(calls) == sorted(backward_launches(name, axes))
