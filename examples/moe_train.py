"""Training the MoE block of `examples/moe_block.py` through its FP8 x FP4
expert GEMMs, with optax.

The block is the serving block (attention, then the DeepSeek-style MoE:
router, experts' SwiGLU on MXFP4 weights, combine), run from fp32 master
weights: every step casts the projections and the router to bf16 and
quantizes the experts' weights to MXFP4 and their input rows to FP8 inside
`ops.grouped_gemm_mxfp4_ste`, so the forward pass is the serving block's
(the same FP8 x FP4 grouped GEMMs, bit for bit on the quantized weights).
Gradients pass the quantizers straight through (the straight-through
estimator): the experts' weights get dY^T Q(X) per expert and their input
rows dY Q(W) (bf16 grouped GEMMs on XLA); the router learns through its
combine weights (`ops.moe_router`'s gradient); attention through the GEMM
and flash backward kernels on the Pallas path.

The task is distillation: a teacher block with other random weights maps a
fixed batch of tokens to targets; the student, a block of the same shape,
learns to reproduce them (mean squared error).

  python -m examples.moe_train [--steps 20] [--backend pallas|xla]

trains on the fixed batch and prints the loss of each step (on a CPU the
Pallas path runs in interpret mode: slow, keep the steps few). Needs the
`examples` extra (optax).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from examples import moe_block, training
from examples.moe_block import BlockConfig
from jaxkern import ops

# Small enough for CPU steps; K of every grouped GEMM (d_model, d_expert) a multiple of 32.
TRAIN_CONFIG = BlockConfig(d_model=128, num_heads=2, num_experts=8, d_expert=64, top_k=2)


def straight_through_experts(params: dict, rows: jax.Array, row_expert: jax.Array, backend) -> jax.Array:
  """`moe_block.experts` from fp32 master weights: the same FP8 x FP4 GEMMs,
  differentiable by the straight-through estimator."""
  h = ops.grouped_gemm_mxfp4_ste(rows, params["w_gate_up"], row_expert, backend=backend)
  gate, lin = jnp.split(h.astype(jnp.float32), 2, axis=-1)
  return ops.grouped_gemm_mxfp4_ste(jax.nn.silu(gate) * lin, params["w_down"], row_expert, backend=backend)


def block(params: dict, x: jax.Array, cfg: BlockConfig, backend=None) -> jax.Array:
  """`moe_block.block` from the master weights (`moe_block.master_params`):
  x [B, N, D] bf16 -> x + attention + MoE, bf16."""
  bf16 = {name: params[name].astype(jnp.bfloat16) for name in ("w_qkv", "w_o", "router")}
  weights = {**params, **bf16}
  x = moe_block.bf16_stream(x + moe_block.attention(weights, x, cfg, backend))
  return x + moe_block.moe(weights, x, cfg, backend, expert_layer=straight_through_experts)


def loss_fn(params: dict, x: jax.Array, target: jax.Array, cfg: BlockConfig, backend=None) -> jax.Array:
  return jnp.mean(jnp.square(block(params, x, cfg, backend).astype(jnp.float32) - target))


def make_batch(key: jax.Array, cfg: BlockConfig, tokens: int, batch: int) -> tuple[jax.Array, jax.Array]:
  """(x [B, N, D] bf16, the teacher block's output for it, fp32; XLA path)."""
  k_x, k_teacher = jax.random.split(key)
  x = jax.random.normal(k_x, (batch, tokens, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
  teacher = moe_block.master_params(k_teacher, cfg)
  return x, block(teacher, x, cfg, backend="xla").astype(jnp.float32)


def train(
  steps: int,
  *,
  cfg: BlockConfig = TRAIN_CONFIG,
  tokens: int = 32,
  batch: int = 2,
  learning_rate: float = 3e-3,
  backend=None,
  seed: int = 0,
  log: Callable[[str], None] | None = None,
) -> list[float]:
  """Trains `steps` Adam steps on one fixed batch; the losses."""
  key_params, key_batch = jax.random.split(jax.random.key(seed))
  params = moe_block.master_params(key_params, cfg)
  x, target = make_batch(key_batch, cfg, tokens, batch)
  return training.adam_losses(
    functools.partial(loss_fn, cfg=cfg, backend=backend), params, (x, target), steps, learning_rate, log
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--tokens", type=int, default=32)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--backend", choices=("pallas", "xla"), default=None)
  args = parser.parse_args(argv)
  print(
    f"training on {jax.default_backend()} (backend={args.backend or 'auto'}), "
    f"batch {args.batch} x {args.tokens} tokens, {TRAIN_CONFIG.num_experts} experts (top {TRAIN_CONFIG.top_k})"
  )
  losses = train(
    args.steps,
    tokens=args.tokens,
    batch=args.batch,
    learning_rate=args.learning_rate,
    backend=args.backend,
    log=print,
  )
  return training.report(losses)


if __name__ == "__main__":
  raise SystemExit(main())
