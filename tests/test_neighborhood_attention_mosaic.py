"""The Mosaic GPU neighborhood attention forward
(`pallas_kernels.neighborhood_attention.mosaic_gpu`): its box geometry
against brute force (every consumer's run holds every key its windows
reach, the window bits are the window test), interpret-mode runs against the
family's reference and its lse against a jnp one on ragged grids, grids
smaller than a tile plus the window, window = grid, windows of 1, B and
H = 1 and several configs; the gradient through the Triton backward; the
refusals; the H100 lowering of every candidate at recorded sizes; and
synchronization faults the interpreter catches. (The kit's cases for this
backend: test_neighborhood_attention.py.)"""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mosaic_faults import assert_interpreter_reports, assert_race_detected
from numerics import assert_bf16_close, assert_f32_close

from jaxkern.families.neighborhood_attention import neighborhood_attention_3d_reference
from pallas_kernels.neighborhood_attention import boxes
from pallas_kernels.neighborhood_attention import mosaic_gpu as na
from pallas_kernels.neighborhood_attention.tiles import WINDOW_BITS
from pallas_kernels.shared.kernel import Unsupported
from pallas_kernels.shared.lowering import lower_for_h100
from pallas_kernels.shared.online_softmax import LOG2_E

C = na.MosaicNeighborhoodConfig


def qkv(shape, seed=0, dtype=jnp.bfloat16):
  """q ~ N(0, 1/D) (pre-scaled), k, v ~ N(0, 1)."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal(shape, np.float32) * shape[-1] ** -0.5
  k, v = rng.standard_normal((2, *shape), np.float32)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def starts(n, k):
  return np.clip(np.arange(n) - k // 2, 0, n - k)


def lse_reference(q, k, window):
  """`[B, H, T, Y, X]` log2 of sum exp(q . k) over each query's window."""
  batch, *dims, heads, head_dim = q.shape
  offsets = np.stack(np.meshgrid(*(np.arange(w) for w in window), indexing="ij"), -1).reshape(-1, 3)
  points = np.stack(np.meshgrid(*(np.arange(n) for n in dims), indexing="ij"), -1).reshape(-1, 3)
  first = np.stack([starts(n, w)[points[:, a]] for a, (n, w) in enumerate(zip(dims, window))], -1)
  index = np.ravel_multi_index(tuple(np.moveaxis(first[:, None] + offsets[None], -1, 0)), dims)
  flat = lambda a: a.reshape(batch, -1, heads, head_dim).astype(jnp.float32)  # noqa: E731
  s = jnp.einsum("bnhd,bnwhd->bhnw", flat(q), flat(k)[:, index], precision=jax.lax.Precision.HIGHEST)
  return (jax.nn.logsumexp(s, axis=-1) * LOG2_E).reshape(batch, heads, *dims)


def check(shape, window, config=None, seed=0):
  """o (SPEC 5 bf16) and lse (f32 rule) of one launch against the references."""
  q, k, v = qkv(shape, seed=seed)
  config = config or na.choose_config({"q": q}, KT=window[0], KY=window[1], KX=window[2])
  o, lse = jax.jit(functools.partial(na._forward, window=window, config=config, interpret=True))(q, k, v)
  assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (shape[0], shape[4], *shape[1:4])
  kt, ky, kx = window
  assert_bf16_close(o, neighborhood_attention_3d_reference(q, k, v, KT=kt, KY=ky, KX=kx))
  assert_f32_close(lse, lse_reference(q, k, window))


# ---------------------------------------------------------------------------
# Geometry (NumPy, every tile position).


GEOMETRY = [
  ((121, 80, 128), (11, 11, 11), (8, 2, 4)),
  ((49, 112, 192), (11, 11, 11), (4, 4, 4)),
  ((13, 14, 14), (11, 11, 11), (2, 2, 16)),
  ((9, 28, 48), (3, 7, 7), (2, 2, 16)),
  ((17, 20, 32), (3, 5, 5), (2, 4, 8)),
  ((3, 7, 7), (3, 7, 7), (4, 4, 4)),  # window = grid
  ((2, 3, 5), (1, 1, 1), (4, 4, 4)),  # windows of 1, grid smaller than a tile
  ((5, 6, 9), (2, 3, 4), (1, 8, 8)),  # even windows
]


@pytest.mark.parametrize("dims,window,tile", GEOMETRY)
def test_every_consumer_run_holds_every_key_its_windows_reach(dims, window, tile):
  """For every CTA row of tiles and consumer: the box holds every window of
  the CTA's queries (in-grid), and the run (its rows of a plane) holds
  every line those of the consumer reach; runs are whole chunks of 64-key
  multiples starting on an (8, 64) tile."""
  for keys in (256, 128, 64):
    plan = boxes.plan(dims, window, tile, keys)
    y_len, ky, (bt, by, bx) = dims[1], window[1], tile
    et, ey, ex = plan.extents
    assert ex % boxes.ROW_TILE == 0 and plan.run % boxes.KEY_QUANTUM == 0 and plan.run <= plan.plane_rows
    assert sum(k for _, k in plan.chunks) == plan.run and all(k % 64 == 0 and k <= keys for _, k in plan.chunks)
    for axis, block, extent in ((0, bt, et), (1, 2 * by, ey), (2, bx, ex)):
      n, k = dims[axis], window[axis]
      for first in range(0, n, block):
        origin = int(boxes.box_origin(first, n, k, extent))
        queries = np.arange(first, min(first + block, n))
        assert origin == 0 or origin + extent <= n
        assert starts(n, k)[queries].min() >= origin and starts(n, k)[queries].max() + k <= origin + extent
    for first in range(0, y_len, 2 * by):
      origin = int(boxes.box_origin(first, y_len, ky, ey))
      for c in range(boxes.CONSUMERS):
        lines = np.arange(first + c * by, first + (c + 1) * by)
        lines = np.minimum(lines, y_len - 1)
        start = int(plan.run_start(min(first + c * by, y_len - 1), origin))
        assert start % boxes.ROW_TILE == 0 and 0 <= start <= plan.plane_rows - plan.run
        need_lo = (starts(y_len, ky)[lines].min() - origin) * ex
        need_hi = (starts(y_len, ky)[lines].max() + ky - origin) * ex
        assert start <= need_lo and need_hi <= start + plan.run, (first, c)


@pytest.mark.parametrize("dims,window,tile", GEOMETRY)
def test_window_bits_are_the_window_test(dims, window, tile):
  """`row_bits` against every probe of every tile (`probes`) and the t
  bits of every plane (`plane_bits`, per row): visible iff the key's box
  coordinates lie in the query's window on each axis."""
  plan = boxes.plan(dims, window, tile, 256)
  (wt, wy, wx), (et, ey, ex) = plan.widths, plan.extents
  assert wt + wy + wx <= WINDOW_BITS
  bits = plan.row_bits()
  probe = np.asarray(boxes.probes(plan))  # [tiles, 2, 64]
  o_y, o_x = np.arange(ey * ex) // ex, np.arange(ey * ex) % ex
  (bt, by, bx), (kt, ky, kx) = tile, window
  tiles = plan.tiles
  # The tiles at and next to both borders of each axis (the interior repeats them).
  near_borders = [sorted({i for i in (0, 1, n - 2, n - 1) if 0 <= i < n}) for n in tiles]
  for tt, ty, tx in itertools.product(*near_borders):
    tile_index = (tt * tiles[1] + ty) * tiles[2] + tx
    origin = [
      int(boxes.box_origin(f, n, k, e))
      for f, n, k, e in zip((tt * bt, ty * 2 * by, tx * bx), dims, window, plan.extents)
    ]
    for c in range(2):
      rt, ry, rx = np.unravel_index(np.arange(64), tile)
      q = [np.minimum(f + r, n - 1) for f, r, n in zip((tt * bt, ty * 2 * by + c * by, tx * bx), (rt, ry, rx), dims)]
      rel = [starts(n, k)[qa] - o for qa, n, k, o in zip(q, dims, window, origin)]
      p = probe[tile_index, c][:, None]
      yx = (bits[None, :] & (p & ~((1 << wt) - 1))) == (p & ~((1 << wt) - 1))
      want = ((o_y[None] - rel[1][:, None] >= 0) & (o_y[None] - rel[1][:, None] < ky)) & (
        (o_x[None] - rel[2][:, None] >= 0) & (o_x[None] - rel[2][:, None] < kx)
      )
      np.testing.assert_array_equal(yx, want)
      for plane in range(et):
        sees = (probe[tile_index, c] & int(boxes.plane_bits(plane, kt, wt))) != 0
        np.testing.assert_array_equal(sees, (plane - rel[0] >= 0) & (plane - rel[0] < kt))


# ---------------------------------------------------------------------------
# Interpret mode against the references.


@pytest.mark.parametrize(
  "shape,window,config",
  [
    pytest.param((2, 5, 11, 13, 1, 64), (3, 5, 5), None, id="ragged_b2_heuristic"),
    pytest.param((1, 3, 7, 7, 2, 64), (3, 7, 7), C(2, 2, 16, stages=2), id="window_is_grid_h2"),
    pytest.param((1, 2, 3, 5, 1, 64), (1, 1, 1), C(4, 4, 4, stages=2), id="window_1_grid_below_tile"),
    pytest.param((1, 4, 6, 9, 1, 64), (1, 3, 4), C(1, 8, 8, max_chunk_keys=64), id="kt1_even_window_chunks_64"),
    pytest.param(
      (1, 4, 9, 11, 1, 64), (3, 5, 5), C(2, 4, 8, max_chunk_keys=64, ping_pong=False), id="no_ping_pong_chunks"
    ),
  ],
)
def test_matches_reference(shape, window, config):
  check(shape, window, config, seed=sum(shape))


def test_op_path_and_gradient_through_the_triton_backward():
  """The launcher (custom VJP): the forward's output, and dq, dk, dv from
  the Triton backward given this kernel's lse, against the XLA reference's
  gradients."""
  import gradients

  window = (3, 3, 5)
  q, k, v = qkv((1, 3, 4, 7, 1, 64), seed=11)
  config = C(2, 4, 8, stages=2)
  fn = functools.partial(na.neighborhood_attention_3d, KT=3, KY=3, KX=5, config=config, interpret=True)
  ref = functools.partial(neighborhood_attention_3d_reference, KT=3, KY=3, KX=5)
  assert_bf16_close(jax.jit(fn)(q, k, v), ref(q, k, v))
  got = gradients.grads(fn, (q, k, v), (0, 1, 2))
  want = gradients.grads(ref, (q, k, v), (0, 1, 2))
  gradients.assert_grads_close(got, want, ("dq", "dk", "dv"))
  del window


def test_empty_batch_or_heads():
  for shape in ((0, 3, 5, 5, 1, 64), (1, 3, 5, 5, 0, 64)):
    q, k, v = qkv(shape)
    o = na.neighborhood_attention_3d(q, k, v, KT=3, KY=5, KX=5, interpret=True)
    assert o.shape == shape


@pytest.mark.parametrize(
  "change,error,match",
  [
    (lambda q, k, v: (q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)), Unsupported, "bfloat16"),
    (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]), Unsupported, "D=32"),
    (lambda q, k, v: (q, k[:, :2], v), ValueError, "do not match"),
  ],
)
def test_refusals(change, error, match):
  q, k, v = change(*qkv((1, 3, 5, 5, 1, 64)))
  with pytest.raises(error, match=match):
    na.neighborhood_attention_3d(q, k, v, KT=3, KY=5, KX=5, interpret=True)


def test_config_over_shared_memory_or_window_bits_is_refused():
  q, k, v = qkv((1, 3, 5, 40, 1, 64))
  with pytest.raises(ValueError, match="window bits"):
    na._forward(q, k, v, window=(3, 5, 5), config=C(1, 2, 32), interpret=True)
  q, k, v = qkv((1, 3, 30, 30, 1, 64))
  with pytest.raises(ValueError, match="shared memory"):
    na._forward(q, k, v, window=(3, 7, 7), config=C(2, 8, 4, stages=4), interpret=True)


# ---------------------------------------------------------------------------
# Lowering for an abstract H100.


RECORDED = [
  ((4, 121, 80, 128, 4, 64), (11, 11, 11)),
  ((4, 49, 112, 192, 4, 64), (11, 11, 11)),
  ((4, 9, 28, 48, 16, 64), (3, 7, 7)),
  ((4, 69, 40, 64, 8, 64), (3, 5, 5)),
]


@pytest.mark.parametrize("shape,window", RECORDED, ids=lambda x: "x".join(map(str, x)))
def test_every_candidate_lowers_for_h100_at_recorded_sizes(shape, window):
  sds = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  candidates = na.candidate_configs({"q": sds}, KT=window[0], KY=window[1], KX=window[2])
  assert candidates[0] == na.choose_config({"q": sds}, KT=window[0], KY=window[1], KX=window[2])
  for config in candidates:
    fn = functools.partial(
      na.neighborhood_attention_3d, KT=window[0], KY=window[1], KX=window[2], config=config, interpret=False
    )
    assert "mosaic_gpu_v2" in lower_for_h100(fn, sds, sds, sds), config


def test_heuristic_at_11_cubed():
  """The recorded 11^3 grids: 64-query consumer tiles scoring a third or
  more of their pairs usefully, one 256-key chunk a plane, the ring within
  the SM's shared memory."""
  for dims in ((121, 80, 128), (49, 112, 192), (49, 80, 128)):
    sds = jax.ShapeDtypeStruct((1, *dims, 4, 64), jnp.bfloat16)
    config = na.choose_config({"q": sds}, KT=11, KY=11, KX=11)
    plan = na.box_plan(dims, (11, 11, 11), config)
    assert math.prod(dims) * 11**3 / plan.scored_pairs() > 0.33, (dims, config)
    assert len(plan.chunks) == 1 and na.shared_memory_bytes(plan, config) <= 232448


# ---------------------------------------------------------------------------
# Synchronization faults the interpreter catches.


def faulty_launch(fault):
  """The launch with `fault` on the fault problem (2 stages, so planes reuse
  ring slots), a thunk for `mosaic_faults`."""
  q, k, v = qkv((1, 5, 6, 9, 1, 64), seed=3)
  return lambda: na._forward(q, k, v, window=(3, 3, 3), config=C(4, 2, 8, stages=2), interpret=True, fault=fault)


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_plane_released_by_one_consumer_is_caught():
  """`k_empty` counting one arrival instead of one per consumer lets the
  producer refill a plane before the other consumer scored it; the
  interpreter reports the barrier phases running ahead of their waiters."""
  assert_interpreter_reports(faulty_launch("release_once"), "phase")


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_ping_pong_rendezvous_counted_once_is_caught():
  """`turn` completing a phase on one arrival instead of both consumers'
  lets a consumer's waits run ahead of the rendezvous they belong to."""
  assert_interpreter_reports(faulty_launch("turn_once"), "phase")


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_plane_released_without_commit_smem_only_the_race_detector_catches():
  """A consumer's read of a plane (the generic proxy, in interpret mode)
  released with no `commit_smem()` before the producer's next TMA into the
  slot (the async proxy): the race detector reports the TMA write against
  the read; the barriers alone see nothing wrong."""
  assert_race_detected(faulty_launch("uncommitted"), na.__name__)
