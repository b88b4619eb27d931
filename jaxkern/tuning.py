"""Kernel configs: one JSON serialization, and tuned tables per device kind.

A config is a frozen dataclass of ints, bools and strings, or of nested config
dataclasses (one per stage of a multi-stage kernel). `config_to_json` and
`config_from_json` are the one serialization used by replay results, sweep
output and the tuned tables.

Tuned tables live in `configs/tuned/<device kind>.json` (device kind as
`jax.devices()[0].device_kind`, lower-cased, runs of other characters made
`_`: `nvidia_h200`, `cpu`), keyed by kernel (the family's `Kernel.name`),
shape bucket and backend:

  {"device_kind": "NVIDIA H200",
   "entries": {"<kernel>": {"<bucket>": {"<backend>": {
       "config": {...}, "latency_ms": 0.41, "timer": "device", "definition": "<name>",
       "written": "<UTC time>"}}}}}

A shape bucket (`shape_bucket`) is every input's shape with each dimension
rounded up to a power of two, plus the constant values the heuristic takes
(a window, a top-k), as `"A=8192x4096,B=4096x4096"`. Calls in one bucket
differ by less than 2x in every dimension, which is where one tiling stays
the right one; a sweep at M=4125 serves every M in (4096, 8192]. The bucket
comes from the call's own shapes, so `jaxkern.ops` finds the entry a replay
sweep wrote without reading any definition.

Each table is read once per process (`read_table` caches it; `record`
replaces the cached copy with what it writes).

Where a config comes from (`jaxkern.backends.Choice.source`): `explicit`
(the caller's), `tuned` (the table of the current device kind), `heuristic`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxkern import _data
from pallas_kernels.shared.common import next_pow2

EXPLICIT, TUNED, HEURISTIC = "explicit", "tuned", "heuristic"


def config_to_json(config: Any) -> dict[str, Any] | None:
  """A config dataclass (nested ones included) as a JSON-ready dict."""
  if config is None:
    return None
  if not dataclasses.is_dataclass(config) or isinstance(config, type):
    raise TypeError(f"a config must be a dataclass instance, got {type(config).__name__}")
  return dataclasses.asdict(config)


def config_from_json(data: Mapping[str, Any], like: Any) -> Any:
  """The config of `like`'s type with `data`'s values; nested stages take the
  type of `like`'s own stage. Unknown or missing fields raise ValueError."""
  fields = {f.name: f for f in dataclasses.fields(like)}
  unknown = set(data) - set(fields)
  if unknown:
    raise ValueError(f"{type(like).__name__} has no fields {sorted(unknown)}; fields: {sorted(fields)}")
  values = {}
  for name, value in data.items():
    current = getattr(like, name)
    values[name] = config_from_json(value, current) if dataclasses.is_dataclass(current) else value
  return dataclasses.replace(like, **values)


def device_kind_slug(kind: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "unknown"


def current_device_kind() -> str:
  import jax

  return jax.devices()[0].device_kind


def tuned_dir() -> pathlib.Path:
  """`JAXKERN_TUNED_DIR`, else `configs/tuned` of the shipped configs (`jaxkern._data.folder`)."""
  env = os.environ.get("JAXKERN_TUNED_DIR")
  if env:
    return pathlib.Path(env)
  return _data.folder("configs") / "tuned"


def table_path(device_kind: str | None = None) -> pathlib.Path:
  return tuned_dir() / f"{device_kind_slug(device_kind or current_device_kind())}.json"


def _dims(value: Any) -> str:
  if isinstance(value, int):
    return str(next_pow2(value))
  return "x".join(str(next_pow2(int(d))) for d in np.shape(value)) or "scalar"


def shape_bucket(shapes: Mapping[str, Any], statics: Mapping[str, Any] | None = None) -> str:
  """`shapes` (name -> array, shape-like or int size) with every dimension
  rounded up to a power of two, and `statics` (name -> value) as they are,
  sorted by name: `"A=128x4096,B=4096x4096,top_k=6"`."""
  parts = {name: _dims(value) for name, value in shapes.items()}
  parts.update({name: str(value) for name, value in (statics or {}).items()})
  return ",".join(f"{name}={parts[name]}" for name in sorted(parts))


# Tables read so far in this process, by path (`record` replaces its own).
_TABLES: dict[pathlib.Path, dict[str, Any]] = {}


def _read(path: pathlib.Path) -> dict[str, Any]:
  if path in _TABLES:
    return _TABLES[path]
  table: dict[str, Any] = {"entries": {}}
  if path.exists():
    try:
      table = json.loads(path.read_text())
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{e.lineno}: invalid JSON in the tuned table: {e.msg}") from None
    if not isinstance(table.get("entries"), dict):
      raise ValueError(f"{path}: field 'entries': expected an object")
  _TABLES[path] = table
  return table


def read_table(device_kind: str | None = None) -> dict[str, Any]:
  """The tuned table of a device kind (default: the current one), read on
  first use and cached for the process; a missing file is an empty table."""
  kind = device_kind or current_device_kind()
  return {"device_kind": kind, **_read(table_path(kind))}


def lookup(kernel: str, bucket: str, device_kind: str | None = None) -> dict[str, dict]:
  """The tuned entries of a kernel at a shape bucket, by backend (empty if none)."""
  return read_table(device_kind)["entries"].get(kernel, {}).get(bucket, {})


def record(
  kernel: str,
  backend: str,
  bucket: str,
  config: Any,
  *,
  latency_ms: float | None,
  timer: str | None = None,
  definition: str | None = None,
  device_kind: str | None = None,
) -> pathlib.Path:
  """Writes (or replaces) the tuned entry of (kernel, bucket, backend) and
  the process's cached copy of the table."""
  kind = device_kind or current_device_kind()
  path = table_path(kind)
  table = json.loads(json.dumps(_read(path)))  # a copy: the cached one changes only once written
  table["device_kind"] = kind
  table["entries"].setdefault(kernel, {}).setdefault(bucket, {})[backend] = {
    "config": config_to_json(config),
    "latency_ms": latency_ms,
    "timer": timer,
    "definition": definition,
    "written": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  }
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
  tmp.replace(path)
  _TABLES[path] = table
  return path
