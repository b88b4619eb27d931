"""Dense BF16 NT GEMM (SPEC 4.1): `dense_gemm_bf16_nt_n{N}_k{K}`.

C[M,N] = round_bf16(sum_k A[m,k] * B[n,k]), fp32 accumulation. A holds
activations, B the weight as stored by torch.nn.Linear ([out, in]).
Kernel: `pallas_kernels.dense_gemm`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxkern import dispatch, roofline
from jaxkern.contract import Checks, public_op
from jaxkern.family import OpImpl, cdiv, shrink_rows, shrink_until
from jaxkern.spmd import CONTRACTION, Split
from pallas_kernels.dense_gemm import KERNELS

# The reference materializes at most this many bytes of fp32 product at once
# (M = 24576, N = 12288 would otherwise be a 1.2 GB fp32 temporary).
_REFERENCE_F32_BYTES = 512 * 2**20

# cpu_axes budget: multiply-accumulates an interpret-mode run may do in about
# a second on two cores (measurements: docs/perf/cpu_budgets.md).
_CPU_MAC_BUDGET = 3 * 10**9

_NT = (((1,), (1,)), ((), ()))


def dense_gemm_reference(A: jax.Array, B: jax.Array, *, out_dtype=jnp.bfloat16) -> jax.Array:
  """Plain-jnp reference: C = A @ B^T, fp32 accumulation, one rounding to
  `out_dtype` (the definitions' bf16).

  Large products are computed in row chunks so the fp32 temporary stays
  under `_REFERENCE_F32_BYTES`. Every chunk has the same row count; the last
  one starts at M - rows and recomputes a few rows of its neighbour with
  identical values, which keeps all shapes static without padding A.
  """
  m, n = A.shape[0], B.shape[0]
  num_chunks = cdiv(m * n * 4, _REFERENCE_F32_BYTES)
  if num_chunks <= 1:
    return lax.dot_general(A, B, _NT, preferred_element_type=jnp.float32).astype(out_dtype)
  rows = cdiv(m, num_chunks)

  def chunk(i, c):
    start = jnp.minimum(i * rows, m - rows)
    a = lax.dynamic_slice_in_dim(A, start, rows, axis=0)
    part = lax.dot_general(a, B, _NT, preferred_element_type=jnp.float32)
    return lax.dynamic_update_slice_in_dim(c, part.astype(out_dtype), start, axis=0)

  return lax.fori_loop(0, num_chunks, chunk, jnp.zeros((m, n), out_dtype))


@functools.partial(jax.jit, static_argnames=("m", "n", "k"))
def _synthesize(key, *, m: int, n: int, k: int):
  key_a, key_b = jax.random.split(key)
  a = jax.random.normal(key_a, (m, k), jnp.bfloat16)
  # Weights ~ N(0, 1/K): each output is a sum of K unit-variance terms scaled
  # to O(1), as in a trained linear layer fed normalized activations.
  b = (jax.random.normal(key_b, (n, k), jnp.float32) * lax.rsqrt(jnp.float32(k))).astype(jnp.bfloat16)
  return a, b


def make_inputs(axes: Mapping[str, int], key: jax.Array, record: dict | None = None) -> dict[str, jax.Array]:
  """A ~ N(0,1) bf16 activations, B ~ N(0,1/K) bf16 weights.

  The records carry no structure beyond M (rows are independent tokens), so
  `record` is not consulted; sizes come from `axes` alone, which also makes a
  scaled run (record axes larger than `axes`) trivially consistent.
  """
  del record
  a, b = _synthesize(key, m=int(axes["M"]), n=int(axes["N"]), k=int(axes["K"]))
  return {"A": a, "B": b}


def cpu_axes(axes: Mapping[str, int]) -> dict[str, int]:
  """M shrunk to 64 + M % 64 (4125 -> 93 stays ragged); then N or K, the
  larger first, halved while M*N*K exceeds the interpret-mode budget."""

  def halve_larger(a):
    larger = "N" if a["N"] >= a["K"] else "K"
    return {**a, larger: a[larger] // 2}

  out = {**axes, "M": shrink_rows(int(axes["M"]))}
  return shrink_until(out, lambda a: a["M"] * a["N"] * a["K"] <= _CPU_MAC_BUDGET, halve_larger)


# ---------------------------------------------------------------------------
# Roofline cost (`OpImpl.cost`, see `jaxkern.roofline`).


def dense_gemm_cost(definition, axes, *, inputs=None, record=None, config=None):
  """C[M,N] = A[M,K] B[N,K]^T. FLOPs 2MNK; bytes A + B + C once (bf16)."""
  return roofline.Work(2 * axes["M"] * axes["N"] * axes["K"], roofline.io_bytes(definition, axes), "bf16")


# How the op splits across devices (`jaxkern.spmd`): rows of A, rows of B
# (output columns); K is the contraction.
SPLIT = Split(inputs={"A": "m k", "B": "n k"}, outputs=("m n",), independent="m n", reasons={"k": CONTRACTION})
IMPL = OpImpl(
  reference=dense_gemm_reference,
  kernels=KERNELS,
  make_inputs=make_inputs,
  cpu_axes=cpu_axes,
  cost=dense_gemm_cost,
  split=SPLIT,
)
IMPLS = (IMPL,)


# ---------------------------------------------------------------------------
# Public op (`jaxkern.ops`), dispatched by `jaxkern.dispatch`.


def validate(a, b, **_) -> None:
  """The contract of `dense_gemm` (`jaxkern.contract`): a [..., K], b [N, K], one float dtype."""
  c = Checks("dense_gemm")
  c.rank("a", a, "[..., K]", at_least=1)
  c.rank("b", b, "[N, K]", 2)
  c.shape("b", b, (None, a.shape[-1]), "[N, K]", "K from a.shape[-1]")
  c.floating("a", a)
  c.same_dtype("b", b, "a", a)


@public_op(validate)
def dense_gemm(
  a: jax.Array, b: jax.Array, *, config: Any = None, backend: dispatch.Backend = None, checks: bool = False
) -> jax.Array:
  """`a @ b.T`: activations a [..., K], weight b [N, K] (torch Linear layout);
  fp32 accumulation. Returns c [..., N] in a's dtype.

  Contract: a and b bf16 (or the same float dtype), any M (rows of a, 0
  included), N, K >= 1; no index inputs (`checks=True` has nothing to
  check); non-finite values reach the outputs that use them.
  Differentiable in a and b (Pallas: dA and dB as launches of the same GEMM
  kernel).

  Backends: `xla`, `triton`, `mosaic_gpu` (bf16 or f16 with N a multiple
  of 64 and K of the config's block_k; `backend="pallas"` falls back to
  Triton for other inputs)."""
  *batch, k = a.shape
  c = dispatch.run(
    IMPL, {"A": a.reshape(-1, k), "B": b}, params={"out_dtype": a.dtype}, config=config, backend=backend, checks=checks
  )
  return c.reshape(*batch, b.shape[0])
