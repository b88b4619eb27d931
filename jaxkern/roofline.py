"""Roofline: FLOPs and minimum HBM bytes of a run, and its speed of light.

The generic part: device peaks (`DEVICES`, data with the source of every
number), `Cost`, `speed_of_light_ms`, `performance_fields` (what a replay
result gains) and the byte helpers the formulas use. The formulas
themselves live with their families (`OpImpl.cost` in
`jaxkern/families/<name>.py`); `registry.Op.cost` applies one. A new
definition of an existing family therefore needs no code here.

What every formula counts:
- FLOPs: 2 per multiply-add of the operator's products (QK^T and PV for
  attention, the GEMMs, the matrix-vector products of the delta rule);
  softmax, activations, scales and top-k comparisons are not counted (they
  are not tensor-core work and are a few percent at most).
- Bytes: what must cross HBM at least once: every input read once and every
  output written once, at its size *as stored* (bf16 2 bytes, f32 and int32
  4, fp8 / uint8 / bool 1; packed FP4 as its uint8 bytes; quantization
  scales included; `io_bytes`), never an intermediate (scores, logits,
  probabilities stay on chip in an ideal kernel). Exceptions, per family:
  gathered operands count only the rows gathered (bounded by the table they
  come from), paged caches only the pages the page table can reference
  (bounded by the cache), grouped weights only the experts the rows route
  to.
- The work actually done: where the data (padding masks, segments, routed
  experts, valid index slots, sequence lengths, page tables) rather than the
  axes decides how much is computed or read, a formula counts it from the
  run's `inputs` (the replay passes them); without inputs it falls back to a
  bound from the axes, and `Cost.counted_from` says which (`"inputs"` or
  `"axes"`).
- The peak: each cost names the peak its FLOPs are judged against
  (`dtype_class`: bf16 or fp8 tensor-core MMA, or fp32 CUDA cores), chosen to
  match the instructions the kernel runs (a kernel whose dots are bf16 is
  judged at the bf16 peak even if its operands are stored in FP8), and HBM
  for the bytes (`Cost.peak_text`).
- Gathers (sparse and paged attention): `gather_bytes` counts what the
  per-query gathers move before any reuse (every valid slot's row, once per
  query row that selects it), reported beside the roofline as its own floor
  at HBM bandwidth (`gather_floor_ms`): it is what a kernel moves through the
  memory system when rows are not shared between programs.

`speed_of_light_ms(flops, bytes, device, dtype_class)` is
`max(flops / peak, bytes / bandwidth)`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxkern import dataset

# --------------------------------------------------------------------------
# Device peaks (data). TFLOP/s are dense (no structured sparsity); TB/s are
# 10^12 bytes per second.

_H100_SHEET = (
  "NVIDIA H100 Tensor Core GPU Architecture whitepaper, H100 SXM5 column: dense BF16 989.4, FP8 "
  "1978.9, FP32 (non-tensor) 66.9 TFLOP/s; HBM3 3.35 TB/s from the H100 datasheet (SXM), which "
  "rounds the compute to 989 / 1979 / 67 (its BF16 1979 and FP8 3958 are with sparsity)"
)
_H200_SHEET = (
  "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: HBM3e 4.8 TB/s; compute as the H100 SXM "
  "(BF16 1979 and FP8 3958 TFLOP/s with sparsity, half that dense; FP32 67)"
)
_H200_MEASURED = (
  "measured on the project's H200 (figures given in a work brief; method and date not recorded in this repository)"
)

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
    "sources": {
      "datasheet": _H200_SHEET,
      "measured": _H200_MEASURED + ": dense BF16 GEMM 790 TFLOP/s, device-to-device copy about 4.3 TB/s",
    },
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


def speed_of_light_ms(
  flops: float, bytes: float, device: str = DEFAULT_DEVICE, dtype_class: str = "bf16", basis: str = "datasheet"
) -> float:
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
class Work:
  """What a family's cost formula returns (`OpImpl.cost`): FLOPs, minimum
  HBM bytes, the peak class of its FLOPs, the bytes its per-query gathers
  move (0: no gather), and whether the run's inputs decided the counts."""

  flops: int
  bytes: int
  dtype_class: str = "bf16"
  gather_bytes: int = 0
  counted_from: str = "axes"  # "inputs": counted from the run's data; "axes": a bound from the axes


@dataclasses.dataclass(frozen=True)
class Cost:
  flops: int
  bytes: int
  dtype_class: str  # which peak bounds the FLOPs: "bf16", "fp8" (tensor-core MMA) or "fp32" (CUDA cores)
  family: str  # the formula used (its function name)
  gather_bytes: int = 0
  counted_from: str = "axes"

  def speed_of_light_ms(self, device: str = DEFAULT_DEVICE, basis: str = "datasheet") -> float:
    return speed_of_light_ms(self.flops, self.bytes, device, self.dtype_class, basis)

  def bound(self, device: str = DEFAULT_DEVICE, basis: str = "datasheet") -> str:
    """'compute' or 'memory': which term of the roofline is larger."""
    p = peaks(device, basis)
    compute = self.flops / p[f"{self.dtype_class}_tflops"]
    return "compute" if compute >= self.bytes / p["hbm_tb_s"] else "memory"

  def peak_text(self, device: str = DEFAULT_DEVICE, basis: str = "datasheet") -> str:
    """The peaks this cost is judged against, e.g. 'bf16 MMA 989.4 TFLOP/s,
    HBM 4.8 TB/s'."""
    p = peaks(device, basis)
    unit = "CUDA cores" if self.dtype_class == "fp32" else "MMA"
    return f"{self.dtype_class} {unit} {p[f'{self.dtype_class}_tflops']:g} TFLOP/s, HBM {p['hbm_tb_s']:g} TB/s"

  def gather_floor_ms(self, device: str = DEFAULT_DEVICE, basis: str = "datasheet") -> float | None:
    """`gather_bytes` at HBM bandwidth, in ms (None without a gather)."""
    if not self.gather_bytes:
      return None
    return self.gather_bytes / (peaks(device, basis)["hbm_tb_s"] * 1e12) * 1e3


def tensor_bytes(d: dataset.Definition, name: str, axes: Mapping[str, int]) -> int:
  """Bytes of one input or output of `d` at `axes`, as stored (a scalar: its
  itemsize)."""
  spec = d.inputs.get(name) or d.outputs[name]
  return int(math.prod(spec.concrete_shape(axes))) * np.dtype(spec.np_dtype).itemsize


def io_bytes(d: dataset.Definition, axes: Mapping[str, int], skip: tuple[str, ...] = ()) -> int:
  """Every input read once and every output written once, except `skip`."""
  return sum(tensor_bytes(d, n, axes) for n in (*d.inputs, *d.outputs) if n not in skip)


def performance_fields(
  cost: Callable[[], Cost], latency_ms: float | None, *, device_kind: str | None, measured_on_gpu: bool
) -> dict[str, Any]:
  """What a replay result's `evaluation.performance` gains from `cost()` (the
  run's `Cost`): `speed_of_light_ms` (on the device kind if it is a known
  GPU, else the H200; datasheet peaks), a `roofline` dict (flops, bytes,
  device, dtype_class, the peaks by name, bound, what the counts came from,
  and for gathering kernels gather_bytes and gather_floor_ms), and, only when
  `measured_on_gpu`, `sol_fraction` = speed of light / latency (1.0 = at the
  roofline). A run whose cost cannot be computed gets `speed_of_light_ms:
  None` and the reason, never an exception."""
  try:
    c = cost()
  except Exception as e:  # a roofline gap must not fail a workload
    return {"speed_of_light_ms": None, "roofline": {"error": f"{type(e).__name__}: {e}"}}
  device = device_key(device_kind)
  sol = c.speed_of_light_ms(device)
  line: dict[str, Any] = {
    "flops": c.flops,
    "bytes": c.bytes,
    "device": device,
    "dtype_class": c.dtype_class,
    "peak": c.peak_text(device),
    "bound": c.bound(device),
    "basis": "datasheet",
    "counted_from": c.counted_from,
  }
  if c.gather_bytes:
    line.update(gather_bytes=c.gather_bytes, gather_floor_ms=c.gather_floor_ms(device))
  out: dict[str, Any] = {"speed_of_light_ms": sol, "roofline": line}
  if measured_on_gpu:
    out["sol_fraction"] = sol / latency_ms if latency_ms else None
  return out


def host(x: Any) -> np.ndarray:
  """An input as a numpy array, for formulas that count from the run's data."""
  return np.asarray(x)
