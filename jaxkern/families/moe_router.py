"""DeepSeek-V4.1 MoE router (SPEC 4.2):
`moe_router_gemm_topk_deepseek41_d5120_e384_topk6`.

logits = hidden @ weight^T (fp32); scores = sqrt(softplus(logits)); the top-6
of scores + bias (ties to the lower expert id) are selected; weights =
scores[sel] / sum(scores[sel]) * routed_scaling_factor. Outputs: expert_ids
int32 [M,6] ascending and expert_weights f32 [M,6] permuted with them.
Kernel: `pallas_kernels.moe_router`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkern import compare, dispatch, roofline
from jaxkern.contract import Checks, public_op
from jaxkern.family import OpImpl, shrink_rows
from jaxkern.spmd import CONTRACTION, Split
from pallas_kernels.moe_router import KERNELS

ROUTED_SCALING_FACTOR = 1.5  # DeepSeek-V4.1-Flash

# Synthesis scales (SPEC 6). RMSNorm gains of a trained model spread around 1;
# a log-normal with sigma 0.3 gives the mild per-channel outliers they have.
_NORM_GAIN_LOG_STD = 0.3
# Score-correction bias: a few percent of the score spread (scores are ~0.5-1.5
# for unit-scale logits), enough to reorder near-tied experts as the
# load-balancing bias does, too small to override clear winners.
_BIAS_STD = 0.05


def router_scores(hidden: jax.Array, weight: jax.Array) -> jax.Array:
  """fp32 sqrt(softplus(hidden @ weight^T)), [M, E]."""
  logits = lax.dot_general(hidden, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return jnp.sqrt(jax.nn.softplus(logits))


def moe_router_reference(hidden, weight, bias, routed_scaling_factor, *, top_k: int = 6):
  """Plain-jnp router. `lax.top_k` returns equal values in index order, so
  exact ties go to the lower expert id. Every NaN is made +NaN before the
  ranking: XLA may give a NaN either sign (it depends on how it fuses
  softplus), and `lax.top_k` ranks -NaN below every number but +NaN above.
  The [M, E] fp32 scores are small (6 MiB at M=4096, E=384), so no chunking
  is needed."""
  scores = router_scores(hidden, weight)
  ranked = scores + bias.astype(jnp.float32)[None, :]
  _, ids = lax.top_k(jnp.where(jnp.isnan(ranked), jnp.nan, ranked), top_k)
  ids = jnp.sort(ids, axis=1)
  chosen = jnp.take_along_axis(scores, ids, axis=1)
  weights = chosen / jnp.sum(chosen, axis=1, keepdims=True) * jnp.asarray(routed_scaling_factor, jnp.float32)
  return ids.astype(jnp.int32), weights


def selection_scores(inputs: Mapping[str, jax.Array]) -> jax.Array:
  """What the top-k ranks: scores + bias, f32 [M, E] (for tie-aware compare)."""
  return router_scores(inputs["hidden"], inputs["weight"]) + inputs["bias"].astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("m", "d", "e"))
def _synthesize(key, *, m: int, d: int, e: int):
  key_x, key_gain, key_w, key_b = jax.random.split(key, 4)
  # Hidden states as they leave the pre-MoE RMSNorm: unit RMS per token,
  # times per-channel gains.
  x = jax.random.normal(key_x, (m, d), jnp.float32)
  x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
  gain = jnp.exp(_NORM_GAIN_LOG_STD * jax.random.normal(key_gain, (d,), jnp.float32))
  hidden = (x * gain).astype(jnp.bfloat16)
  # Gate weight ~ N(0, 1/D): logits are O(1), as in the trained gate.
  weight = (jax.random.normal(key_w, (e, d), jnp.float32) * lax.rsqrt(jnp.float32(d))).astype(jnp.bfloat16)
  bias = _BIAS_STD * jax.random.normal(key_b, (e,), jnp.float32)
  return hidden, weight, bias


def make_inputs(axes: Mapping[str, int], key: jax.Array, record: dict | None = None) -> dict[str, jax.Array]:
  """Realistic router inputs (see `_synthesize`); routed_scaling_factor is the
  recorded model's 1.5 as a 0-d f32 array.

  Rows are routed independently, so the record's provenance (sequence
  lengths, decode/prefill) adds no structure; `record` is not consulted and
  sizes come from `axes` (also when the record's axes are larger).
  """
  del record
  hidden, weight, bias = _synthesize(key, m=int(axes["M"]), d=int(axes["D"]), e=int(axes["E"]))
  return {
    "hidden": hidden,
    "weight": weight,
    "bias": bias,
    "routed_scaling_factor": jnp.asarray(ROUTED_SCALING_FACTOR, jnp.float32),
  }


def cpu_axes(axes: Mapping[str, int]) -> dict[str, int]:
  """M shrunk to 64 (+ M % 64); decode sizes (M <= 64) stay as recorded.
  D, E and TOPK are kept (the time at M=64: docs/perf/cpu_budgets.md)."""
  return {**axes, "M": shrink_rows(int(axes["M"]))}


# ---------------------------------------------------------------------------
# Roofline cost (`OpImpl.cost`, see `jaxkern.roofline`).


def moe_router_cost(definition, axes, *, inputs=None, record=None, config=None):
  """logits = hidden[M,D] weight[E,D]^T, then scoring and top-k on chip.
  FLOPs 2MED (the epilogue's per-logit math is not counted); bytes hidden +
  weight + bias + scalar read, ids and weights [M,TOPK] written."""
  return roofline.Work(2 * axes["M"] * axes["E"] * axes["D"], roofline.io_bytes(definition, axes), "bf16")


# How the op splits across devices (`jaxkern.spmd`): tokens; the top-k needs
# every expert's score and each score the whole hidden vector.
SPLIT = Split(
  inputs={"hidden": "m d", "weight": "e d", "bias": "e", "routed_scaling_factor": ""},
  outputs=("m t", "m t"),
  independent="m",
  reasons={"d": CONTRACTION, "e": "each token's top-k chooses among all experts"},
)
IMPL = OpImpl(
  reference=moe_router_reference,
  kernels=KERNELS,
  make_inputs=make_inputs,
  cpu_axes=cpu_axes,
  cost=moe_router_cost,
  axis_params={"top_k": "TOPK"},
  policies={"expert_ids": compare.TopK(scores=selection_scores), "expert_weights": compare.PairedWith("expert_ids")},
  split=SPLIT,
)
IMPLS = (IMPL,)


# ---------------------------------------------------------------------------
# Public op (`jaxkern.ops`), dispatched by `jaxkern.dispatch`.


def validate(hidden, weight, bias, *, routed_scaling_factor, top_k, **_) -> None:
  """The contract of `moe_router` (`jaxkern.contract`): hidden [..., D] and
  weight [E, D] of one float dtype, bias [E], a scalar scaling factor and
  1 <= top_k <= E."""
  c = Checks("moe_router")
  c.rank("hidden", hidden, "[..., D]", at_least=1)
  c.rank("weight", weight, "[E, D]", 2)
  c.shape("weight", weight, (None, hidden.shape[-1]), "[E, D]", "D from hidden.shape[-1]")
  experts = weight.shape[0]
  c.shape("bias", bias, (experts,), "[E]", "E from weight.shape[0]")
  c.floating("hidden", hidden)
  c.same_dtype("weight", weight, "hidden", hidden)
  c.floating("bias", bias)
  c.scalar("routed_scaling_factor", routed_scaling_factor)
  if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
    c.fail("top_k", f"an int in [1, E] with E = {experts} (weight.shape[0])", repr(top_k))


@public_op(validate, was_positional=("routed_scaling_factor",))
def moe_router(
  hidden: jax.Array,
  weight: jax.Array,
  bias: jax.Array,
  *,
  routed_scaling_factor: float | jax.Array = ROUTED_SCALING_FACTOR,
  top_k: int = 6,
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """DeepSeek-V4 sqrtsoftplus router: logits GEMM, biased top-k, weights.

  Contract:
  * hidden [..., D] bf16 (any number of rows, 0 included), weight [E, D]
    bf16, bias [E] f32, routed_scaling_factor a scalar; 1 <= top_k <= E.
    Returns (expert_ids int32 [..., top_k] ascending, expert_weights f32
    [..., top_k] permuted with them).
  * No index inputs (`checks=True` has nothing to check). Selection ranks
    scores + bias; equal values go to the lower expert id; a NaN ranks
    above every number (`lax.top_k`'s order), so a row of NaN selects
    experts 0..top_k-1. expert_ids are always in [0, E); a row whose
    selected scores are not finite gets non-finite weights.

  Backends: `xla`, `triton`.
  """
  *batch, d = hidden.shape
  inputs = {
    "hidden": hidden.reshape(-1, d),
    "weight": weight,
    "bias": bias,
    "routed_scaling_factor": jnp.asarray(routed_scaling_factor, jnp.float32),
  }
  ids, weights = dispatch.run(IMPL, inputs, const_axes={"TOPK": top_k}, config=config, backend=backend, checks=checks)
  return ids.reshape(*batch, top_k), weights.reshape(*batch, top_k)
