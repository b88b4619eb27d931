"""A DeepSeek-style mixture-of-experts layer on `ops.moe_router` and the FP8 x
FP4 grouped GEMM, trainable through its straight-through estimator."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkern import ops, spmd
from jaxkern.nn.common import LECUN_EXPERTS, param

# How the layer splits across devices: it is independent per token (rows);
# every weight stays whole.
SPLIT = spmd.Split(
  inputs={"x": "m d", "router": "e d", "router_bias": "e", "w_gate_up": "e h d", "w_down": "e d f"},
  outputs=("m d",),
  independent="m",
  reasons={
    "d": "the model features: the router's and the gate/up projection's contraction",
    "e": "each token's top-k chooses among all experts; for expert parallelism see examples/moe_sharded.py",
    "h": "the gate and up halves of each expert's hidden features, split apart by the SwiGLU",
    "f": "the contraction of the down projection",
  },
)


class RouterBias(nnx.Variable):
  """The router's score-correction bias: it only reorders the top-k (no
  gradient reaches it), so it is not an `nnx.Param` and an optimizer over
  Params leaves it alone; DeepSeek adjusts it from the experts' load."""


class MoE(nnx.Module):
  """Mixture of experts: the sqrtsoftplus router picks `top_k` of
  `num_experts` experts per token (`ops.moe_router`, weights normalized and
  scaled by `routed_scaling_factor`), rows are grouped by expert, each
  expert's SwiGLU runs as two FP8 x FP4 grouped GEMMs on MXFP4 weights, and
  the expert outputs are combined with the router weights.

  `x` [..., d_model] (the normalized hidden states; any float dtype, the
  router runs in bf16) -> [..., d_model] in x's dtype.

  The experts' weights are float32 masters (`w_gate_up` [E, 2 * d_expert,
  d_model]: the gate then the up rows; `w_down` [E, d_model, d_expert]);
  every call quantizes them to MXFP4 and the rows to FP8 (`jaxkern.quant`,
  UE8M0 scales per 32) inside `ops.grouped_gemm_mxfp4_ste`, whose gradient
  is the straight-through estimator (the bf16 grouped GEMMs' gradient at the
  quantized operands). The router learns through its combine weights;
  `router_bias` [E] f32 (a `RouterBias`, zeros) is not trained by gradient.
  d_model and d_expert are multiples of 32 (the scale groups).

  `backend` goes to every op call. Sharding: the layer runs per shard of
  the tokens (`jaxkern.spmd`: on an Explicit mesh with x's rows split, in a
  `shard_map` over them; the replicated weights' gradients summed across
  the shards); its weights are not split: the experts' rows carry global
  ids (expert parallelism: `examples/moe_sharded.py`).
  """

  def __init__(
    self,
    d_model: int,
    d_expert: int,
    num_experts: int,
    top_k: int,
    *,
    routed_scaling_factor: float = 1.5,
    backend: ops.Backend = None,
    rngs: nnx.Rngs,
  ):
    for name, size in (("d_model", d_model), ("d_expert", d_expert)):
      if size % 32:
        raise ValueError(f"{name}={size} must be a multiple of 32 (the FP8 and MXFP4 scale groups)")
    if not 1 <= top_k <= num_experts:
      raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    self.top_k, self.routed_scaling_factor = top_k, routed_scaling_factor
    self.backend: ops.Backend = backend
    self.router = param(rngs, (num_experts, d_model))
    self.router_bias = RouterBias(jnp.zeros((num_experts,), jnp.float32))
    self.w_gate_up = param(rngs, (num_experts, 2 * d_expert, d_model), init=LECUN_EXPERTS)
    self.w_down = param(rngs, (num_experts, d_model, d_expert), init=LECUN_EXPERTS)

  def __call__(self, x: jax.Array) -> jax.Array:
    tokens = x.reshape(-1, x.shape[-1])
    weights = {
      "x": tokens,
      "router": self.router[...],
      "router_bias": self.router_bias[...],
      "w_gate_up": self.w_gate_up[...],
      "w_down": self.w_down[...],
    }
    out = spmd.run(SPLIT, "MoE", self._tokens, weights, pallas=False, check_vma=False)
    return out.reshape(x.shape).astype(x.dtype)

  def _tokens(self, arrays) -> jax.Array:
    """The layer on [T, d_model] tokens (all, or one shard's): -> [T, d_model] f32."""
    tokens = arrays["x"].astype(jnp.bfloat16)
    ids, weights = ops.moe_router(
      tokens,
      arrays["router"].astype(jnp.bfloat16),
      arrays["router_bias"],
      routed_scaling_factor=self.routed_scaling_factor,
      top_k=self.top_k,
      backend=self.backend,
    )
    # Rows grouped by expert (the grouped GEMM's fast layout): row r is slot
    # order[r] of token order[r] // top_k.
    order = jnp.argsort(ids.reshape(-1), stable=True)
    row_token, row_expert = order // self.top_k, ids.reshape(-1)[order]
    h = ops.grouped_gemm_mxfp4_ste(tokens[row_token], arrays["w_gate_up"], row_expert, backend=self.backend)
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    y = ops.grouped_gemm_mxfp4_ste(jax.nn.silu(gate) * up, arrays["w_down"], row_expert, backend=self.backend)
    row_weight = weights.reshape(-1)[order]
    combined = jnp.zeros(tokens.shape, jnp.float32)
    return combined.at[row_token].add(y.astype(jnp.float32) * row_weight[:, None])
