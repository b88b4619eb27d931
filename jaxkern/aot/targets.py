"""GPU target descriptions (`GpuTargetConfigProto` text) for the
compile-only devices: the ones a CUDA plugin library embeds, and the H100
and H200 texts shipped in `TARGETS_DIR` for plugins that embed none (jax
0.11.2's).

  python -m jaxkern.aot --write_targets   # rewrites TARGETS_DIR from the installed plugin (jax 0.12's)

The shipped files are the plugin's text unchanged (OpenXLA's licence header
included) under a header that names the plugin version and file they came
from; 0.11.2's XLA parses them (measured with the jax 0.12.0.1 texts).
"""

from __future__ import annotations

import mmap
import os
import re

TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")

# The devices shipped: the GPU machine's H200 and the H100 (`--target H100`).
SHIPPED = ("NVIDIA H100 80GB HBM3", "NVIDIA H200 141GB HBM3e")

_NAME_RE = re.compile(r'^device_description_str: "([^"\n]+)"', re.M)
_EMBEDDED_CACHE: dict[str, dict[str, str]] = {}


def embedded_target_configs(library: str) -> dict[str, str]:
  """Device name -> target text embedded in a CUDA plugin library (the
  NUL-delimited strings that hold a `gpu_device_info` block)."""
  if library not in _EMBEDDED_CACHE:
    found = {}
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
      for m in re.finditer(rb'device_description_str: "([^"\n]+)"', data):
        start = data.rfind(b"\0", 0, m.start()) + 1
        end = data.find(b"\0", m.end())
        text = data[start:end].decode("utf-8", "replace")
        if "gpu_device_info" in text:
          found[m.group(1).decode()] = text
    _EMBEDDED_CACHE[library] = found
  return _EMBEDDED_CACHE[library]


def shipped_target_configs(directory: str = TARGETS_DIR) -> dict[str, str]:
  """Device name -> target text of each `*.txtpb` file in `directory`."""
  found = {}
  for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
    if not name.endswith(".txtpb"):
      continue
    path = os.path.join(directory, name)
    with open(path, encoding="utf-8") as f:
      text = f.read()
    m = _NAME_RE.search(text)
    if m is None:
      raise ValueError(f'{path}: no `device_description_str: "..."` line; expected a GpuTargetConfigProto text')
    found[m.group(1)] = text
  return found


def file_name(device: str) -> str:
  """`NVIDIA H200 141GB HBM3e` -> `nvidia_h200_141gb_hbm3e.txtpb`."""
  return re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_") + ".txtpb"


def header(device: str, source: str) -> str:
  """The comment lines above a shipped text: what it is and where it came from."""
  return (
    f"# GpuTargetConfigProto of `{device}` for jaxkern.aot's compile-only device.\n"
    f"# Extracted unchanged from {source}\n"
    "# by `python -m jaxkern.aot --write_targets`; used where the installed CUDA plugin embeds no text\n"
    "# for this device (the jax 0.11.2 plugin embeds none). Do not edit by hand.\n\n"
  )


def write_shipped(
  library: str, source: str, directory: str = TARGETS_DIR, devices: tuple[str, ...] = SHIPPED
) -> list[str]:
  """Writes each of `devices`' embedded text (with `header`) into
  `directory`; returns the paths. Raises naming a device the library lacks."""
  embedded = embedded_target_configs(library)
  missing = [d for d in devices if d not in embedded]
  if missing:
    raise ValueError(f"{library} embeds no target for {missing}; it has {sorted(embedded)}")
  os.makedirs(directory, exist_ok=True)
  paths = []
  for d in devices:
    path = os.path.join(directory, file_name(d))
    with open(path, "w", encoding="utf-8") as f:
      f.write(header(d, source) + embedded[d].rstrip("\n") + "\n")
    paths.append(path)
  return paths
