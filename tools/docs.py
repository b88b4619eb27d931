"""Builds the API reference (`make docs`): pdoc HTML from the docstrings of
jaxkern's public modules and the pallas_kernels configs, into build/docs/.

    .venv/bin/python tools/docs.py [--out build/docs]

Exits 1, after writing what it could, when anything is wrong:
- any warning pdoc raises (recorded, so none is lost to an `except` inside
  pdoc): a module that does not import, an `__all__` name that does not
  resolve, an annotation that does not evaluate, source that does not parse;
- a backticked dotted name under `jaxkern.` or `pallas_kernels.` in a
  documented docstring that does not resolve to a module or attribute (pdoc
  links the names it finds and leaves the others as plain text, silently);
- a test-only or example-only package imported along the way (the reference
  builds from the base install with the nn extra, on a CPU, in a few
  seconds).
"""

import argparse
import importlib
import os
import pathlib
import re
import shutil
import sys
import time
import warnings

# Documented: the package (its __all__ adds compare, dataset, ops, registry
# and replay), the public modules a user imports or runs, and of
# pallas_kernels the package, each family package (its KERNELS), each
# family's config module and the Kernel type. The `!` pattern drops the
# other kernel modules (launchers, helpers: internals), as pdoc's CLI does.
JAXKERN_MODULES = (
  "jaxkern",
  "jaxkern.quant",
  "jaxkern.replay_config",
  "jaxkern.results",
  "jaxkern.roofline",
  "jaxkern.tuning",
  "jaxkern.spmd",
  "jaxkern.autodiff",
  "jaxkern.plan",
  "jaxkern.selection",
  "jaxkern.family",
  "jaxkern.report",
  "jaxkern.sweep",
  "jaxkern.shards",
  "jaxkern.peers",
  "jaxkern.aot",
  "jaxkern.fib",
  "jaxkern.nn",
)
PALLAS_SPECS = (
  "pallas_kernels",
  r"!pallas_kernels\.(?!(\w+|\w+\.config|shared\.kernel|shared\.config_rules)$)",
)
# Not in the base install or the nn extra (flax, and the optax flax brings:
# jaxkern.nn is documented): pytest and its plugins, jsonschema (the test
# extra), torch (the FlashInfer-Bench client).
FORBIDDEN_IMPORTS = ("pytest", "xdist", "jsonschema", "torch", "flashinfer_bench")

_SPAN = re.compile(r"`([^`\n]+)`")
_NAME = re.compile(r"(?:jaxkern|pallas_kernels)(?:\.\w+)+")


def _resolves(name: str) -> bool:
  """Whether `a.b.c` is a module or an attribute path under one."""
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for attr in parts[i:]:
      if hasattr(obj, attr):
        obj = getattr(obj, attr)
      elif isinstance(obj, type) and any(attr in getattr(c, "__annotations__", {}) for c in obj.__mro__):
        obj = None  # a field without a class-level default (dataclass, NamedTuple)
      else:
        return False
    return True
  return False


def broken_references(docstring: str) -> list[str]:
  """The backticked jaxkern/pallas_kernels names in `docstring` that do not resolve."""
  names = []
  for span in _SPAN.findall(docstring):
    name = span.strip().removesuffix("()")
    if _NAME.fullmatch(name) and not _resolves(name):
      names.append(name)
  return names


def _documented(namespace, pdoc_doc) -> list:
  """`namespace` and its own public members, classes recursively."""
  found = [namespace]
  for member in namespace.own_members:
    if member.name.startswith("_") and member.name != "__init__":
      continue
    if isinstance(member, pdoc_doc.Class):
      found.extend(_documented(member, pdoc_doc))
    else:
      found.append(member)
  return found


def build(out: pathlib.Path) -> list[str]:
  """Writes the reference into `out`; returns every problem found."""
  # No GPU is needed or probed: the reference imports modules, it runs nothing.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import pdoc
  import pdoc.doc
  import pdoc.extract
  import pdoc.render

  problems = []
  pdoc.render.configure(docformat="markdown", show_source=True, search=True)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    modules = {}
    for name in pdoc.extract.walk_specs([*JAXKERN_MODULES, *PALLAS_SPECS]):
      try:
        modules[name] = pdoc.doc.Module.from_name(name)
      except Exception as e:  # reported; the build goes on
        cause = e.__cause__ or e
        problems.append(f"{name}: does not import: {type(cause).__name__}: {cause}")
    if out.exists():
      shutil.rmtree(out)
    for module in modules.values():
      page = out / f"{module.fullname.replace('.', '/')}.html"
      page.parent.mkdir(parents=True, exist_ok=True)
      page.write_text(pdoc.render.html_module(module, modules))
    (out / "index.html").write_text(pdoc.render.html_index(modules) or "")
    (out / "search.js").write_text(pdoc.render.search_index(modules) or "")
    for module in modules.values():
      for doc in _documented(module, pdoc.doc):
        for name in broken_references(doc.docstring):
          problems.append(f"{doc.fullname}: docstring names `{name}`, which does not resolve")
  for w in caught:
    problems.append(f"pdoc warning: {w.category.__name__}: {w.message}")
  loaded = sorted({m.split(".")[0] for m in sys.modules} & set(FORBIDDEN_IMPORTS))
  if loaded:
    problems.append(f"building the reference imported test-only or example-only packages: {', '.join(loaded)}")
  return problems


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
  parser.add_argument("--out", default="build/docs", help="output folder (replaced); default build/docs")
  args = parser.parse_args()
  start = time.monotonic()
  out = pathlib.Path(args.out)
  problems = build(out)
  pages = len(list(out.rglob("*.html")))
  for problem in problems:
    print(problem, file=sys.stderr)
  if problems:
    print(f"make docs: {len(problems)} problem(s) above; {pages} pages written to {out}", file=sys.stderr)
    return 1
  print(f"API reference: {pages} pages in {out}/ ({time.monotonic() - start:.1f} s); open {out}/index.html")
  return 0


if __name__ == "__main__":
  sys.exit(main())
