"""Where the data that ships with jaxkern is: the dataset (`datasets`:
definitions and workloads) and the replay configs (`configs`: smoke, replay,
full, and the tuned tables in `configs/tuned`).

The repository keeps both at its top level; a wheel carries them inside this
package, as `jaxkern/_data/datasets` and `jaxkern/_data/configs` (setup.py
maps them). `folder()` finds them through `importlib.resources` in an
installed package, else in the checkout this module was imported from (the
source tree on PYTHONPATH, an editable install, Bazel's runfiles). It never
looks beside site-packages, where an unrelated top-level `datasets` package
may live.
"""

from __future__ import annotations

import functools
import importlib.resources
import pathlib

FOLDERS = ("datasets", "configs")


@functools.cache
def folder(name: str) -> pathlib.Path:
  """The shipped `datasets` or `configs` folder. Where neither layout has
  it (a broken install), the path the installed package should hold, so
  that the caller's message names it."""
  if name not in FOLDERS:
    raise ValueError(f"name must be one of {FOLDERS}, got {name!r}")
  packaged = importlib.resources.files(__name__) / name
  if isinstance(packaged, pathlib.Path) and packaged.is_dir():
    return packaged
  checkout = pathlib.Path(__file__).resolve().parents[2]
  if _is_checkout(checkout) and (checkout / name).is_dir():
    return checkout / name
  return pathlib.Path(str(packaged))


def _is_checkout(root: pathlib.Path) -> bool:
  """`root` is jaxkern's source tree: its pyproject.toml names the project."""
  try:
    return 'name = "jaxkern"' in (root / "pyproject.toml").read_text(encoding="utf-8")
  except OSError:
    return False


def config_names() -> list[str]:
  """The packaged replay configs, by name (`--config NAME`): `full`, `replay`, `smoke`."""
  return sorted(p.stem for p in folder("configs").glob("*.py") if not p.name.startswith("_"))
