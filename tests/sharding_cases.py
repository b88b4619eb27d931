"""Small problems of every op for the sharding tests (not a test file):
`tests/test_spmd.py` runs and lowers them inside `jax.shard_map` on one
device; `tests/multidevice_ops.py` splits them across CPU devices.

Each case names the independent dimensions (`jaxkern.spmd.Split`) it splits,
the first over mesh axis "x", the second over "y"; its sizes divide by 2
there."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import kit
from jax.sharding import PartitionSpec as P

from jaxkern import dispatch, registry, spmd

MESH_AXES = ("x", "y")


@dataclasses.dataclass(frozen=True)
class ShardCase:
  definition: str
  axes: Mapping[str, int]
  split: tuple[str, ...]  # dimension names split over "x", then "y"

  @property
  def op(self) -> registry.Op:
    return registry.get(self.definition)

  @property
  def label(self) -> str:
    return f"{self.definition}-{'+'.join(self.split)}"

  def inputs(self, seed: int = 0) -> dict[str, jax.Array]:
    return self.op.make_inputs(kit.full_axes(self.op, self.axes), seed=seed, allow_shrunk_constants=True)

  def call(self, backend: str, interpret: bool | None = None) -> Callable[[Mapping[str, jax.Array]], Any]:
    """The op through `jaxkern.dispatch` (as every public op calls it)."""
    op = self.op
    const = {**op.definition.const_axes, **{a: v for a, v in self.axes.items() if a in op.definition.const_axes}}
    return lambda arrays: dispatch.run(op.impl, arrays, backend=backend, const_axes=const, interpret=interpret)

  def factors(self, mesh_axes: tuple[str, ...] = MESH_AXES) -> spmd.Factors:
    return {dim: (axis,) for dim, axis in zip(self.split, mesh_axes)}

  def in_specs(self, names, mesh_axes: tuple[str, ...] = MESH_AXES) -> dict[str, P]:
    split = self.op.impl.split
    return {n: spmd.spec_for(split.dims(n), self.factors(mesh_axes)) for n in names}

  def out_specs(self, mesh_axes: tuple[str, ...] = MESH_AXES) -> Any:
    specs = tuple(spmd.spec_for(dims, self.factors(mesh_axes)) for dims in self.op.impl.split.output_dims())
    return specs[0] if len(specs) == 1 else specs


CASES = [
  ShardCase("dense_gemm_bf16_nt_n4096_k4096", {"M": 32, "N": 64, "K": 64}, ("m", "n")),
  ShardCase("moe_router_gemm_topk_deepseek41_d5120_e384_topk6", {"M": 8, "D": 128, "E": 16}, ("m",)),
  ShardCase(
    "grouped_gemm_fp8_fp4_e384_n4608_k5120_g32",
    {"M": 24, "E": 16, "N": 64, "K": 128, "K_groups": 4, "K_packed": 64},
    ("m", "n"),
  ),
  ShardCase("noncausal_dense_attention_h32_d64", {"B": 2, "Nq": 16, "Nk": 24, "H": 4}, ("b", "h")),
  ShardCase("prefix_cached_block_causal_h32_d128", {"B": 1, "Nq": 16, "Np": 8, "H": 2, "D": 64}, ("s", "h")),
  ShardCase("prefix_cached_block_causal_h32_d128_prefix0", {"B": 2, "Nq": 16, "H": 2, "D": 64}, ("b", "h")),
  ShardCase("neighborhood_attention_3d_h8_d64_kt3_ky5_kx5", {"B": 2, "T": 3, "Y": 5, "X": 5, "H": 2}, ("b", "h")),
  ShardCase("gdn_decode_qk4_v8_d128_k_last", {"batch_size": 2}, ("b", "h")),
  ShardCase("gdn_prefill_qk4_v8_d128_k_last", {"total_seq_len": 24, "num_seqs": 2, "len_cu_seqlens": 3}, ("h",)),
  ShardCase("sparse_mla_prefill_h64_d512_k128", {"M": 4, "Nkv": 64, "H": 32, "D": 128}, ("m", "h")),
  ShardCase(
    "mixed_mla_decode_deepseek41_h64_d512_k8128_k4512",
    {
      "B": 2,
      "N8": 1,
      "N4": 1,
      "H": 32,
      "D": 128,
      "token_bytes_fp8": 132,
      "token_bytes_fp4": 72,
      "P8": 64,
      "P4": 64,
      "K8": 32,
      "K4": 64,
    },
    ("b", "h"),
  ),
  ShardCase("qsa_index_topk_decode_qwen38_h4_d128_topk512_c4", {"B": 2, "MP": 2, "NP": 4}, ("b",)),
  ShardCase("qsa_sparse_gqa_decode_qwen38_h24_kv2_d256_topk512_c4", {"B": 2, "MP": 2, "NP": 4}, ("b", "h")),
]
