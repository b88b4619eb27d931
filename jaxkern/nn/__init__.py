"""Flax NNX layers on `jaxkern.ops` (needs the `nn` extra: `pip install 'jaxkern[nn]'`).

| layer | what it runs |
| --- | --- |
| `Attention` | projections on `ops.dense_gemm`; `ops.attention` or `ops.block_causal_attention` |
| `MoE` | `ops.moe_router`; FP8 x FP4 experts (`ops.grouped_gemm_mxfp4_ste`) |
| `GatedDeltaNet` | `ops.gdn_prefill` over packed sequences |
| `NeighborhoodAttention3D` | `ops.neighborhood_attention_3d` |
| `SparseMLA` | `ops.sparse_mla_prefill` (absorbed MLA, per-head sinks) |

`Attention` does self- and cross-attention, key masks, `causal=True` and
grouped-query heads (`num_kv_heads`); `MoE` trains its MXFP4 experts
through the straight-through estimator.

Each layer is an `nnx.Module`: its parameters are `nnx.Param`s of float32
master weights in the layouts the ops take (`[out, in]` projections), drawn
at construction from `rngs` (LeCun normal unless the layer says otherwise);
activations go through the ops in bf16 and come back in the input's dtype.
`backend=` (None, "xla", "pallas", "triton", "mosaic_gpu"; `jaxkern.ops`)
is passed to every op call, so the same model runs on the kernels or on the
XLA references. Differentiable end to end (`nnx.grad`, `nnx.Optimizer`).

Sharding: a layer with heads takes `heads_axis`, the mesh axis its heads
are split over (tensor parallelism); its parameters then carry their
sharding as metadata (`nnx.with_partitioning`; `nnx.get_partition_spec`
reads it) and flax places them on the mesh when the layer is created under
`jax.set_mesh(mesh)`. Activations split along the batch or tokens as the
input is split (data parallelism): on an Explicit mesh each op runs per
shard (`jaxkern.spmd`), and a layer gathers the dims its op cannot split
(tokens of a recurrence, a grid of windows, heads before an output
projection) and returns its output sharded as its input. The MoE layer
runs per shard of tokens with replicated weights.

Importing `jaxkern` or `jaxkern.ops` does not import flax.
"""

from __future__ import annotations

try:
  import flax.nnx  # noqa: F401
except ImportError as e:  # pragma: no cover - the extra's absence is tested in a subprocess
  raise ImportError(
    "jaxkern.nn needs Flax (flax>=0.12,<0.13): install jaxkern with the nn extra, pip install 'jaxkern[nn]'"
  ) from e

from jaxkern.nn.attention import Attention
from jaxkern.nn.gdn import GatedDeltaNet
from jaxkern.nn.moe import MoE, RouterBias
from jaxkern.nn.neighborhood import NeighborhoodAttention3D
from jaxkern.nn.sparse_mla import SparseMLA, causal_window_indices

__all__ = [
  "Attention",
  "GatedDeltaNet",
  "MoE",
  "NeighborhoodAttention3D",
  "RouterBias",
  "SparseMLA",
  "causal_window_indices",
]
