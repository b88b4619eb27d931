"""3-D neighborhood attention backward on the Pallas Triton lowering.

From the forward's output `o`, its per-query log-sum-exp `lse` (base 2,
`[B, H, T, Y, X]`) and the output cotangent `do`
(`q` arrives pre-scaled: no scale anywhere):

    delta_i = sum_d do_id o_id                 (XLA, one fused reduction)
    p_ij    = exp2(q_i . k_j log2(e) - lse_i)  for j in the window of i, else 0
    dv_j    = sum_i p_ij do_i
    ds_ij   = p_ij (do_i . v_j - delta_i)
    dq_i    = sum_j ds_ij k_j
    dk_j    = sum_i ds_ij q_i

Two kernels over the same tiles as the forward
(`neighborhood_attention_tiles`), fp32 with `p` and `ds` rounded to the
input dtype for their dots:

* `neighborhood_attention_3d_bwd_dq`: grid (query tiles, B, H); walks the
  halo of its query tile exactly as the forward does.
* `neighborhood_attention_3d_bwd_dkdv`: grid (key tiles, B, H); walks the
  box of queries that see some key of its tile (`walk_query_box`), the
  config's `block_k` queries at a time (the roles of the forward's tile and
  chunk swapped).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.neighborhood_attention.config import NeighborhoodAttentionBwdConfig, NeighborhoodAttentionConfig
from pallas_kernels.neighborhood_attention.tiles import (
  Dims,
  SlotTables,
  halo_slots,
  query_box_slots,
  slot_operands,
  store_tile,
  tile_points,
  tile_spec,
  walk_halo,
  walk_query_box,
)
from pallas_kernels.shared import common
from pallas_kernels.shared.common import cdiv
from pallas_kernels.shared.online_softmax import LOG2_E, scaled_minus


def _dq_kernel(
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  offsets_ref,
  tests_ref,
  dq_ref,
  *,
  dims: Dims,
  window: Dims,
  tile: Dims,
  block_k: int,
  tables: SlotTables,
  ptx: bool,
):
  """One query tile of one (batch row, head); `[N, D]` and `[N]` refs, the
  halo's slot tables; `ptx`: inline PTX (compiled, not interpreted)."""
  queries = tile_points(dims, tile)
  q, do = q_ref[queries.rows, :], do_ref[queries.rows, :]
  lse, delta = lse_ref[queries.rows], delta_ref[queries.rows]

  def step(k, v, visible, dq):
    p = jnp.exp2(scaled_minus(jnp.dot(q, k.T, preferred_element_type=jnp.float32), LOG2_E, lse[:, None], ptx=ptx))
    p = jnp.where(visible, p, 0.0)
    ds = p * (jnp.dot(do, v.T, preferred_element_type=jnp.float32) - delta[:, None])
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  dq = walk_halo(
    step,
    jnp.zeros(q.shape, jnp.float32),
    k_ref,
    v_ref,
    (offsets_ref, tests_ref),
    tables,
    queries,
    dims,
    window,
    tile,
    block_k,
  )
  store_tile(dq_ref, dq.astype(dq_ref.dtype), queries, dims, tile)


def _dkdv_kernel(
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  offsets_ref,
  tests_ref,
  dk_ref,
  dv_ref,
  *,
  dims: Dims,
  window: Dims,
  tile: Dims,
  block_q: int,
  tables: SlotTables,
  ptx: bool,
):
  """One key tile of one (batch row, head); `[N, D]` and `[N]` refs, the
  query box's slot tables; `ptx` as `_dq_kernel`'s."""
  keys = tile_points(dims, tile)
  k, v = k_ref[keys.rows, :], v_ref[keys.rows, :]

  def step(rows, visible, carry):
    dk, dv = carry
    q, do = q_ref[rows, :], do_ref[rows, :]
    lse, delta = lse_ref[rows], delta_ref[rows]
    # Transposed scores [P, block_q]: the program's keys are the rows.
    p = jnp.exp2(scaled_minus(jnp.dot(k, q.T, preferred_element_type=jnp.float32), LOG2_E, lse[None, :], ptx=ptx))
    p = jnp.where(visible, p, 0.0)
    dv = dv + jnp.dot(p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    ds = p * (jnp.dot(v, do.T, preferred_element_type=jnp.float32) - delta[None, :])
    return dk + jnp.dot(ds.astype(q.dtype), q, preferred_element_type=jnp.float32), dv

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = walk_query_box(step, (zeros, zeros), (offsets_ref, tests_ref), tables, keys, dims, window, block_q)
  store_tile(dk_ref, dk.astype(dk_ref.dtype), keys, dims, tile)
  store_tile(dv_ref, dv.astype(dv_ref.dtype), keys, dims, tile)


def attention_backward(
  q,
  k,
  v,
  o,
  lse,
  do,
  *,
  window: Dims,
  dq_config: NeighborhoodAttentionConfig,
  dkdv_config: NeighborhoodAttentionConfig,
  interpret: bool,
  need_dq: bool,
  need_dkv: bool,
) -> tuple[jax.Array | None, jax.Array | None, jax.Array | None]:
  """(dq, dk, dv) of `neighborhood_attention_3d` from its inputs, output
  `o`, `lse [B, H, T, Y, X]` and the cotangent `do` (`[B, T, Y, X, H, D]`);
  None where not needed (that kernel does not launch)."""
  batch, *dims, num_heads, head_dim = q.shape
  dims = tuple(dims)
  n = math.prod(dims)
  do = do.astype(q.dtype)
  delta = jnp.einsum("btyxhd,btyxhd->bhtyx", o.astype(jnp.float32), do.astype(jnp.float32)).reshape(batch, num_heads, n)
  flat = lambda a: a.reshape(batch, n, num_heads, head_dim)  # noqa: E731
  rows = pl.BlockSpec((None, n, None, head_dim), lambda i, b, h: (b, 0, h, 0))
  stats = pl.BlockSpec((None, None, n), lambda i, b, h: (b, h, 0))
  inputs = (flat(q), flat(k), flat(v), flat(do), lse.reshape(batch, num_heads, n), delta)
  in_specs = [rows, rows, rows, rows, stats, stats]

  def launch(kernel, config, tables, num_outputs, name):
    spec = tile_spec(dims, config.tile, head_dim)
    slots, slot_specs = slot_operands(tables)
    outs = common.pallas_call(
      functools.partial(kernel, tables=tables, ptx=not interpret),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)] * num_outputs,
      grid=(math.prod(cdiv(d, b) for d, b in zip(dims, config.tile)), batch, num_heads),
      in_specs=[*in_specs, *slot_specs],
      out_specs=[spec] * num_outputs,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name=name,
    )(*inputs, *slots)
    return outs

  dq = dk = dv = None
  if need_dq:
    kernel = functools.partial(_dq_kernel, dims=dims, window=window, tile=dq_config.tile, block_k=dq_config.block_k)
    tables = halo_slots(dims, window, dq_config.tile, dq_config.block_k)
    [dq] = launch(kernel, dq_config, tables, 1, "neighborhood_attention_3d_bwd_dq")
  if need_dkv:
    kernel = functools.partial(
      _dkdv_kernel, dims=dims, window=window, tile=dkdv_config.tile, block_q=dkdv_config.block_k
    )
    tables = query_box_slots(dims, window, dkdv_config.tile, dkdv_config.block_k)
    dk, dv = launch(kernel, dkdv_config, tables, 2, "neighborhood_attention_3d_bwd_dkdv")
  return dq, dk, dv


# ---------------------------------------------------------------------------
# The custom VJP every forward of the family shares.


class Static(NamedTuple):
  """The static arguments of a differentiable forward: the window, the
  forward's config, the backward kernels' configs, interpret mode."""

  window: tuple[int, int, int]
  config: Any
  backward_config: NeighborhoodAttentionBwdConfig
  interpret: bool


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Needed:
  """Which gradients the backward pass makes (residual metadata, no leaves)."""

  dq: bool
  dkv: bool


def with_backward(forward: Callable[..., Any]) -> Callable[..., jax.Array]:
  """`attention(q, k, v, static)`, a `jax.custom_vjp` over `forward(q, k,
  v, static, with_lse)` (`o`, or `(o, lse)` with `with_lse`: lse `[B, H, T,
  Y, X]` base 2, the Triton forward's semantics) whose backward is
  `attention_backward` with `static.backward_config`, launching only the
  kernels of the gradients asked for."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
  def attention(q, k, v, static: Static):
    return forward(q, k, v, static, False)

  def attention_fwd(q, k, v, static: Static):
    # symbolic_zeros: `.perturbed` tells which gradients are needed.
    needed = _Needed(dq=q.perturbed, dkv=k.perturbed or v.perturbed)
    q, k, v = q.value, k.value, v.value
    o, lse = forward(q, k, v, static, True)
    return o, (q, k, v, o, lse, needed)

  def attention_bwd(static: Static, residuals, do):
    q, k, v, o, lse, needed = residuals
    if isinstance(do, SymbolicZero):
      do = jnp.zeros(o.shape, o.dtype)
    return attention_backward(
      q,
      k,
      v,
      o,
      lse,
      do,
      window=static.window,
      dq_config=static.backward_config.dq,
      dkdv_config=static.backward_config.dkdv,
      interpret=static.interpret,
      need_dq=needed.dq,
      need_dkv=needed.dkv,
    )

  attention.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)
  return attention
