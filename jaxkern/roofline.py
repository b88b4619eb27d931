"""Roofline: FLOPs and minimum HBM bytes of a workload, and its speed of light.

`cost(definition, axes)` gives the work of one workload from its full axes
(variable and constant) with one formula per definition *family*, found by
the function name of the definition's `reference` field (e.g.
`dense_gemm_reference`), else by its `op_type` where that names one family
only. A new definition of an existing family (another N, K, head count or
window) therefore needs no code here.

What is counted (every formula):
- FLOPs: 2 per multiply-add of the operator's products (QK^T and PV for
  attention, the GEMMs, the matrix-vector products of the delta rule);
  softmax, activations, scales and top-k comparisons are not counted (they
  are not tensor-core work and are a few percent at most).
- Bytes: what must cross HBM at least once: every input read once and every
  output written once, at its size *as stored* (bf16 2 bytes, f32 and int32
  4, fp8 / uint8 / bool 1; packed FP4 as its uint8 bytes; quantization
  scales included), never an intermediate (scores, logits, probabilities
  stay on chip in an ideal kernel). Exceptions, per family below: gathered
  operands count only the rows gathered (bounded by the table they come
  from), paged caches only the pages the page table can reference (bounded
  by the cache), grouped weights only the experts the rows route to.
- The formulas see axes only (data such as index values, padding masks and
  sequence lengths is not in the axes): where the data decides how much is
  read or computed, the docstring says which bound is used. The one
  exception is the block-causal mask, whose segments come from the record's
  `prefix_segments` (as the replay synthesizes them) when a record is given.

`speed_of_light_ms(flops, bytes, device, dtype_class)` is
`max(flops / peak, bytes / bandwidth)` with the device peaks in `DEVICES`
(data, with the source of every number).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np

from jaxkern import dataset

# --------------------------------------------------------------------------
# Device peaks (data). TFLOP/s are dense (no structured sparsity); TB/s are
# 10^12 bytes per second.

_H100_SHEET = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper, H100 SXM5 column: dense BF16 989.4, FP8 "
               "1978.9, FP32 (non-tensor) 66.9 TFLOP/s; HBM3 3.35 TB/s from the H100 datasheet (SXM), which "
               "rounds the compute to 989 / 1979 / 67 (its BF16 1979 and FP8 3958 are with sparsity)")
_H200_SHEET = ("NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: HBM3e 4.8 TB/s; compute as the H100 SXM "
               "(BF16 1979 and FP8 3958 TFLOP/s with sparsity, half that dense; FP32 67)")
_H200_MEASURED = ("measured on the project's H200 (figures given in the issue 14 work brief; "
                  "method and date not recorded in this repository)")

DEVICES: dict[str, dict[str, Any]] = {
    "h100_sxm": {
        "name": "NVIDIA H100 SXM5 80GB",
        "datasheet": {"bf16_tflops": 989.4, "fp8_tflops": 1978.9, "fp32_tflops": 66.9, "hbm_tb_s": 3.35},
        "measured": {},
        "sources": {"datasheet": _H100_SHEET},
    },
    "h200": {
        "name": "NVIDIA H200 SXM 141GB",
        "datasheet": {"bf16_tflops": 989.4, "fp8_tflops": 1978.9, "fp32_tflops": 66.9, "hbm_tb_s": 4.8},
        "measured": {"bf16_tflops": 790.0, "hbm_tb_s": 4.3},
        "sources": {"datasheet": _H200_SHEET, "measured": _H200_MEASURED + ": dense BF16 GEMM 790 TFLOP/s, "
                    "device-to-device copy about 4.3 TB/s"},
    },
}
DEFAULT_DEVICE = "h200"
DTYPE_CLASSES = ("bf16", "fp8", "fp32")


def device_key(device_kind: str | None) -> str:
  """The `DEVICES` key of a jax `device_kind` (e.g. 'NVIDIA H100 80GB HBM3'
  -> 'h100_sxm'); the H200 for anything not known (a CPU, another GPU)."""
  kind = (device_kind or "").upper()
  if "H200" in kind:
    return "h200"
  if "H100" in kind and "PCIE" not in kind and "NVL" not in kind:
    return "h100_sxm"
  return DEFAULT_DEVICE


def peaks(device: str, basis: str = "datasheet") -> dict[str, float]:
  """Peak figures of `device` (a `DEVICES` key); `basis='measured'` takes the
  measured figures where there are any and the datasheet's otherwise."""
  d = DEVICES[device]
  if basis not in ("datasheet", "measured"):
    raise ValueError(f"basis must be 'datasheet' or 'measured', got {basis!r}")
  return {**d["datasheet"], **(d["measured"] if basis == "measured" else {})}


def speed_of_light_ms(flops: float, bytes: float, device: str = DEFAULT_DEVICE,  # pylint: disable=redefined-builtin
                      dtype_class: str = "bf16", basis: str = "datasheet") -> float:
  """max(flops / peak of `dtype_class`, bytes / HBM bandwidth), in ms."""
  if dtype_class not in DTYPE_CLASSES:
    raise ValueError(f"dtype_class must be one of {DTYPE_CLASSES}, got {dtype_class!r}")
  p = peaks(device, basis)
  compute_s = flops / (p[f"{dtype_class}_tflops"] * 1e12)
  memory_s = bytes / (p["hbm_tb_s"] * 1e12)
  return max(compute_s, memory_s) * 1e3


# --------------------------------------------------------------------------
# Costs.


@dataclasses.dataclass(frozen=True)
class Cost:
  flops: int
  bytes: int
  dtype_class: str  # which peak bounds the FLOPs: "bf16", "fp8" or "fp32"
  family: str       # the formula used (its function name here)

  def speed_of_light_ms(self, device: str = DEFAULT_DEVICE, basis: str = "datasheet") -> float:
    return speed_of_light_ms(self.flops, self.bytes, device, self.dtype_class, basis)

  def bound(self, device: str = DEFAULT_DEVICE, basis: str = "datasheet") -> str:
    """'compute' or 'memory': which term of the roofline is larger."""
    p = peaks(device, basis)
    compute = self.flops / p[f"{self.dtype_class}_tflops"]
    return "compute" if compute >= self.bytes / p["hbm_tb_s"] else "memory"


def _size(d: dataset.Definition, name: str, axes: Mapping[str, int]) -> int:
  """Bytes of one input or output as stored (a scalar: its itemsize)."""
  spec = d.inputs.get(name) or d.outputs[name]
  return int(math.prod(spec.concrete_shape(axes))) * np.dtype(spec.np_dtype).itemsize


def _io_bytes(d: dataset.Definition, axes: Mapping[str, int], skip: tuple[str, ...] = ()) -> int:
  """Every input read once and every output written once, except `skip`."""
  return sum(_size(d, n, axes) for n in (*d.inputs, *d.outputs) if n not in skip)


Formula = Callable[[dataset.Definition, Mapping[str, int], Mapping[str, Any] | None], tuple[int, int, str]]


def dense_gemm(d, a, record=None):
  """C[M,N] = A[M,K] B[N,K]^T. FLOPs 2MNK; bytes A + B + C once (bf16)."""
  return 2 * a["M"] * a["N"] * a["K"], _io_bytes(d, a), "bf16"


def moe_router(d, a, record=None):
  """logits = hidden[M,D] weight[E,D]^T, then scoring and top-k on chip.
  FLOPs 2MED (the epilogue's per-logit math is not counted); bytes hidden +
  weight + bias + scalar read, ids and weights [M,TOPK] written."""
  return 2 * a["M"] * a["E"] * a["D"], _io_bytes(d, a), "bf16"


def expected_experts(rows: int, experts: int) -> float:
  """Expected number of distinct experts `rows` uniformly routed rows touch:
  E (1 - (1 - 1/E)^rows); exactly 1 for one row or one expert."""
  if rows <= 0:
    return 0.0
  return experts * (1.0 - (1.0 - 1.0 / experts) ** rows)


def grouped_gemm_fp8_fp4(d, a, record=None):
  """C[m] = a[m] (FP8, UE8M0 scale per 32 k) times expert e(m)'s FP4 weight.
  FLOPs 2MNK, every row counted (padding rows `-1` are data, not axes), on
  the FP8 peak (Hopper has no FP4 tensor cores). Bytes: a, a_scale,
  expert_ids read and C written once; of the weights b and b_scale (packed
  e2m1 and UE8M0 bytes as stored) only the experts the rows route to, the
  expected number of distinct experts under uniform routing
  (`expected_experts(M, E)`, exact for M=1; at most min(M, E))."""
  m, e = a["M"], a["E"]
  per_expert = (_size(d, "b", a) + _size(d, "b_scale", a)) / e
  weights = round(expected_experts(m, e) * per_expert)
  return 2 * m * a["N"] * a["K"], _io_bytes(d, a, skip=("b", "b_scale")) + weights, "fp8"


def noncausal_attention(d, a, record=None):
  """Non-causal attention: FLOPs 4 B H Nq Nk D (QK^T and PV). Keys masked
  out by `key_valid` (padded text) are data, not axes: all Nk keys are
  counted, so for padded variants the speed of light is an upper bound.
  Bytes: q, k, v, key_valid read and o written once (K/V read once per batch
  row, not once per query block)."""
  return 4 * a["B"] * a["H"] * a["Nq"] * a["Nk"] * a["D"], _io_bytes(d, a), "bf16"


def prefix_cached_attention(d, a, record=None):
  """Every target query sees Np prefix keys and Nq target keys: FLOPs
  4 B H Nq (Nq + Np) D. Bytes: q, k, v, k_prefix, v_prefix read and o
  written once."""
  return 4 * a["B"] * a["H"] * a["Nq"] * (a["Nq"] + a["Np"]) * a["D"], _io_bytes(d, a), "bf16"


def block_causal_pairs(segment_ends: list[int]) -> int:
  """Visible (query, key) pairs of a block-causal mask over segments ending
  at `segment_ends`: a query of segment s sees every key up to the end of s,
  so sum_s len(s) * end(s)."""
  pairs, start = 0, 0
  for end in segment_ends:
    pairs += (end - start) * end
    start = end
  return pairs


def block_causal_attention(d, a, record=None):
  """Block-causal over segments: only visible pairs are counted, FLOPs
  4 B H D * pairs with pairs = `block_causal_pairs(ends)`. The segments are
  the record's `prefix_segments` rescaled to Nq as the replay synthesizes
  them; without a record one segment (pairs = Nq^2, what the replay runs
  then). Bytes: q, k, v, segment_ids read and o written once."""
  nq = a["Nq"]
  ends = [nq]
  segments = (record or {}).get("prefix_segments")
  if segments:
    from jaxkern.families.flash_attention import segment_ends  # pylint: disable=g-import-not-at-top
    ends = segment_ends(segments, nq)
  return 4 * a["B"] * a["H"] * a["D"] * block_causal_pairs(ends), _io_bytes(d, a), "bf16"


def neighborhood_attention_3d(d, a, record=None):
  """3-D neighborhood attention: each query sees exactly KT*KY*KX keys (NATTEN
  windows are shifted inward at borders, never truncated), so FLOPs
  4 B T Y X H D KT KY KX. Bytes: q, k, v read and o written once (each key
  row is shared by up to KT*KY*KX queries but read once)."""
  n = a["B"] * a["T"] * a["Y"] * a["X"]
  return 4 * n * a["H"] * a["D"] * a["KT"] * a["KY"] * a["KX"], _io_bytes(d, a), "bf16"


def _gdn_flops(tokens: int, a: Mapping[str, int]) -> int:
  """Per token and v-head, over the K x V state: decay (1 per element),
  k^T S (2), the rank-1 update (2), q^T S (2): 7 K V."""
  return 7 * tokens * a["num_v_heads"] * a["head_size"] * a["head_size"]


def gdn_decode(d, a, record=None):
  """Gated delta rule, one token per sequence: FLOPs 7 B HV K V (see
  `_gdn_flops`; the per-head gates are not counted), matrix-vector work on
  the FP32 (non-tensor-core) peak. Bytes: all inputs read once (the f32
  state [B,HV,K,V] dominates) and output and new_state written once."""
  return _gdn_flops(a["batch_size"] * a["seq_len"], a), _io_bytes(d, a), "fp32"


def gdn_prefill(d, a, record=None):
  """Gated delta rule over total_seq_len tokens: FLOPs 7 T HV K V, the
  sequential recurrence's work (a chunked kernel does somewhat more), on the
  BF16 peak (the chunked form runs on tensor cores). Bytes: all inputs
  (q, k, v, gates, cu_seqlens, the f32 initial state [N,HV,K,V]) read and
  output and new_state written once."""
  return _gdn_flops(a["total_seq_len"], a), _io_bytes(d, a), "bf16"


def sparse_mla_prefill(d, a, record=None):
  """Sparse MLA over gathered latent rows (D used as both K and V): each query
  row attends to at most min(TOPK, Nkv) valid indices (invalid `-1` slots
  are data: the rest are counted as valid), so FLOPs 4 M H min(TOPK, Nkv) D.
  Bytes: q, indices, sink, scalar read, out and lse written once; of the
  workspace kv only the gathered rows, at most min(M*TOPK, Nkv) distinct
  rows."""
  slots = min(a["TOPK"], a["Nkv"])
  row = _size(d, "kv", a) // max(a["Nkv"], 1)
  gathered = min(a["M"] * a["TOPK"], a["Nkv"]) * row
  return 4 * a["M"] * a["H"] * slots * a["D"], _io_bytes(d, a, skip=("kv",)) + gathered, "bf16"


def mixed_mla_decode(d, a, record=None):
  """Mixed FP8/FP4 MLA decode: each batch row attends to at most
  min(K8, N8*P8) FP8 tokens plus min(K4, N4*P4) FP4 tokens: FLOPs
  4 B H (those) D. Bytes: q, both index tables, sink, scalar read, out and
  lse written once; of the paged caches only gathered tokens, as stored
  (FP8: 512 e4m3 bytes + 4 f32 scales = 528; FP4: 256 packed bytes + 32
  UE8M0 scales = 288 per token), at most min(B*K8, N8*P8) and
  min(B*K4, N4*P4) distinct tokens. The dequantized tokens meet the queries
  on the BF16 peak."""
  n8, n4 = a["N8"] * a["P8"], a["N4"] * a["P4"]
  slots = min(a["K8"], n8) + min(a["K4"], n4)
  gathered = (min(a["B"] * a["K8"], n8) * (_size(d, "kv_fp8", a) // max(n8, 1))
              + min(a["B"] * a["K4"], n4) * (_size(d, "kv_fp4", a) // max(n4, 1)))
  return (4 * a["B"] * a["H"] * slots * a["D"], _io_bytes(d, a, skip=("kv_fp8", "kv_fp4")) + gathered,
          "bf16")


def qsa_index_topk(d, a, record=None):
  """QSA indexer: every sequence scores its compressed keys through its page
  table; a sequence has at most MP*P of them (its actual count is data), so
  FLOPs 2 B MP P H D (relu and the head sum are not counted). Top-k: the
  selection's comparisons are not FLOPs and the scores stay on chip; only
  the ids [B,TOPK] are written. Bytes: q, page_table, seq_lens read, ids
  written once; of index_k only the pages the page tables can reference,
  min(NP, B*MP) pages (shared prefix pages read once)."""
  pages = min(a["NP"], a["B"] * a["MP"])
  page = _size(d, "index_k", a) // max(a["NP"], 1)
  flops = 2 * a["B"] * a["MP"] * a["P"] * a["H"] * a["D"]
  return flops, _io_bytes(d, a, skip=("index_k",)) + pages * page, "bf16"


def qsa_sparse_gqa_decode(d, a, record=None):
  """QSA sparse GQA decode: a sequence sees at most its TOPK selected blocks
  of C tokens plus an incomplete tail (< C tokens), and at most its page
  table's MP*P tokens: t = min(MP*P, TOPK*C + C - 1) per sequence, FLOPs
  4 B HQ t D. Bytes: q, page_table, seq_lens, topk_ids, scalar read and o
  written once; of k_cache and v_cache only gathered token rows (all HKV
  heads of a token), at most min(B*t, NP*P) distinct tokens."""
  t = min(a["MP"] * a["P"], a["TOPK"] * a["C"] + a["C"] - 1)
  tokens = a["NP"] * a["P"]
  row = (_size(d, "k_cache", a) + _size(d, "v_cache", a)) // max(tokens, 1)
  gathered = min(a["B"] * t, tokens) * row
  return 4 * a["B"] * a["HQ"] * t * a["D"], _io_bytes(d, a, skip=("k_cache", "v_cache")) + gathered, "bf16"


# Keyed by the function name of a definition's `reference` field.
FORMULAS: dict[str, Formula] = {
    "dense_gemm_reference": dense_gemm,
    "moe_router_reference": moe_router,
    "grouped_gemm_fp8_fp4_reference": grouped_gemm_fp8_fp4,
    "noncausal_attention_reference": noncausal_attention,
    "prefix_cached_attention_reference": prefix_cached_attention,
    "block_causal_attention_reference": block_causal_attention,
    "neighborhood_attention_3d_reference": neighborhood_attention_3d,
    "gdn_decode_reference": gdn_decode,
    "gdn_prefill_reference": gdn_prefill,
    "sparse_mla_prefill_reference": sparse_mla_prefill,
    "mixed_mla_decode_reference": mixed_mla_decode,
    "qsa_index_topk_reference": qsa_index_topk,
    "qsa_sparse_gqa_decode_reference": qsa_sparse_gqa_decode,
}
# op_types naming one family only (`attention`, `mla`, `qsa`, `gdn` name
# several: those go by reference function).
BY_OP_TYPE: dict[str, Formula] = {
    "gemm": dense_gemm,
    "moe_router": moe_router,
    "grouped_gemm": grouped_gemm_fp8_fp4,
    "neighborhood_attention": neighborhood_attention_3d,
}


def formula_for(definition: dataset.Definition) -> Formula:
  """The family formula of a definition; KeyError when it has none."""
  func = definition.reference.partition(":")[2]
  if func in FORMULAS:
    return FORMULAS[func]
  if definition.op_type in BY_OP_TYPE:
    return BY_OP_TYPE[definition.op_type]
  raise KeyError(f"{definition.name}: no roofline formula for reference {definition.reference!r} "
                 f"(op_type {definition.op_type!r}); add one to jaxkern.roofline.FORMULAS")


def cost(definition: dataset.Definition, axes: Mapping[str, int], record: Mapping[str, Any] | None = None) -> Cost:
  """FLOPs and minimum HBM bytes of `definition` at `axes` (variable axes
  suffice; constant axes not given take the definition's values, given ones
  win, as in a run with shrunk constants). `record`: the workload record,
  used only where it carries mask structure (`prefix_segments`)."""
  formula = formula_for(definition)
  full = {**definition.const_axes, **{k: int(v) for k, v in axes.items()}}
  flops, nbytes, dtype_class = formula(definition, full, record)
  return Cost(flops=int(flops), bytes=int(nbytes), dtype_class=dtype_class, family=formula.__name__)


def performance_fields(definition: dataset.Definition, axes: Mapping[str, int], latency_ms: float | None, *,
                       device_kind: str | None, measured_on_gpu: bool,
                       record: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """What a replay result's `evaluation.performance` gains: `speed_of_light_ms`
  (for `axes`, on the device kind if it is a known GPU, else the H200;
  datasheet peaks), a `roofline` dict (flops, bytes, device, dtype_class,
  bound), and, only when `measured_on_gpu`, `sol_fraction` = speed of light
  / latency (1.0 = at the roofline). A definition without a formula gets
  `speed_of_light_ms: None` and the reason, never an exception."""
  try:
    c = cost(definition, axes, record)
  except Exception as e:  # pylint: disable=broad-except  # a roofline gap must not fail a workload
    return {"speed_of_light_ms": None, "roofline": {"error": f"{type(e).__name__}: {e}"}}
  device = device_key(device_kind)
  sol = c.speed_of_light_ms(device)
  out: dict[str, Any] = {
      "speed_of_light_ms": sol,
      "roofline": {"flops": c.flops, "bytes": c.bytes, "device": device, "dtype_class": c.dtype_class,
                   "bound": c.bound(device), "basis": "datasheet"}}
  if measured_on_gpu:
    out["sol_fraction"] = sol / latency_ms if latency_ms else None
  return out
