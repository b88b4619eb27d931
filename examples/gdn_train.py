"""Training a small gated delta net layer (Qwen3-Next's linear attention) on
packed variable-length sequences with optax.

The task is distillation: a fixed, randomly initialized teacher layer maps
each token of a packed batch to a target vector that depends on the earlier
tokens of its own sequence (through the teacher's recurrent state); a
student layer of the same shape, initialized differently, learns to
reproduce it (mean squared error). One pre-norm block:

* q, k, v and the gate inputs a, b from projections (`ops.dense_gemm`); q
  and k are L2-normalized per head, as in Qwen3-Next;
* the gated delta rule over the packed sequences (`ops.gdn_prefill`), from
  a learned initial state shared by the sequences, with learned A_log and
  dt_bias;
* an output projection back to the residual stream, then a read-out.

Parameters are fp32 (what the optimizer updates); activations go through
the ops in bf16. `jax.grad` of the loss runs the ops' backward kernels on
the Pallas path (the GEMM's dA/dB launches, GDN prefill's chunk-parallel
backward with gradients for q, k, v, the state and the gates) and plain JAX
autodiff of the references on the XLA path.

  python -m examples.gdn_train [--steps 20] [--backend pallas|xla]

trains on one fixed packed batch and prints the loss of each step (on a CPU
the Pallas path runs in interpret mode: slow, keep the steps few). Needs the
`examples` extra (optax).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from examples import training
from examples.moe_block import BACKEND_HELP, rms_norm
from jaxkern import ops


@dataclasses.dataclass(frozen=True)
class GdnConfig:
  lengths: tuple[int, ...] = (20, 0, 28)  # packed sequences (an empty one among them)
  d_in: int = 8  # input features per token
  d_model: int = 32
  num_q_heads: int = 1
  num_v_heads: int = 2  # a multiple of num_q_heads (GVA)
  head_size: int = 16  # a power of two >= 16
  d_out: int = 4  # target features per token

  @property
  def cu_seqlens(self) -> jax.Array:
    return jnp.asarray(np.concatenate([[0], np.cumsum(self.lengths)]), jnp.int32)


def init_params(key: jax.Array, cfg: GdnConfig) -> dict[str, jax.Array]:
  """fp32 weights in the torch Linear layout `[out, in]` (what
  `ops.dense_gemm` takes), scaled by `in**-0.5`; A_log and dt_bias in
  Qwen3-Next's initial ranges; a small initial state."""
  hq, hv, d = cfg.num_q_heads, cfg.num_v_heads, cfg.head_size
  shapes = {
    "w_in": (cfg.d_model, cfg.d_in),
    "w_q": (hq * d, cfg.d_model),
    "w_k": (hq * d, cfg.d_model),
    "w_v": (hv * d, cfg.d_model),
    "w_a": (hv, cfg.d_model),
    "w_b": (hv, cfg.d_model),
    "w_o": (cfg.d_model, hv * d),
    "w_out": (cfg.d_out, cfg.d_model),
  }
  keys = jax.random.split(key, len(shapes) + 3)
  params = {
    name: jax.random.normal(k, shape, jnp.float32) * shape[1] ** -0.5 for k, (name, shape) in zip(keys, shapes.items())
  }
  params["A_log"] = jnp.log(jax.random.uniform(keys[-3], (hv,), minval=1.0, maxval=16.0))
  dt = jnp.exp(jax.random.uniform(keys[-2], (hv,), minval=np.log(1e-3), maxval=np.log(1e-1)))
  params["dt_bias"] = dt + jnp.log(-jnp.expm1(-dt))  # softplus^-1(dt)
  params["state"] = 0.1 * jax.random.normal(keys[-1], (hv, d, d), jnp.float32)
  return params


def dense(x: jax.Array, w: jax.Array, backend) -> jax.Array:
  """`x @ w.T` on the GEMM op: bf16 operands, fp32 result for the stream."""
  return ops.dense_gemm(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), backend=backend).astype(jnp.float32)


def l2_normalized(x: jax.Array) -> jax.Array:
  return (x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)


def gdn_layer(params: dict, tokens: jax.Array, cfg: GdnConfig, backend=None) -> jax.Array:
  """`[T, d_out]` predictions for the packed tokens `[T, d_in]` (fp32)."""
  t, hq, hv, d = tokens.shape[0], cfg.num_q_heads, cfg.num_v_heads, cfg.head_size
  x = dense(tokens, params["w_in"], backend)
  h = rms_norm(x)
  q = l2_normalized(dense(h, params["w_q"], backend).reshape(t, hq, d))
  k = l2_normalized(dense(h, params["w_k"], backend).reshape(t, hq, d))
  v = dense(h, params["w_v"], backend).reshape(t, hv, d).astype(jnp.bfloat16)
  a = dense(h, params["w_a"], backend).astype(jnp.bfloat16)
  b = dense(h, params["w_b"], backend).astype(jnp.bfloat16)
  state = jnp.broadcast_to(params["state"], (len(cfg.lengths), hv, d, d))
  o, _ = ops.gdn_prefill(q, k, v, state, params["A_log"], a, params["dt_bias"], b, cfg.cu_seqlens, backend=backend)
  x = x + dense(o.reshape(t, hv * d).astype(jnp.float32), params["w_o"], backend)
  return dense(rms_norm(x), params["w_out"], backend)


def loss_fn(params: dict, tokens: jax.Array, targets: jax.Array, cfg: GdnConfig, backend=None) -> jax.Array:
  return jnp.mean(jnp.square(gdn_layer(params, tokens, cfg, backend) - targets))


def make_batch(key: jax.Array, cfg: GdnConfig) -> tuple[jax.Array, jax.Array, dict]:
  """(tokens [T, d_in], targets [T, d_out], the teacher's params): the
  targets are the teacher layer's outputs (XLA path, fp32)."""
  k_tokens, k_teacher = jax.random.split(key)
  tokens = jax.random.normal(k_tokens, (sum(cfg.lengths), cfg.d_in), jnp.float32)
  teacher = init_params(k_teacher, cfg)
  return tokens, gdn_layer(teacher, tokens, cfg, backend="xla"), teacher


def train(
  steps: int,
  *,
  cfg: GdnConfig = GdnConfig(),
  learning_rate: float = 1e-2,
  backend=None,
  seed: int = 0,
  log: Callable[[str], None] | None = None,
) -> list[float]:
  """Trains `steps` Adam steps on one fixed packed batch; the losses."""
  key_params, key_batch = jax.random.split(jax.random.key(seed))
  params = init_params(key_params, cfg)
  tokens, targets, _ = make_batch(key_batch, cfg)
  return training.adam_losses(
    functools.partial(loss_fn, cfg=cfg, backend=backend), params, (tokens, targets), steps, learning_rate, log
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
  parser.add_argument("--learning-rate", type=float, default=1e-2, help="Adam's learning rate (default: 0.01)")
  parser.add_argument("--backend", choices=("pallas", "xla"), default=None, help=BACKEND_HELP)
  args = parser.parse_args(argv)
  cfg = GdnConfig()
  print(
    f"training on {jax.default_backend()} (backend={args.backend or 'auto'}), "
    f"{sum(cfg.lengths)} tokens in sequences of {list(cfg.lengths)}"
  )
  return training.report(train(args.steps, cfg=cfg, learning_rate=args.learning_rate, backend=args.backend, log=print))


if __name__ == "__main__":
  raise SystemExit(main())
