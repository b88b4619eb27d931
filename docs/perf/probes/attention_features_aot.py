"""The sm_90a compile (`jaxkern.aot.Compiler`, no GPU) of the attention
features of issue 51 on their heuristic configs: causal, sliding window,
soft cap, grouped heads and lse, batched and packed, through the Triton
forward, its gradient (the forward saving lse, dQ, dK/dV) and the Mosaic GPU
forward, at d64 and d128 and recorded-like sizes. Prints one line per
compile: the kernels' registers, shared memory, spills, MMA kind and CTAs
per SM; exits 1 unless every kernel is `ok` (no spills, no shared-memory
overflow).

    PYTHONPATH=$PWD .venv/bin/python docs/perf/probes/attention_features_aot.py
    PYTHONPATH=$PWD JAXKERN_DEVICE_STACK=1 .venv-device/bin/python docs/perf/probes/attention_features_aot.py

The figures are in docs/perf/attention_features.md.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jaxkern.aot import Compiler
from pallas_kernels.flash_attention import mosaic_gpu, triton

BF16 = jnp.bfloat16
# (label, q shape, k/v shape, packed sequences, features)
CASES = [
  ("causal d128 B=4 N=2560 H=32", (4, 2560, 32, 128), (4, 2560, 32, 128), 0, dict(causal=True)),
  ("causal GQA 32/8 d128 B=2 N=4096", (2, 4096, 32, 128), (2, 4096, 8, 128), 0, dict(causal=True)),
  (
    "causal window 1024, softcap 50, MQA d128 B=1 N=8192",
    (1, 8192, 16, 128),
    (1, 8192, 1, 128),
    0,
    dict(causal=True, window=(1024, None), softcap=50.0),
  ),
  ("window (256, 256) d64 B=4 Nq=2560 Nk=2048", (4, 2560, 32, 64), (4, 2048, 32, 64), 0, dict(window=(256, 256))),
  ("packed causal GQA 32/8 d128 T=16384, 8 seqs", (16384, 32, 128), (16384, 8, 128), 8, dict(causal=True)),
  ("packed d64 softcap T=8192, 32 seqs", (8192, 16, 64), (8192, 16, 64), 32, dict(softcap=30.0)),
]


def shapes(q_shape, kv_shape, num_seqs):
  out = {"q": jax.ShapeDtypeStruct(q_shape, BF16), "k": jax.ShapeDtypeStruct(kv_shape, BF16)}
  out["v"] = out["k"]
  if num_seqs:
    out["cu_seqlens_q"] = out["cu_seqlens_k"] = jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32)
  return out


def main() -> int:
  compiler = Compiler()
  print(f"target {compiler.target}, jax {jax.__version__}")
  ok = True
  for label, q_shape, kv_shape, num_seqs, features in CASES:
    args = shapes(q_shape, kv_shape, num_seqs)

    def forward(x, features=features):
      return triton.flash_attention(**x, return_lse=True, interpret=False, **features)

    def gradient(x, features=features):
      floating = {n: x[n] for n in ("q", "k", "v")}

      def loss(f):
        o, lse = triton.flash_attention(**{**x, **f}, return_lse=True, interpret=False, **features)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse))

      return jax.grad(loss)(floating)

    def mosaic(x, features=features):
      return mosaic_gpu.flash_attention_forward(**x, interpret=False, **features)

    for kind, fn in (("triton fwd", forward), ("triton fwd+bwd", gradient), ("mosaic_gpu fwd", mosaic)):
      report = compiler.compile(fn, args)
      ok &= report.ok
      print(f"{label} | {kind} | {report.status} | {report.summary() or report.error}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
