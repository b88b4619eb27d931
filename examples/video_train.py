"""Training a small video block on jaxkern's differentiable ops with optax.

The model denoises short clips of moving sinusoidal gratings: a noisy clip
`[B, T, Y, X, C]` goes in, the clean clip is the target (mean squared
error). One pre-norm block over the clip's tokens (one token per pixel):

* Local attention: a QKV projection (`ops.dense_gemm`), 3-D neighborhood
  attention over (frame, row, column) windows
  (`ops.neighborhood_attention_3d`), an output projection.
* Global attention: a QKV projection, attention of every token over the
  whole clip (`ops.attention`), an output projection.
* An MLP: two `ops.dense_gemm` with a GELU between.

The prediction is the noisy input plus a read-out of the stream, so the
block learns the noise to remove. Parameters are fp32 (what the optimizer
updates); activations go through the ops in bf16, the residual stream is
fp32. `jax.grad` of the loss runs the ops' backward kernels on the Pallas
path (dA/dB GEMMs, NATTEN dQ and dK/dV, FlashAttention-2 dQ and dK/dV) and
plain JAX autodiff of the references on the XLA path.

  python -m examples.video_train [--steps 20] [--backend pallas|xla]

trains on a fixed batch of clips and prints the loss of each step (on a
CPU the Pallas path runs in interpret mode: slow, keep the steps few).
Needs the `examples` extra (optax).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from examples import training
from examples.moe_block import BACKEND_HELP, rms_norm
from jaxkern import ops


@dataclasses.dataclass(frozen=True)
class VideoConfig:
  frames: int = 4
  height: int = 6
  width: int = 6
  channels: int = 4  # pixel values per token (one grating each)
  d_model: int = 32
  num_heads: int = 2  # head dim d_model / num_heads: a power of two >= 16
  window: tuple[int, int, int] = (3, 3, 3)  # (frames, rows, columns), each odd and <= its extent
  d_mlp: int = 64
  noise: float = 0.5


def init_params(key: jax.Array, cfg: VideoConfig) -> dict[str, jax.Array]:
  """fp32 weights in the torch Linear layout `[out, in]` (what
  `ops.dense_gemm` takes), scaled by `in**-0.5`; the read-out starts at 0
  so the untrained model predicts the noisy input."""
  d, c, f = cfg.d_model, cfg.channels, cfg.d_mlp
  shapes = {
    "w_in": (d, c),
    "w_local_qkv": (3 * d, d),
    "w_local_o": (d, d),
    "w_global_qkv": (3 * d, d),
    "w_global_o": (d, d),
    "w_up": (f, d),
    "w_down": (d, f),
  }
  keys = jax.random.split(key, len(shapes))
  params = {
    name: jax.random.normal(k, shape, jnp.float32) * shape[1] ** -0.5 for k, (name, shape) in zip(keys, shapes.items())
  }
  params["w_out"] = jnp.zeros((c, d), jnp.float32)
  return params


def dense(x: jax.Array, w: jax.Array, backend) -> jax.Array:
  """`x @ w.T` on the GEMM op: bf16 operands, fp32 result for the stream."""
  return ops.dense_gemm(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), backend=backend).astype(jnp.float32)


def qkv_heads(params: dict, name: str, x: jax.Array, cfg: VideoConfig, backend) -> list[jax.Array]:
  """q, k, v `[..., H, D]` in bf16 from the stream `[..., d_model]`."""
  qkv = dense(rms_norm(x), params[name], backend)
  qkv = qkv.reshape(*x.shape[:-1], 3, cfg.num_heads, cfg.d_model // cfg.num_heads).astype(jnp.bfloat16)
  return [qkv[..., i, :, :] for i in range(3)]


def local_attention(params: dict, x: jax.Array, cfg: VideoConfig, backend) -> jax.Array:
  """3-D neighborhood attention over `x [B, T, Y, X, d_model]`."""
  q, k, v = qkv_heads(params, "w_local_qkv", x, cfg, backend)
  q = (q * (cfg.d_model // cfg.num_heads) ** -0.5).astype(jnp.bfloat16)  # NATTEN applies no scale
  o = ops.neighborhood_attention_3d(q, k, v, kernel_size=cfg.window, backend=backend)
  return dense(o.reshape(x.shape), params["w_local_o"], backend)


def global_attention(params: dict, x: jax.Array, cfg: VideoConfig, backend) -> jax.Array:
  """Attention of every token over the whole clip."""
  b = x.shape[0]
  q, k, v = (a.reshape(b, -1, *a.shape[-2:]) for a in qkv_heads(params, "w_global_qkv", x, cfg, backend))
  o = ops.attention(q, k, v, backend=backend)
  return dense(o.reshape(x.shape), params["w_global_o"], backend)


def denoise(params: dict, noisy: jax.Array, cfg: VideoConfig, backend=None) -> jax.Array:
  """The clean clip predicted from `noisy [B, T, Y, X, C]` (fp32)."""
  x = dense(noisy, params["w_in"], backend)
  x = x + local_attention(params, x, cfg, backend)
  x = x + global_attention(params, x, cfg, backend)
  x = x + dense(jax.nn.gelu(dense(rms_norm(x), params["w_up"], backend)), params["w_down"], backend)
  return noisy + dense(rms_norm(x), params["w_out"], backend)


def loss_fn(params: dict, noisy: jax.Array, clean: jax.Array, cfg: VideoConfig, backend=None) -> jax.Array:
  return jnp.mean(jnp.square(denoise(params, noisy, cfg, backend) - clean))


def make_clips(key: jax.Array, batch: int, cfg: VideoConfig) -> tuple[jax.Array, jax.Array]:
  """(noisy, clean) `[B, T, Y, X, C]` fp32: channel c of a clip is a
  grating `sin(k . (y, x) - w t + phase)` with its own random wave vector,
  speed and phase; the noise is Gaussian with std `cfg.noise`."""
  k_wave, k_speed, k_phase, k_noise = jax.random.split(key, 4)
  shape = (batch, 1, 1, 1, cfg.channels)
  wave = jax.random.uniform(k_wave, (2, *shape), minval=-1.5, maxval=1.5)
  speed = jax.random.uniform(k_speed, shape, minval=-1.0, maxval=1.0)
  phase = jax.random.uniform(k_phase, shape, maxval=2 * jnp.pi)
  t, y, x = (
    jnp.arange(n, dtype=jnp.float32).reshape(s)
    for n, s in ((cfg.frames, (1, -1, 1, 1, 1)), (cfg.height, (1, 1, -1, 1, 1)), (cfg.width, (1, 1, 1, -1, 1)))
  )
  clean = jnp.sin(wave[0] * y + wave[1] * x - speed * t + phase)
  noisy = clean + cfg.noise * jax.random.normal(k_noise, clean.shape)
  return noisy, clean


def train(
  steps: int,
  *,
  batch: int = 2,
  cfg: VideoConfig = VideoConfig(),
  learning_rate: float = 3e-3,
  backend=None,
  seed: int = 0,
  log: Callable[[str], None] | None = None,
) -> list[float]:
  """Trains `steps` Adam steps on one fixed batch of clips; the losses."""
  key_params, key_clips = jax.random.split(jax.random.key(seed))
  params = init_params(key_params, cfg)
  noisy, clean = make_clips(key_clips, batch, cfg)
  return training.adam_losses(
    functools.partial(loss_fn, cfg=cfg, backend=backend), params, (noisy, clean), steps, learning_rate, log
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
  parser.add_argument("--batch", type=int, default=2, help="clips per step (default: 2)")
  parser.add_argument("--learning-rate", type=float, default=3e-3, help="Adam's learning rate (default: 0.003)")
  parser.add_argument("--backend", choices=("pallas", "xla"), default=None, help=BACKEND_HELP)
  args = parser.parse_args(argv)
  print(f"training on {jax.default_backend()} (backend={args.backend or 'auto'}), batch {args.batch}")
  return training.report(
    train(args.steps, batch=args.batch, learning_rate=args.learning_rate, backend=args.backend, log=print)
  )


if __name__ == "__main__":
  raise SystemExit(main())
