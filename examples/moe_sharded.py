"""The block of `examples/moe_block.py` on a mesh of devices, written as a
user would shard it: one `jax.shard_map` (default `check_vma=True`) over a
1-D mesh axis `model`, jaxkern's ops called on each device's shard.

* Attention, tensor parallel over heads: the fused QKV weight is split by
  head (each device computes its heads' q, k, v and their attention), the
  attention outputs are gathered and the output projection is split by
  output feature (each device its columns, then gathered), so every
  device ends with the whole sublayer output, as the single-device block
  computes it.
* MoE, expert parallel: device d holds experts [d E/n, (d+1) E/n) (their
  MXFP4 weights are split along E) and routes its own slice of the tokens.
  Each routed (token, slot) row is quantized to FP8 and sent to the device
  owning its expert with an `all_to_all` of fixed-size per-destination
  buffers (room for every row going to one device, so none is dropped;
  unused entries carry expert id -1, rows the grouped GEMM zeroes). The
  receiver sorts its rows by local expert id, runs the FP8 x FP4 grouped
  GEMMs with local ids (`ops.grouped_gemm_fp8_fp4` inside the shard_map),
  and a second `all_to_all` returns the rows to their tokens' devices, which
  combine them with the router weights; the token slices are gathered.

`sharded_block(params, x, cfg, mesh, backend)` is the block; `shard_params`
places the weights. `compare_with_single_device` checks each sublayer and
the block against the single-device block.

  python -m examples.moe_block --devices 8 [--backend pallas|xla]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from examples import moe_block
from examples.moe_block import BlockConfig, bf16_stream, quantize_rows, rms_norm
from jaxkern import ops

AXIS = "model"


def make_mesh(devices: int) -> jax.sharding.Mesh:
  """A 1-D mesh `model` over the first `devices` devices."""
  available = jax.devices()
  if devices > len(available):
    raise ValueError(
      f"--devices {devices}: only {len(available)} {available[0].platform} devices here "
      f"(on a CPU: JAX_NUM_CPU_DEVICES={devices} or --xla_force_host_platform_device_count)"
    )
  return jax.sharding.Mesh(np.array(available[:devices]), (AXIS,))


def check_divides(cfg: BlockConfig, devices: int, tokens: int) -> None:
  for what, size in (
    ("num_heads", cfg.num_heads),
    ("num_experts", cfg.num_experts),
    ("d_model", cfg.d_model),
    ("batch * tokens", tokens),
  ):
    if size % devices:
      raise ValueError(f"{what}={size} must be a multiple of the {devices} devices")


def param_specs(params: dict) -> dict:
  """Per weight: QKV split by head, the output projection by output feature,
  the router replicated, experts split along E."""
  experts = {"packed": P(AXIS), "scales": P(AXIS)}
  return {
    "w_qkv": P(None, AXIS),
    "w_o": P(AXIS),
    "router": P(),
    "router_bias": P(),
    "w_gate_up": experts,
    "w_down": experts,
  }


def shard_params(params: dict, cfg: BlockConfig, mesh: jax.sharding.Mesh) -> dict:
  """The block's weights placed on `mesh`; QKV as [3, H, D/H, D] so that a
  split of its head axis is each device's heads of q, k and v."""
  d = cfg.d_model
  laid_out = dict(params, w_qkv=params["w_qkv"].reshape(3, cfg.num_heads, d // cfg.num_heads, d))
  return jax.tree.map(lambda w, spec: jax.device_put(w, NamedSharding(mesh, spec)), laid_out, param_specs(params))


def gather(x: jax.Array, axis: int) -> jax.Array:
  """Every device's x, concatenated along `axis`, on every device (typed
  invariant, so shard_map can check the block's replicated output)."""
  return lax.all_gather(x, AXIS, axis=axis, tiled=True, to="invarying")


# ---------------------------------------------------------------------------
# One device's part of the block (inside the shard_map).


def attention(params: dict, x: jax.Array, cfg: BlockConfig, backend) -> jax.Array:
  """Tensor-parallel attention: this device's heads, then gathered."""
  b, n, d = x.shape
  w_qkv = params["w_qkv"]  # [3, H/n, D/H, D]
  heads = w_qkv.shape[1]
  qkv = ops.dense_gemm(rms_norm(x), w_qkv.reshape(-1, d), backend=backend)
  q, k, v = jnp.split(qkv.reshape(b, n, 3, heads, d // cfg.num_heads), 3, axis=2)
  o = ops.attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], backend=backend)
  o = gather(o, axis=2).reshape(b, n, d)  # every head
  return gather(ops.dense_gemm(o, params["w_o"], backend=backend), axis=2)  # every output feature


def _slots(dest: jax.Array, devices: int) -> jax.Array:
  """Each row's position in its destination's buffer: rows bound for the
  same device numbered in order."""
  onehot = (dest[:, None] == jnp.arange(devices)).astype(jnp.int32)
  return jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, dest[:, None], axis=1)[:, 0]


def moe(params: dict, x: jax.Array, cfg: BlockConfig, backend, devices: int) -> jax.Array:
  """Expert-parallel MoE on this device's slice of the tokens, gathered."""
  b, n, d = x.shape
  local_tokens = b * n // devices
  tokens = lax.dynamic_slice_in_dim(rms_norm(x).reshape(b * n, d), lax.axis_index(AXIS) * local_tokens, local_tokens)
  ids, weights = ops.moe_router(
    tokens,
    params["router"],
    params["router_bias"],
    routed_scaling_factor=cfg.routed_scaling_factor,
    top_k=cfg.top_k,
    backend=backend,
  )  # [t, k], experts ascending per token
  local_experts = cfg.num_experts // devices
  rows = ids.size  # t * k, also the buffer room
  dest = ids.reshape(-1) // local_experts
  slot = _slots(dest, devices)
  a, a_scale = quantize_rows(tokens[jnp.arange(rows) // cfg.top_k])

  def send(values, fill):
    buffer = jnp.full((devices, rows, *values.shape[1:]), fill, values.dtype)
    return lax.all_to_all(buffer.at[dest, slot].set(values), AXIS, 0, 0)

  recv_a, recv_scale = send(a, 0), send(a_scale, 127)
  recv_ids = send(ids.reshape(-1) % local_experts, -1).reshape(-1)  # local ids, -1: empty
  order = jnp.argsort(jnp.where(recv_ids < 0, local_experts, recv_ids), stable=True)
  expert_ids = recv_ids[order]
  up, down = params["w_gate_up"], params["w_down"]
  h = ops.grouped_gemm_fp8_fp4(
    recv_a.reshape(-1, d)[order],
    recv_scale.reshape(-1, d // moe_block.GROUP)[order],
    up["packed"],
    up["scales"],
    expert_ids,
    backend=backend,
  )
  gate, lin = jnp.split(h.astype(jnp.float32), 2, axis=-1)
  act, act_scale = quantize_rows(jax.nn.silu(gate) * lin)
  y = ops.grouped_gemm_fp8_fp4(act, act_scale, down["packed"], down["scales"], expert_ids, backend=backend)
  y = jnp.zeros_like(y).at[order].set(y).reshape(devices, rows, d)
  returned = lax.all_to_all(y, AXIS, 0, 0)[dest, slot]  # [t * k, D], (token, slot) order
  # Slots in ascending expert order, as the single-device block adds them.
  weighted = returned.astype(jnp.float32).reshape(local_tokens, cfg.top_k, d) * weights[..., None]
  out = functools.reduce(jnp.add, [weighted[:, j] for j in range(cfg.top_k)])
  return gather(out.astype(x.dtype), axis=0).reshape(b, n, d)


# ---------------------------------------------------------------------------
# The sharded block.


def _sharded(part, params: dict, x: jax.Array, cfg: BlockConfig, mesh: jax.sharding.Mesh) -> jax.Array:
  """`part(params, x)` on every device of `mesh` (x replicated, weights as
  `param_specs`), its replicated result."""
  specs = param_specs(params)
  return jax.shard_map(part, mesh=mesh, in_specs=(specs, P()), out_specs=P())(params, x)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "backend"))
def sharded_attention(params, x, cfg: BlockConfig, mesh, backend=None) -> jax.Array:
  return _sharded(lambda p, x: attention(p, x, cfg, backend), params, x, cfg, mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "backend"))
def sharded_moe(params, x, cfg: BlockConfig, mesh, backend=None) -> jax.Array:
  return _sharded(lambda p, x: moe(p, x, cfg, backend, mesh.size), params, x, cfg, mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "backend"))
def sharded_block(params, x, cfg: BlockConfig, mesh, backend=None) -> jax.Array:
  """x [B, N, D] bf16 (replicated) -> x + attention + MoE, as
  `moe_block.block` computes it, on the devices of `mesh`."""

  def part(p, x):
    x = bf16_stream(x + attention(p, x, cfg, backend))
    return x + moe(p, x, cfg, backend, mesh.size)

  return _sharded(part, params, x, cfg, mesh)


def compare_with_single_device(
  params: dict, x: jax.Array, cfg: BlockConfig, mesh, backend
) -> dict[str, tuple[int, float]]:
  """Each sublayer on the mesh against `moe_block`'s on one device from the
  same input, and the whole block: {part: (elements outside the bf16
  tolerance, max abs error)}."""
  check_divides(cfg, mesh.size, x.shape[0] * x.shape[1])
  sharded = shard_params(params, cfg, mesh)
  x = jax.device_put(x, NamedSharding(mesh, P()))
  attn = jax.jit(lambda x: moe_block.attention(params, x, cfg, backend))(x)
  stream = bf16_stream(x + attn)
  single_moe = jax.jit(lambda x: moe_block.moe(params, x, cfg, backend))(stream)
  return {
    "attention": moe_block.outside(sharded_attention(sharded, x, cfg, mesh, backend), attn),
    "moe": moe_block.outside(sharded_moe(sharded, stream, cfg, mesh, backend), single_moe),
    "block": moe_block.outside(sharded_block(sharded, x, cfg, mesh, backend), moe_block.block(params, x, cfg, backend)),
  }
