"""A DeepSeek-style transformer block on jaxkern's kernels, written as a user
would write it: plain functions over parameter pytrees, `jax.jit`, weights
created in their quantized serving formats.

* Attention: fused QKV projection (`ops.dense_gemm`), non-causal attention
  over the heads (`ops.attention`), output projection.
* MoE: the sqrtsoftplus router picks `top_k` experts per token
  (`ops.moe_router`); tokens are dispatched into rows grouped by expert,
  activations quantized to FP8 with UE8M0 scales per 32 (`jaxkern.quant`),
  and the experts' gate/up and down projections run as FP8 x FP4 grouped
  GEMMs (`ops.grouped_gemm_fp8_fp4`) over MXFP4 weights; a SwiGLU in between;
  the expert outputs are combined with the router weights.

`master_params` are fp32 weights, `serving_params` their serving formats;
`examples/moe_train.py` trains the block from the master weights through
the FP8 x FP4 GEMMs (`ops.grouped_gemm_mxfp4_ste`, a straight-through
estimator).

`attention_reference` / `moe_reference` are the same sublayers in plain jnp
(dequantized weights, every expert on every token, no dispatch), for testing;
`compare_with_reference` checks each and the whole block.

  python -m examples.moe_block [--tokens 512] [--backend pallas|xla] [--devices N]

runs both, compares them and times the block (on a GPU the timing is the
kernels'; on a CPU the Pallas path is interpreted and slow). With
`--devices N` it runs the block expert parallel (MoE) and tensor parallel
(attention) on N devices instead (`examples/moe_sharded.py`) and compares it
with the block on one device.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxkern import bench, ops, quant

GROUP = 32  # k values per UE8M0 scale (activations and weights)
# The examples' --backend flag.
BACKEND_HELP = "the ops' backend: pallas (the kernels) | xla (the references) (default: pallas on a GPU, xla on a CPU)"


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  d_model: int = 256
  num_heads: int = 4
  num_experts: int = 16
  d_expert: int = 128
  top_k: int = 4
  routed_scaling_factor: float = 1.5


def master_params(key: jax.Array, cfg: BlockConfig) -> dict[str, jax.Array]:
  """Random fp32 weights at trained-model scales (N(0, 1/fan-in)), in the
  layouts the ops take: `[out, in]`, experts `[E, out, in]`."""
  k_qkv, k_o, k_router, k_bias, k_up, k_down = jax.random.split(key, 6)
  d, e, f = cfg.d_model, cfg.num_experts, cfg.d_expert

  def normal(k, shape):
    return jax.random.normal(k, shape, jnp.float32) * shape[-1] ** -0.5

  return {
    "w_qkv": normal(k_qkv, (3 * d, d)),
    "w_o": normal(k_o, (d, d)),
    "router": normal(k_router, (e, d)),
    "router_bias": 0.05 * jax.random.normal(k_bias, (e,), jnp.float32),
    "w_gate_up": normal(k_up, (e, 2 * f, d)),
    "w_down": normal(k_down, (e, d, f)),
  }


def serving_params(master: dict[str, jax.Array]) -> dict:
  """The weights in their serving formats: bf16 projections and router, the
  experts' weights as MXFP4 (packed e2m1 [E, out, in/2], UE8M0 scales
  [E, out, in/32], quantized along `in`)."""

  def mxfp4(w):
    packed, scales = quant.quantize_e2m1(w, GROUP)
    return {"packed": packed, "scales": scales}

  return {
    "w_qkv": master["w_qkv"].astype(jnp.bfloat16),
    "w_o": master["w_o"].astype(jnp.bfloat16),
    "router": master["router"].astype(jnp.bfloat16),
    "router_bias": master["router_bias"],
    "w_gate_up": mxfp4(master["w_gate_up"]),
    "w_down": mxfp4(master["w_down"]),
  }


def init_params(key: jax.Array, cfg: BlockConfig) -> dict:
  """Random weights at trained-model scales; expert weights as MXFP4."""
  return serving_params(master_params(key, cfg))


def bf16_stream(x: jax.Array) -> jax.Array:
  """The residual stream as the bf16 it is stored in. Under jit XLA may keep
  a bf16 sum in f32 for the next op (excess precision); the barrier makes the
  rounding real, so both versions of the block route the same tokens (the
  router's top-k is sensitive to the last bit near ties)."""
  return jax.lax.optimization_barrier(x.astype(jnp.bfloat16))


def rms_norm(x: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


# ---------------------------------------------------------------------------
# The block on jaxkern.ops.


def attention(params: dict, x: jax.Array, cfg: BlockConfig, backend) -> jax.Array:
  b, n, d = x.shape
  qkv = ops.dense_gemm(rms_norm(x), params["w_qkv"], backend=backend)
  q, k, v = jnp.split(qkv.reshape(b, n, 3, cfg.num_heads, d // cfg.num_heads), 3, axis=2)
  o = ops.attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], backend=backend)
  return ops.dense_gemm(o.reshape(b, n, d), params["w_o"], backend=backend)


def dispatch(expert_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(token of each row, expert of each row) with rows sorted by expert: the
  contiguous grouping the grouped GEMM wants."""
  flat = expert_ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  return order // expert_ids.shape[-1], flat[order]


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  return quant.quantize_fp8_e4m3(x, GROUP, "ue8m0")


def experts(params: dict, rows: jax.Array, row_expert: jax.Array, backend) -> jax.Array:
  """The routed rows [R, D] (bf16) through their experts' SwiGLU on the
  MXFP4 weights: FP8 x FP4 grouped GEMMs, activations quantized to FP8 on
  the way. -> [R, D] bf16."""
  a, a_scale = quantize_rows(rows)
  up = params["w_gate_up"]
  h = ops.grouped_gemm_fp8_fp4(a, a_scale, up["packed"], up["scales"], row_expert, backend=backend)
  gate, lin = jnp.split(h.astype(jnp.float32), 2, axis=-1)
  act, act_scale = quantize_rows(jax.nn.silu(gate) * lin)
  down = params["w_down"]
  return ops.grouped_gemm_fp8_fp4(act, act_scale, down["packed"], down["scales"], row_expert, backend=backend)


def moe(params: dict, x: jax.Array, cfg: BlockConfig, backend, expert_layer=experts) -> jax.Array:
  """Route, dispatch, `expert_layer(params, rows, row_expert, backend)`,
  combine (`examples/moe_train.py` passes its straight-through experts)."""
  b, n, d = x.shape
  tokens = rms_norm(x).reshape(b * n, d)
  ids, weights = ops.moe_router(
    tokens,
    params["router"],
    params["router_bias"],
    routed_scaling_factor=cfg.routed_scaling_factor,
    top_k=cfg.top_k,
    backend=backend,
  )
  row_token, row_expert = dispatch(ids)
  y = expert_layer(params, tokens[row_token], row_expert, backend)
  row_weight = weights.reshape(-1)[jnp.argsort(ids.reshape(-1), stable=True)]
  out = jnp.zeros((b * n, d), jnp.float32).at[row_token].add(y.astype(jnp.float32) * row_weight[:, None])
  return out.astype(x.dtype).reshape(b, n, d)


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def block(params: dict, x: jax.Array, cfg: BlockConfig, backend=None) -> jax.Array:
  """x [B, N, D] bf16 -> x + attention + MoE, bf16."""
  x = bf16_stream(x + attention(params, x, cfg, backend))
  return x + moe(params, x, cfg, backend)


# ---------------------------------------------------------------------------
# The same block in plain jnp.


def _dense(x, w):
  return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _dequantized(w: dict) -> jax.Array:
  return quant.dequantize_e2m1(w["packed"], w["scales"], GROUP)


def _fp8_round_trip(x):
  return quant.dequantize_fp8_e4m3(*quantize_rows(x), GROUP)


def _round_bf16(x):
  """x rounded to bf16 and back, kept under jit (XLA may otherwise drop a
  bf16 round trip as excess precision)."""
  return jax.lax.optimization_barrier(x.astype(jnp.bfloat16)).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg",))
def attention_reference(params: dict, x: jax.Array, cfg: BlockConfig) -> jax.Array:
  """attention(x) in plain jnp (the sublayer's output, before the residual)."""
  b, n, d = x.shape
  h = cfg.num_heads
  qkv = _round_bf16(_dense(rms_norm(x), params["w_qkv"]).reshape(b, n, 3, h, d // h))
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d // h) ** -0.5, axis=-1)
  o = jnp.einsum("bhqk,bkhd->bqhd", _round_bf16(p), v).astype(jnp.bfloat16)
  return _dense(o.reshape(b, n, d), params["w_o"])


@functools.partial(jax.jit, static_argnames=("cfg",))
def moe_reference(params: dict, x: jax.Array, cfg: BlockConfig) -> jax.Array:
  """moe(x) in plain jnp (before the residual): dense router and top-k, every
  expert on every token with dequantized weights, no dispatch."""
  b, n, d = x.shape
  tokens = rms_norm(x).reshape(b * n, d)
  logits = jnp.einsum("td,ed->te", tokens, params["router"], preferred_element_type=jnp.float32)
  scores = jnp.sqrt(jax.nn.softplus(logits))
  _, ids = jax.lax.top_k(scores + params["router_bias"], cfg.top_k)
  chosen = jnp.take_along_axis(scores, ids, -1)
  weights = chosen / chosen.sum(-1, keepdims=True) * cfg.routed_scaling_factor
  w_up, w_down = _dequantized(params["w_gate_up"]), _dequantized(params["w_down"])  # [E, 2F, D], [E, D, F]
  # Every expert on every token (small E), then each token's chosen ones.
  a = _fp8_round_trip(tokens)  # [T, D]
  hid_all = jnp.einsum("td,efd->tef", a, w_up)  # [T, E, 2F]
  hid = _round_bf16(jnp.take_along_axis(hid_all, ids[:, :, None], 1))
  gate, lin = jnp.split(hid, 2, axis=-1)
  act = _fp8_round_trip(jax.nn.silu(gate) * lin)  # [T, k, F]
  y_all = jnp.einsum("tkf,edf->tked", act, w_down)  # [T, k, E, D]
  y = _round_bf16(jnp.take_along_axis(y_all, ids[:, :, None, None], 2)[:, :, 0])
  out = jnp.einsum("tkd,tk->td", y, weights).astype(x.dtype)
  return out.reshape(b, n, d)


def block_reference(params: dict, x: jax.Array, cfg: BlockConfig) -> jax.Array:
  x = bf16_stream(x + attention_reference(params, x, cfg))
  return x + moe_reference(params, x, cfg)


def outside(x, y) -> tuple[int, float]:
  """(elements of x outside the bf16 tolerance around y, max abs error)."""
  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  err = np.abs(x - y)
  return int(((err > 0.005) & (err > 0.016 * np.abs(y))).sum()), float(err.max())


def compare_with_reference(params: dict, x: jax.Array, cfg: BlockConfig, backend) -> dict[str, tuple[int, float]]:
  """Each sublayer's output against its jnp version from the same input
  (attention before the residual add, whose rounding of x + attn would
  amplify an ulp where they cancel), and the whole block against the jnp MoE
  applied to the block's own attention output:
  {part: (elements outside the bf16 tolerance, max abs error)}. (Feeding the
  jnp MoE the jnp attention output instead would compare routings: one bf16
  ulp of difference can move a near-tied token to another expert.)"""
  attn_out = jax.jit(lambda x: attention(params, x, cfg, backend))(x)
  stream = bf16_stream(x + attn_out)
  moe_out = jax.jit(lambda x: moe(params, x, cfg, backend))(stream)
  return {
    "attention": outside(attn_out, attention_reference(params, x, cfg)),
    "moe": outside(moe_out, moe_reference(params, stream, cfg)),
    "block": outside(block(params, x, cfg, backend), stream + moe_reference(params, stream, cfg)),
  }


def make_inputs(seed: int, tokens: int, cfg: BlockConfig, batch: int = 1):
  key_p, key_x = jax.random.split(jax.random.key(seed))
  params = init_params(key_p, cfg)
  x = jax.random.normal(key_x, (batch, tokens, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
  return params, x


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence (default: 64)")
  parser.add_argument("--batch", type=int, default=1, help="sequences (default: 1)")
  parser.add_argument("--backend", choices=("pallas", "xla"), default=None, help=BACKEND_HELP)
  parser.add_argument("--iters", type=int, default=10, help="timed calls of the block (default: 10)")
  parser.add_argument(
    "--devices",
    type=int,
    default=0,
    help="run the expert-parallel block (examples/moe_sharded.py) on this many devices "
    "(CPU devices are created as needed) and compare it with one device (default: 0, one device only)",
  )
  args = parser.parse_args(argv)
  cfg = BlockConfig()
  if args.devices:
    return _main_sharded(args, dataclasses.replace(cfg, num_heads=max(cfg.num_heads, args.devices)))
  params, x = make_inputs(0, args.tokens, cfg, args.batch)
  report = compare_with_reference(params, x, cfg, args.backend)
  for part, (bad, worst) in report.items():
    print(
      f"{part} {x.shape} on {jax.default_backend()} (backend={args.backend or 'auto'}): max abs error vs jnp "
      f"{worst:.4g}, {bad} of {x.size} elements outside bf16 tolerance"
    )
  on_gpu = jax.default_backend() == "gpu"
  t = bench.measure(lambda: block(params, x, cfg, args.backend), warmup=2, iters=args.iters, on_gpu=on_gpu)
  r = bench.measure(lambda: block_reference(params, x, cfg), warmup=2, iters=args.iters, on_gpu=on_gpu)
  print(
    f"block {t['median_ms']:.3f} ms (min {t['min_ms']:.3f}), jnp block {r['median_ms']:.3f} ms "
    f"({t['timer']} timer)" + ("" if on_gpu else "  [CPU: checks plumbing, not speed]")
  )
  return 0 if all(bad == 0 for bad, _ in report.values()) else 1


def _main_sharded(args, cfg: BlockConfig) -> int:
  # Before JAX starts its backends; only the CPU backend reads it.
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", args.devices)
  from examples import moe_sharded  # imports this module

  mesh = moe_sharded.make_mesh(args.devices)
  params, x = make_inputs(0, args.tokens, cfg, args.batch)
  report = moe_sharded.compare_with_single_device(params, x, cfg, mesh, args.backend)
  where = f"{args.devices} {jax.default_backend()} devices (backend={args.backend or 'auto'})"
  for part, (bad, worst) in report.items():
    print(
      f"{part} {x.shape} expert/tensor parallel on {where}: max abs error vs one device {worst:.4g}, "
      f"{bad} of {x.size} elements outside bf16 tolerance"
    )
  on_gpu = jax.default_backend() == "gpu"
  sharded = moe_sharded.shard_params(params, cfg, mesh)
  t = bench.measure(
    lambda: moe_sharded.sharded_block(sharded, x, cfg, mesh, args.backend), warmup=2, iters=args.iters, on_gpu=on_gpu
  )
  print(
    f"sharded block {t['median_ms']:.3f} ms (min {t['min_ms']:.3f}, {t['timer']} timer)"
    + ("" if on_gpu else "  [CPU: checks plumbing, not speed]")
  )
  return 0 if all(bad == 0 for bad, _ in report.values()) else 1


if __name__ == "__main__":
  raise SystemExit(main())
