"""Kernel configs: one JSON serialization, and tuned tables per device kind.

A config is a frozen dataclass of ints, bools and strings, or of nested config
dataclasses (one per stage of a multi-stage kernel). `config_to_json` and
`config_from_json` are the one serialization used by replay results, sweep
output and the tuned tables.

Tuned tables live in `configs/tuned/<device kind>.json` (device kind as
`jax.devices()[0].device_kind`, lower-cased, runs of other characters made
`_`: `nvidia_h200`, `cpu`):

  {"device_kind": "NVIDIA H200",
   "entries": {"<definition>": {"<bucket>": {"config": {...}, "latency_ms": 0.41,
                                             "axes": {...}, "written": "<UTC time>"}}}}

A shape bucket is the definition's variable axes, each rounded up to a power
of two, as `"M=8192"` or `"B=1,Nk=64,Nq=4096"` (sorted by name). Workloads in
one bucket differ by less than 2x in every axis, which is where one tiling
stays the right one; a sweep at M=4125 serves every M in (4096, 8192].

Where a config comes from (`Choice.source`): `explicit` (the caller's),
`tuned` (the table of the current device kind), `heuristic`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import re
from typing import Any, Mapping

from pallas_kernels.common import next_pow2

EXPLICIT, TUNED, HEURISTIC = "explicit", "tuned", "heuristic"


@dataclasses.dataclass(frozen=True)
class Choice:
  config: Any
  source: str  # EXPLICIT | TUNED | HEURISTIC


def config_to_json(config: Any) -> dict[str, Any] | None:
  """A config dataclass (nested ones included) as a JSON-ready dict."""
  if config is None:
    return None
  if not dataclasses.is_dataclass(config):
    raise TypeError(f"a config must be a dataclass, got {type(config).__name__}")
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
  import jax  # pylint: disable=g-import-not-at-top
  return jax.devices()[0].device_kind


def tuned_dir() -> pathlib.Path:
  env = os.environ.get("JAXKERN_TUNED_DIR")
  if env:
    return pathlib.Path(env)
  return pathlib.Path(__file__).resolve().parent.parent / "configs" / "tuned"


def table_path(device_kind: str | None = None) -> pathlib.Path:
  return tuned_dir() / f"{device_kind_slug(device_kind or current_device_kind())}.json"


def shape_bucket(var_axes: Mapping[str, int]) -> str:
  return ",".join(f"{name}={next_pow2(int(value))}" for name, value in sorted(var_axes.items()))


def read_table(device_kind: str | None = None) -> dict[str, Any]:
  path = table_path(device_kind)
  if not path.exists():
    return {"device_kind": device_kind or current_device_kind(), "entries": {}}
  try:
    table = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}:{e.lineno}: invalid JSON in the tuned table: {e.msg}") from None
  if not isinstance(table.get("entries"), dict):
    raise ValueError(f"{path}: field 'entries': expected an object")
  return table


def lookup(definition: str, var_axes: Mapping[str, int], device_kind: str | None = None) -> dict | None:
  """The tuned entry for a definition at these axes, or None."""
  return read_table(device_kind).get("entries", {}).get(definition, {}).get(shape_bucket(var_axes))


def record(definition: str, var_axes: Mapping[str, int], config: Any, *, latency_ms: float | None,
           device_kind: str | None = None) -> pathlib.Path:
  """Writes (or replaces) the tuned entry for this definition and bucket."""
  kind = device_kind or current_device_kind()
  table = read_table(kind)
  table["device_kind"] = kind
  table["entries"].setdefault(definition, {})[shape_bucket(var_axes)] = {
      "config": config_to_json(config), "latency_ms": latency_ms, "axes": dict(var_axes),
      "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  path = table_path(kind)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
  tmp.replace(path)
  return path
