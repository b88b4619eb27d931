"""What our formats and FlashInfer-Bench 0.1.2's have in common: dtype
names, statuses, the folder layout of a TraceSet and the names we give
solutions.

Dtypes (SPEC 3 lists ours). FIB 0.1.2 has no `uint8`; our uint8 tensors are
bytes of three kinds, exported as:
- packed e2m1 (two FP4 codes per byte, low nibble = even element) ->
  `float4_e2m1`, whose torch dtype (`float4_e2m1fn_x2`) is one byte holding
  two codes, so the shape (in bytes) is unchanged;
- UE8M0 scales (one byte `s` meaning 2**(s-127)) -> `int8`, the same byte
  read as signed (FIB has no e8m0 type);
- byte records (a paged cache token: e4m3 or e2m1 bytes followed by their
  scales) -> `int8`, the same bytes.
Which kind a uint8 tensor is comes from its definition's description
(`byte_kind`). Every other dtype keeps its name. Import maps back: FIB's
`int8` and `float4_e2m1` become our `uint8` where the matched definition
has one, and FIB's `int64` index tensors our `int32` (the replay's blob
loader accepts int64 blobs for int32 inputs, range-checked).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
from typing import Any, Mapping

from jaxkern import dataset
from jaxkern.compare import Status

FIB_VERSION = "0.1.2"
# flashinfer_bench.data.definition.DType of 0.1.2.
FIB_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1", "int64", "int32",
              "int16", "int8", "bool")
# flashinfer_bench.data.trace.EvaluationStatus of 0.1.2: ours upper-cased; `skipped` has no FIB status.
FIB_STATUSES = {s: s.value.upper() for s in Status if s is not Status.SKIPPED}
OUR_STATUSES = {v: k for k, v in FIB_STATUSES.items()}

# The kinds of byte tensor and their FIB dtype.
BYTE_KINDS = {"e2m1": "float4_e2m1", "ue8m0": "int8", "record": "int8"}
# FIB dtypes that may stand for an input of ours with another dtype (see the module docstring).
FIB_ALIASES = {"uint8": ("float4_e2m1", "int8"), "int32": ("int64",)}

AUTHOR = "jaxkern"
DEFAULT_BACKEND = "triton"


def byte_kind(spec: dataset.TensorSpec) -> str:
  """Which bytes a uint8 tensor holds, from its description: "e2m1"
  (packed FP4), "ue8m0" (scales) or "record" (mixed byte records). A uint8
  tensor whose description names none of them is a DatasetError: its FIB
  dtype would be a guess."""
  text = spec.description.lower()
  if "record" in text:
    return "record"
  if "ue8m0" in text:
    return "ue8m0"
  if "e2m1" in text or "fp4" in text:
    return "e2m1"
  raise dataset.DatasetError("a uint8 tensor must say what its bytes are", field=f"{spec.name}.description",
                             expected="'e2m1' (packed FP4), 'UE8M0' (scales) or 'record' (byte records)",
                             got=spec.description)


def fib_dtype(spec: dataset.TensorSpec) -> str:
  """The FIB 0.1.2 dtype a tensor of ours is exported with."""
  return BYTE_KINDS[byte_kind(spec)] if spec.dtype == "uint8" else spec.dtype


def dtype_matches(fib: str, ours: dataset.TensorSpec) -> bool:
  """Whether a FIB tensor of dtype `fib` can be our tensor `ours`: the dtype
  we would export it with, or FIB's int64 for our int32."""
  return fib == fib_dtype(ours) or (ours.dtype == "int32" and fib == "int64")


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
