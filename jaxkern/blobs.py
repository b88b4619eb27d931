"""Recorded tensors: a record's `inputs` / `expected_output` blobs
(FlashInfer-Bench `{"type": "safetensors", "path", "tensor_key"}` and
`{"type": "scalar", "value"}`) read from a blob root.

A blob path must resolve inside the blob root, and a tensor is checked
against the definition's shape and dtype from the safetensors header before
any data is read, so a hostile or corrupt record cannot read outside the root
or make the loader allocate more than the definition allows.

With a blob root set, every safetensors blob a record names must be there:
a missing one is an error naming the files (never a silent fall back to
synthesized inputs). Recorded expected outputs are only compared on
recorded inputs (synthesized inputs would not produce them).
"""

from __future__ import annotations

import json
import pathlib
import struct
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxkern import dataset

# safetensors dtype names -> numpy.
_ST_DTYPES = {
  "BF16": "bfloat16",
  "F32": "float32",
  "F8_E4M3": "float8_e4m3fn",
  "U8": "uint8",
  "I32": "int32",
  "I64": "int64",
  "BOOL": "bool",
  "F16": "float16",
  "F64": "float64",
}


def _where(w: dataset.Workload) -> dict[str, Any]:
  return {"file": w.file, "line": w.line}


def resolve_blob_path(blob_root: str, rel: Any, w: dataset.Workload, field: str) -> pathlib.Path:
  root = pathlib.Path(blob_root).resolve()
  if not isinstance(rel, str) or not rel:
    raise dataset.DatasetError(
      "blob path must be a non-empty string", field=field, expected="a relative path", got=rel, **_where(w)
    )
  path = (root / rel).resolve()
  if not path.is_relative_to(root):
    raise dataset.DatasetError(
      "blob path leaves the blob root", field=field, expected=f"a path inside {root}", got=rel, **_where(w)
    )
  return path


def _header(path: pathlib.Path) -> dict[str, Any]:
  with open(path, "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    if size > 100 * 2**20:
      raise ValueError(f"{path}: safetensors header of {size} bytes")
    return json.loads(f.read(size))


def read_tensor(
  blob_root: str, ref: Any, w: dataset.Workload, field: str, spec: dataset.TensorSpec, axes: Mapping[str, int]
) -> np.ndarray | None:
  """The tensor a blob reference names, checked against `spec` at `axes`;
  None when the reference names no tensor (e.g. FlashInfer-Bench's
  `random`: replay then synthesizes). A missing file is a DatasetError."""
  if isinstance(ref, dict) and ref.get("type") == "scalar":
    return np.asarray(ref["value"], spec.np_dtype)
  if not isinstance(ref, dict) or ref.get("type") != "safetensors":
    return None
  path = resolve_blob_path(blob_root, ref.get("path"), w, f"{field}.path")
  if not path.is_file():
    raise dataset.DatasetError(
      "blob file missing", field=f"{field}.path", expected=f"a file under {blob_root}", got=ref.get("path"), **_where(w)
    )
  key = ref.get("tensor_key", "tensor")
  header = _header(path)
  if key not in header:
    raise dataset.DatasetError(
      "tensor key missing from blob",
      field=f"{field}.tensor_key",
      expected=key,
      got=sorted(k for k in header if k != "__metadata__"),
      **_where(w),
    )
  shape = tuple(header[key].get("shape", ()))
  want = spec.concrete_shape(axes)
  if shape != want:
    raise dataset.DatasetError(
      f"blob {path.name} has the wrong shape", field=field, expected=want, got=shape, **_where(w)
    )
  dtype = _ST_DTYPES.get(header[key].get("dtype"), header[key].get("dtype"))
  # FIB stores some index tensors as int64: accepted for int32 inputs, range-checked below.
  if dtype != spec.dtype and not (spec.dtype == "int32" and dtype == "int64"):
    raise dataset.DatasetError(
      f"blob {path.name} has the wrong dtype", field=field, expected=spec.dtype, got=dtype, **_where(w)
    )
  from safetensors.numpy import load_file

  x = load_file(str(path))[key]
  if x.dtype == np.int64:
    if x.size and (x.min() < np.iinfo(np.int32).min or x.max() > np.iinfo(np.int32).max):
      raise dataset.DatasetError(
        "int64 tensor out of int32 range",
        field=field,
        expected="values within int32",
        got=(int(x.min()), int(x.max())),
        **_where(w),
      )
    x = x.astype(np.int32)
  return x


def _safetensors_refs(w: dataset.Workload) -> dict[str, Any]:
  """field -> reference of every safetensors blob the record names."""
  refs = {}
  recorded = w.record.get("inputs")
  if isinstance(recorded, dict):
    refs.update({f"inputs.{k}": v for k, v in recorded.items()})
  exp = w.record.get("expected_output")
  if isinstance(exp, dict):
    refs.update({"expected_output": exp} if "path" in exp else {f"expected_output.{k}": v for k, v in exp.items()})
  return {k: v for k, v in refs.items() if isinstance(v, dict) and v.get("type") == "safetensors"}


def check_present(w: dataset.Workload, blob_root: str) -> None:
  """Raises a DatasetError naming every blob file the record names that is
  not under `blob_root`."""
  missing = [
    f"{field}: {ref.get('path')}"
    for field, ref in _safetensors_refs(w).items()
    if not resolve_blob_path(blob_root, ref.get("path"), w, f"{field}.path").is_file()
  ]
  if missing:
    raise dataset.DatasetError(
      f"{len(missing)} blob file(s) missing",
      field="blob_root",
      expected=f"every blob the record names under {blob_root}",
      got=missing,
      **_where(w),
    )


def recorded_scalars(definition: dataset.Definition, w: dataset.Workload) -> dict[str, jnp.ndarray]:
  """The scalar inputs a record gives as `{"type": "scalar", "value"}` (a
  FlashInfer-Bench workload with random tensors and set scalars), as 0-d
  arrays of the definition's dtype: they hold whether tensors are recorded
  or synthesized."""
  recorded = w.record.get("inputs")
  if not isinstance(recorded, dict):
    return {}
  return {
    name: jnp.asarray(np.asarray(recorded[name]["value"], spec.np_dtype))
    for name, spec in definition.inputs.items()
    if spec.shape is None and isinstance(recorded.get(name), dict) and recorded[name].get("type") == "scalar"
  }


def load_recorded(definition: dataset.Definition, w: dataset.Workload, blob_root: str, axes: Mapping[str, int]):
  """(inputs, expected outputs) of a record from `blob_root`: inputs None
  unless every input is recorded (synthesized then), expected outputs None
  unless the inputs are recorded and every output is. A blob the record
  names but the root lacks is a DatasetError."""
  if not blob_root:
    return None, None
  check_present(w, blob_root)
  inputs = None
  recorded = w.record.get("inputs")
  if isinstance(recorded, dict) and recorded:
    loaded = {
      name: read_tensor(blob_root, recorded.get(name), w, f"inputs.{name}", spec, axes)
      for name, spec in definition.inputs.items()
    }
    if all(v is not None for v in loaded.values()):
      inputs = {k: jnp.asarray(v) for k, v in loaded.items()}
  expected = None
  exp = w.record.get("expected_output")
  if inputs is not None and isinstance(exp, dict):
    names = list(definition.outputs)
    refs = {names[0]: exp} if "path" in exp else exp
    got = {
      name: read_tensor(blob_root, refs.get(name), w, f"expected_output.{name}", spec, axes)
      for name, spec in definition.outputs.items()
    }
    if all(v is not None for v in got.values()):
      expected = {k: jnp.asarray(v) for k, v in got.items()}
  return inputs, expected
