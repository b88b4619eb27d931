"""What our formats and FlashInfer-Bench 0.1.2's have in common: dtype
names, statuses, the folder layout of a TraceSet and the names we give
solutions.

Dtypes (ours: the definitions' `dtype` fields). FIB 0.1.2 has no `uint8`. Our uint8 tensors
are bytes of three kinds (`byte_kind`, from the tensor's description):
packed e2m1 (two FP4 codes per byte, low nibble = even element), UE8M0
scales (one byte `s` meaning 2**(s-127)) and byte records (a paged cache
token: e4m3 or e2m1 bytes followed by their scales). All three export as
`int8`: the same bytes read as signed, same shape. FIB's `float4_e2m1`
(torch `float4_e2m1fn_x2`, one byte holding two codes) would name packed
e2m1 more closely, but FIB 0.1.2's random inputs cannot be made in it
(torch 2.14: `.to(float4_e2m1fn_x2)` is not implemented), so a FIB benchmark
of such a definition would fail on every `random` workload; FIB has no e8m0
type at all. Every other dtype keeps its name. Import maps back: FIB's
`int8`, and `float4_e2m1` for packed e2m1, become our `uint8`; FIB's
`int64` index tensors our `int32` (the replay's blob loader accepts int64
blobs for int32 inputs, range-checked).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
from collections.abc import Mapping
from typing import Any

from jaxkern import dataset
from jaxkern.compare import Status

FIB_VERSION = "0.1.2"
# flashinfer_bench.data.definition.DType of 0.1.2.
FIB_DTYPES = (
  "float32",
  "float16",
  "bfloat16",
  "float8_e4m3fn",
  "float8_e5m2",
  "float4_e2m1",
  "int64",
  "int32",
  "int16",
  "int8",
  "bool",
)
# flashinfer_bench.data.trace.EvaluationStatus of 0.1.2: ours upper-cased; `skipped` has no FIB status.
FIB_STATUSES = {s: s.value.upper() for s in Status if s is not Status.SKIPPED}
OUR_STATUSES = {v: k for k, v in FIB_STATUSES.items()}

BYTES = "int8"  # the FIB dtype of every uint8 tensor of ours

AUTHOR = "jaxkern"
DEFAULT_BACKEND = "triton"


def byte_kind(spec: dataset.TensorSpec) -> str | None:
  """Which bytes a uint8 tensor holds, from its description: "record"
  (mixed byte records), "ue8m0" (scales), "e2m1" (packed FP4); None when it
  names none of them."""
  text = spec.description.lower()
  for kind, words in (("record", ("record",)), ("ue8m0", ("ue8m0",)), ("e2m1", ("e2m1", "fp4"))):
    if any(w in text for w in words):
      return kind
  return None


def fib_dtype(spec: dataset.TensorSpec) -> str:
  """The FIB 0.1.2 dtype a tensor of ours is exported with."""
  return BYTES if spec.dtype == "uint8" else spec.dtype


def dtype_matches(fib: str | None, ours: dataset.TensorSpec) -> bool:
  """Whether a FIB tensor of dtype `fib` can be our tensor `ours`: the dtype
  we export it with, FIB's float4_e2m1 for our packed e2m1 bytes, or FIB's
  int64 for our int32."""
  return (
    fib == fib_dtype(ours)
    or (ours.dtype == "int32" and fib == "int64")
    or (fib == "float4_e2m1" and ours.dtype == "uint8" and byte_kind(ours) == "e2m1")
  )


def hardware_name(device_kind: str) -> str:
  """FIB's hardware identifier of a jax device kind ("NVIDIA H200" ->
  "NVIDIA_H200"), the form of FIB's own examples."""
  return re.sub(r"\s+", "_", device_kind.strip())


def config_digest(config: Mapping[str, Any] | None) -> str:
  """Eight hex digits naming a kernel config (its canonical JSON)."""
  return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]


def solution_name(definition: str, backend: str, config: Mapping[str, Any] | None) -> str:
  """The FIB solution of one backend and config of a definition's kernel:
  `jaxkern-<backend>_<definition>_<config digest>` (names are unique across a
  TraceSet, so the definition is in it)."""
  return f"{AUTHOR}-{backend}_{definition}_{config_digest(config)}"


# The folder layout of a TraceSet (FIB's TraceSet.add_* write these paths).
def definition_path(root: pathlib.Path, op_type: str, name: str) -> pathlib.Path:
  return root / "definitions" / op_type / f"{name}.json"


def workloads_path(root: pathlib.Path, op_type: str, name: str) -> pathlib.Path:
  return root / "workloads" / op_type / f"{name}.jsonl"


def traces_path(root: pathlib.Path, op_type: str, name: str) -> pathlib.Path:
  return root / "traces" / op_type / f"{name}.jsonl"


def solution_path(root: pathlib.Path, op_type: str, definition: str, name: str) -> pathlib.Path:
  return root / "solutions" / AUTHOR / op_type / definition / f"{name}.json"
