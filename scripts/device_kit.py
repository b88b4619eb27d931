"""Builds the device kit: the wheels the GPU machine lacks, in `.whl/`.

The GPU machine has no network and no ml_collections; its packages are the
ones pinned in `constraints-device.txt`. This puts the wheel of every package
jaxkern imports that is not among them (ml_collections, then whatever it
requires that the machine also lacks), at the versions `constraints.txt` pins,
into `.whl/`, and checks that each is pure Python, so that
`scripts/gpu_run.sh` can import it straight from the wheel on PYTHONPATH.

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
  """One wheel, no dependencies, from the package index."""
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
  todo, done, wheels = list(NEEDED), set(), []
  while todo:
    name = canonicalize_name(todo.pop())
    if name in done or name in machine:
      continue
    done.add(name)
    if name not in pinned:
      sys.exit(f"device kit: {name} is needed on the GPU machine but constraints.txt pins no version of it")
    wheel = download(name, pinned[name], out)
    pure, reqs = metadata(wheel)
    if not pure:
      sys.exit(f"device kit: {wheel.name} is not pure Python, so it cannot be imported from PYTHONPATH")
    wheels.append(wheel)
    todo.extend(r.name for r in reqs)
  return wheels


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=pathlib.Path, default=REPO / ".whl")
  wheels = build(parser.parse_args().out)
  print("device kit:", " ".join(w.name for w in wheels))


if __name__ == "__main__":
  main()
