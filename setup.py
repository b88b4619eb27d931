"""The package list, the one part of the packaging pyproject.toml cannot state.

The repository keeps the dataset (`datasets/`) and the replay configs
(`configs/`) at its top level; the wheel carries them inside jaxkern, as
`jaxkern/_data/datasets` and `jaxkern/_data/configs` (never as top-level
packages: `datasets` is another project's name on PyPI). That takes a
package-dir mapping plus the packages found on disk, which pyproject.toml's
`packages.find` cannot combine. Data folders are listed as (namespace)
packages too, as setuptools wants for the files they ship. Everything else
(metadata, dependencies, extras, which files ship) is in pyproject.toml.
"""

import setuptools

DATA_ROOTS = {"jaxkern._data.datasets": "datasets", "jaxkern._data.configs": "configs"}


def packages(*roots: str) -> list[str]:
  """Every folder under `roots` (dotted, from the repository root), caches left out."""
  return setuptools.find_namespace_packages(
    include=[pattern for root in roots for pattern in (root, f"{root}.*")], exclude=["*__pycache__"]
  )


setuptools.setup(
  packages=[
    *packages("jaxkern", "pallas_kernels"),
    *(package + found[len(folder) :] for package, folder in DATA_ROOTS.items() for found in packages(folder)),
  ],
  package_dir=DATA_ROOTS,
)
