"""Builds the device kit: the wheels the GPU machine lacks, in `.whl/`.

The GPU machine has no network and no ml_collections; its packages are the
ones pinned in `constraints-device.txt`. This puts into `.whl/`, at the
versions `constraints.txt` pins, the wheel of every package jaxkern imports
that is not among them (`NEEDED`: ml_collections), of the peer libraries the
device run times beside the kernels (`PEERS`: tokamax, `jaxkern.peers`), and
of whatever those require that the machine also lacks (less `NOT_CARRIED`),
built for the machine (CPython 3.12, manylinux x86_64), and checks that the
kit stays under `MAX_BYTES`. Two of them are compiled (pydantic-core, xprof)
and qwix has a namespace package: Python imports neither from a wheel on
PYTHONPATH, so `scripts/gpu_run.sh` unpacks every wheel of the kit into one
folder (stdlib `zipfile`, no pip) and puts that on PYTHONPATH.

  python scripts/device_kit.py [--out .whl]      (make device-kit)
"""

import argparse
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = pathlib.Path(__file__).resolve().parent.parent
# What jaxkern imports at run time that the GPU machine does not have.
NEEDED = ("ml_collections",)
# Peer libraries for the device run's peers phase (optional: jaxkern runs without).
PEERS = ("tokamax",)
# Requirements left out of the kit, measured with tokamax 0.0.17 / xprof 2.24.2 on
# jax 0.11.2: `import tokamax` imports one pure-Python module of xprof (its
# kernel-stats CLI tool, which imports fire, termcolor and six), never its
# profiler server's packages. These and theirs (duckdb, grpcio, cryptography,
# google-cloud-*, ...) are 44 MB of wheels the 64 MiB device call cannot carry.
NOT_CARRIED = {"xprof": ("cheroot", "duckdb", "google-cloud-storage", "gviz-api", "urllib3", "werkzeug")}
# The kit travels with the tree (about 8 MB) in the device call, 64 MiB in all.
MAX_BYTES = 48 * 2**20
# The GPU machine's interpreter and platforms (glibc >= 2.27, as its jaxlib 0.11.2
# wheel needs; pip does not widen manylinux_2_27 to the older manylinux2014 itself).
TARGET = ("--python-version", "3.12", "--implementation", "cp", "--abi", "cp312")
TARGET += ("--platform", "manylinux_2_27_x86_64", "--platform", "manylinux2014_x86_64")


def pins(path: pathlib.Path) -> dict[str, str]:
  """`name==version` lines of a constraints file, by canonical name."""
  out = {}
  for line in path.read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
      req = Requirement(line)
      out[canonicalize_name(req.name)] = str(req.specifier).removeprefix("==")
  return out


def download(name: str, version: str, into: pathlib.Path) -> pathlib.Path:
  """One wheel for the GPU machine (`TARGET`), no dependencies, from the package index."""
  with tempfile.TemporaryDirectory() as tmp:
    subprocess.run(
      [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        *TARGET,
        "-d",
        tmp,
        f"{name}=={version}",
      ],
      check=True,
    )
    (wheel,) = pathlib.Path(tmp).glob("*.whl")
    target = into / wheel.name
    target.write_bytes(wheel.read_bytes())
  return target


def metadata(wheel: pathlib.Path) -> tuple[bool, list[Requirement]]:
  """(pure Python, requirements without extras) from a wheel's dist-info."""
  with zipfile.ZipFile(wheel) as z:
    info = next(n.split("/")[0] for n in z.namelist() if n.split("/")[0].endswith(".dist-info"))
    pure = "Root-Is-Purelib: true" in z.read(f"{info}/WHEEL").decode()
    lines = z.read(f"{info}/METADATA").decode().splitlines()
  reqs = [Requirement(l.split(":", 1)[1]) for l in lines if l.startswith("Requires-Dist:")]
  return pure, [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def build(out: pathlib.Path) -> list[pathlib.Path]:
  machine = pins(REPO / "constraints-device.txt")
  pinned = pins(REPO / "constraints.txt")
  out.mkdir(exist_ok=True)
  for old in out.glob("*.whl"):
    old.unlink()
  todo, done, wheels, compiled = [*NEEDED, *PEERS], set(), [], []
  while todo:
    name = canonicalize_name(todo.pop())
    if name in done or name in machine:
      continue
    done.add(name)
    if name not in pinned:
      sys.exit(f"device kit: {name} is needed on the GPU machine but constraints.txt pins no version of it")
    wheel = download(name, pinned[name], out)
    pure, reqs = metadata(wheel)
    wheels.append(wheel)
    if not pure:
      compiled.append(name)
    skipped = {canonicalize_name(n) for n in NOT_CARRIED.get(name, ())}
    todo.extend(r.name for r in reqs if canonicalize_name(r.name) not in skipped)
  total = sum(w.stat().st_size for w in wheels)
  if total > MAX_BYTES:
    sizes = ", ".join(
      f"{w.name} {w.stat().st_size / 2**20:.1f}" for w in sorted(wheels, key=lambda w: -w.stat().st_size)
    )
    sys.exit(f"device kit: {total / 2**20:.1f} MiB, over {MAX_BYTES / 2**20:.0f} MiB (MiB: {sizes})")
  print(f"device kit: compiled for CPython 3.12 manylinux x86_64: {', '.join(compiled) or 'none'}")
  return wheels


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=pathlib.Path, default=REPO / ".whl")
  wheels = build(parser.parse_args().out)
  total = sum(w.stat().st_size for w in wheels) / 2**20
  print(f"device kit: {len(wheels)} wheels, {total:.1f} MiB:", " ".join(w.name for w in wheels))


if __name__ == "__main__":
  main()
