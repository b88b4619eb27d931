"""3-D neighborhood attention (SPEC 4.7): `neighborhood_attention_3d_h{H}_d64_kt{KT}_ky{KY}_kx{KX}`.

NATTEN semantics (stride 1, dilation 1, non-causal): along each axis of
length `L` with window `k`, query `i` sees keys `[s, s + k)` with
`s = clamp(i - k // 2, 0, L - k)` (shifted inward at the borders, never
padded); softmax over the Cartesian product of the three windows, in fp32,
one rounding at the end. `q` is captured after query scaling: no extra scale.

The window sizes are constant axes of the definitions, not inputs: the
reference, the kernel launcher and the config functions take them as
keyword-only parameters named like the axes (`KT`, `KY`, `KX`), which the
registry fills from the definition. Kernel:
`pallas_kernels.neighborhood_attention`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkern import dispatch, roofline
from jaxkern.contract import Checks, public_op
from jaxkern.family import OpImpl, cdiv, varying_like
from jaxkern.spmd import CONTRACTION, Split
from pallas_kernels.neighborhood_attention import KERNELS
from pallas_kernels.neighborhood_attention import triton as kernel_lib

# The reference processes query t-planes in groups of at most this many
# `[B, tc, Y, X, H, D]` elements (at least one plane): fp32 accumulator and
# gathered K, V of that size are its temporaries (0.12 GiB at the largest
# recorded grid, one plane of 4x80x128x4x64, by XLA:CPU's memory analysis).
_REF_GROUP_ELEMENTS = 1 << 24

# cpu_axes: scored (query, key, head) triples the kernel may compute in
# interpret mode for one workload, about a second's worth on two cores
# (docs/perf/cpu_budgets.md); B shrinks to 1 and the extents towards `k + 1`
# until the budget holds (see `cpu_axes`).
_CPU_TRIPLE_BUDGET = 48_000_000


# ---------------------------------------------------------------------------
# Reference.


def window_starts(length: int, k: int) -> jax.Array:
  """int32 `[length]`: NATTEN's window start `clamp(i - k // 2, 0, length - k)`."""
  return jnp.clip(jnp.arange(length, dtype=jnp.int32) - k // 2, 0, length - k)


def neighborhood_attention_3d_reference(q, k, v, *, KT: int, KY: int, KX: int) -> jax.Array:
  """`o[b,t,y,x,h] = sum_n softmax_n(q . k_n) v_n` over the `KT*KY*KX`
  neighbours `n` of `(t, y, x)`, fp32, rounded once to `q.dtype`.

  Memory stays bounded: query t-planes are processed in groups (a loop)
  of at most `_REF_GROUP_ELEMENTS` query elements, and within a group the
  neighbour offsets are visited one at a time (`fori_loop`) with a running
  max and sum (exact softmax in fp32, up to rounding): one `[B, tc, Y, X, H, D]`
  fp32 accumulator, never a `[queries, neighbours, D]` tensor.
  """
  batch, t_len, y_len, x_len, num_heads, head_dim = q.shape
  if q.size == 0:  # B = 0 or H = 0 (or D = 0): nothing to attend
    return jnp.zeros(q.shape, q.dtype)
  starts_t, starts_y, starts_x = (window_starts(n, w) for n, w in ((t_len, KT), (y_len, KY), (x_len, KX)))
  plane = batch * y_len * x_len * num_heads * head_dim
  group = max(1, min(t_len, _REF_GROUP_ELEMENTS // plane))
  num_groups = cdiv(t_len, group)

  def one_group(g):
    t = jnp.minimum(g * group + jnp.arange(group, dtype=jnp.int32), t_len - 1)
    q_g = q[:, t].astype(jnp.float32)  # [B, tc, Y, X, H, D]

    def neighbours(x, dt, dy, dx):
      """x at each query's neighbour (dt, dy, dx) of its window."""
      x = jnp.take(x, starts_t[t] + dt, axis=1)
      x = jnp.take(x, starts_y + dy, axis=2)
      return jnp.take(x, starts_x + dx, axis=3).astype(jnp.float32)

    def step(n, carry):
      o, m, l = carry
      dt, dy, dx = n // (KY * KX), (n // KX) % KY, n % KX
      s = jnp.sum(q_g * neighbours(k, dt, dy, dx), axis=-1)  # [B, tc, Y, X, H]
      m_next = jnp.maximum(m, s)
      correction = jnp.exp(m - m_next)
      p = jnp.exp(s - m_next)
      o = correction[..., None] * o + p[..., None] * neighbours(v, dt, dy, dx)
      return o, m_next, correction * l + p

    shape = q_g.shape[:-1]
    o, _, l = lax.fori_loop(
      0,
      KT * KY * KX,
      step,
      varying_like(
        (jnp.zeros(q_g.shape, jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32)),
        q,
        k,
        v,
      ),
    )
    return (o / l[..., None]).astype(q.dtype)

  # Groups write into the output in place (no stacked copy of the result).
  out = varying_like(jnp.zeros((batch, num_groups * group, y_len, x_len, num_heads, head_dim), q.dtype), q, k, v)
  out = lax.fori_loop(
    0, num_groups, lambda g, out: lax.dynamic_update_slice_in_dim(out, one_group(g), g * group, axis=1), out
  )
  return out[:, :t_len]


# ---------------------------------------------------------------------------
# Input synthesis.


def make_inputs(axes: Mapping[str, int], key: jax.Array, record: dict | None = None) -> dict[str, jax.Array]:
  """q, k, v `[B, T, Y, X, H, D]` bf16. k, v ~ N(0, 1) (post-norm, post-RoPE
  activations); q ~ N(0, 1) * D**-0.5 (captured after query scaling), so
  the logits q.k have unit variance: neither flat nor one-hot. The records
  carry no structure beyond the axes (`variant` names the grid), so the
  record is not needed."""
  del record
  shape = tuple(int(axes[n]) for n in ("B", "T", "Y", "X", "H", "D"))
  key_q, key_k, key_v = jax.random.split(key, 3)
  q = jax.random.normal(key_q, shape, jnp.float32) * shape[-1] ** -0.5
  return {
    "q": q.astype(jnp.bfloat16),
    "k": jax.random.normal(key_k, shape, jnp.bfloat16),
    "v": jax.random.normal(key_v, shape, jnp.bfloat16),
  }


# ---------------------------------------------------------------------------
# CPU scale.


def _kernel_triples(axes: Mapping[str, int]) -> int:
  """(query, key, head) scores the heuristic's kernel computes at `axes`."""
  dims = (axes["T"], axes["Y"], axes["X"])
  window = (axes["KT"], axes["KY"], axes["KX"])
  shape = jax.ShapeDtypeStruct((axes["B"], *dims, axes["H"], axes["D"]), jnp.bfloat16)
  config = kernel_lib.choose_config({"q": shape}, KT=window[0], KY=window[1], KX=window[2])
  return axes["B"] * axes["H"] * kernel_lib.scored_pairs(config, dims, window)


def cpu_axes(axes: Mapping[str, int]) -> dict[str, int]:
  """A shrunk copy for interpret mode: B at most 2; each extent above its
  window by more than 3 is cut to `k + 2` or `k + 3`, keeping the parity of
  `L - k` (both borders and an interior window position remain),
  then, while over `_CPU_TRIPLE_BUDGET`, B drops to 1 and the extents step
  down (the longest margin first) to `k + 1`; an extent equal to its window
  stays equal. H, D and the windows are kept."""
  out = dict(axes)
  out["B"] = min(int(axes["B"]), 2)
  windows = {"T": axes["KT"], "Y": axes["KY"], "X": axes["KX"]}
  for n, w in windows.items():
    margin = int(axes[n]) - w
    if margin > 3:
      out[n] = w + 2 + margin % 2
  while _kernel_triples(out) > _CPU_TRIPLE_BUDGET:
    if out["B"] > 1:
      out["B"] = 1
      continue
    margins = {n: out[n] - w for n, w in windows.items() if out[n] - w > 1}
    if not margins:
      break
    longest = max(margins, key=margins.__getitem__)
    out[longest] -= 1
  return out


# ---------------------------------------------------------------------------
# Roofline cost (`OpImpl.cost`, see `jaxkern.roofline`).


def neighborhood_attention_3d_cost(definition, axes, *, inputs=None, record=None, config=None):
  """3-D neighborhood attention: each query sees exactly KT*KY*KX keys (NATTEN
  windows are shifted inward at borders, never truncated), so FLOPs
  4 B T Y X H D KT KY KX. Bytes: q, k, v read and o written once (each key
  row is shared by up to KT*KY*KX queries but read once)."""
  n = axes["B"] * axes["T"] * axes["Y"] * axes["X"]
  flops = 4 * n * axes["H"] * axes["D"] * axes["KT"] * axes["KY"] * axes["KX"]
  return roofline.Work(flops, roofline.io_bytes(definition, axes), "bf16")


# ---------------------------------------------------------------------------
# Registration.


# How the op splits across devices (`jaxkern.spmd`): batch and heads; the
# windows of a split T, Y or X axis would reach across shards.
_WINDOW = "neighborhood windows reach across a split of it (a halo exchange would be needed)"
SPLIT = Split(
  inputs={"q": "b t y x h d", "k": "b t y x h d", "v": "b t y x h d"},
  outputs=("b t y x h d",),
  independent="b h",
  reasons={"t": _WINDOW, "y": _WINDOW, "x": _WINDOW, "d": CONTRACTION},
)
IMPL = OpImpl(
  reference=neighborhood_attention_3d_reference,
  kernels=KERNELS,
  make_inputs=make_inputs,
  cpu_axes=cpu_axes,
  cost=neighborhood_attention_3d_cost,
  split=SPLIT,
)
IMPLS = (IMPL,)


# ---------------------------------------------------------------------------
# Public op (`jaxkern.ops`), dispatched by `jaxkern.dispatch`.


def window_of(kernel_size: Any) -> tuple[int, int, int] | None:
  """(KT, KY, KX) of a `kernel_size` (one int, or three); None if it is neither."""
  sizes = (kernel_size,) * 3 if isinstance(kernel_size, (int, np.integer)) else kernel_size
  if not isinstance(sizes, (tuple, list)) or len(sizes) != 3:
    return None
  if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in sizes):
    return None
  return int(sizes[0]), int(sizes[1]), int(sizes[2])


def validate(q, k, v, *, kernel_size, **_) -> None:
  """The contract of `neighborhood_attention_3d` (`jaxkern.contract`): q, k, v
  one shape [B, T, Y, X, H, D] and float dtype; a window that fits the grid."""
  c = Checks("neighborhood_attention_3d")
  c.rank("q", q, "[B, T, Y, X, H, D]", 6)
  c.shape("k", k, q.shape, "[B, T, Y, X, H, D]", "q's shape")
  c.shape("v", v, q.shape, "[B, T, Y, X, H, D]", "q's shape")
  c.floating("q", q)
  c.same_dtype("k", k, "q", q)
  c.same_dtype("v", v, "q", q)
  window = window_of(kernel_size)
  if window is None:
    c.fail("kernel_size", "an int or a (KT, KY, KX) tuple of ints", repr(kernel_size))
    return
  grid = tuple(q.shape[1:4])
  if any(w < 1 or n < w for n, w in zip(grid, window)):
    c.fail("kernel_size", f"a window (KT, KY, KX) with 1 <= each <= the grid (T, Y, X) = {grid}", str(window))


@public_op(validate)
def neighborhood_attention_3d(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  kernel_size: int | tuple[int, int, int],
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> jax.Array:
  """3-D neighborhood attention, NATTEN `na3d` semantics with `scale=1` (q
  already scaled): q, k, v [B, T, Y, X, H, D]; each query attends to the
  `kernel_size` (KT, KY, KX, or one int for all) window around it, shifted
  inward at the borders. Returns o [B, T, Y, X, H, D] in q's dtype.

  Contract: one float dtype (bf16); B, H >= 0; 1 <= KT <= T, KY <= Y,
  KX <= X (the windows must fit: every query sees exactly `KT*KY*KX` keys);
  no masks and no index inputs (`checks=True` has nothing to check);
  non-finite values reach the queries whose windows hold them.
  Differentiable in q, k, v (Pallas: dQ and dK/dV kernels over the
  forward's tiles; `mosaic_gpu` differentiates through the Triton ones).

  Backends: `xla`, `triton`, `mosaic_gpu` (the forward, for bf16 with
  D = 64; other inputs fall back to Triton under `backend="pallas"`)."""
  kt, ky, kx = window_of(kernel_size) or (0, 0, 0)  # validated
  return dispatch.run(
    IMPL,
    {"q": q, "k": k, "v": v},
    const_axes={"KT": kt, "KY": ky, "KX": kx},
    config=config,
    backend=backend,
    checks=checks,
  )
