"""The import graph of `jaxkern` and `pallas_kernels`: no cycles, and
`pallas_kernels` never imports `jaxkern`.

Edges are read from the source with `ast` (every `import` and `from ...
import`, inside functions too; a module's own package `__init__` is not an
edge of its own): what a reader sees, not what Python happens to load first.
"""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxkern", "pallas_kernels")


def module_files() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of `PACKAGES`."""
  out = {}
  for package in PACKAGES:
    for path in (REPO / package).rglob("*.py"):
      parts = path.relative_to(REPO).with_suffix("").parts
      out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
  """The longest prefix of a dotted name that is one of our modules."""
  while name and name not in modules:
    name = name.rpartition(".")[0]
  return name or None


def imports_of(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
  """The modules of ours that `module` imports."""
  is_package = path.name == "__init__.py"
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
      names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    else:
      continue
    out |= {m for m in (_resolve(n, modules) for n in names) if m and m != module}
  return out


def import_graph() -> dict[str, set[str]]:
  modules = module_files()
  return {m: imports_of(m, p, modules) for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of `graph` as a path that ends where it starts, or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    state[node] = 2
    path.pop()
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return None


def test_the_import_graph_has_no_cycle():
  graph = import_graph()
  assert len(graph) > 60 and graph["jaxkern.dispatch"], "the graph was read"
  cycle = find_cycle(graph)
  assert cycle is None, " -> ".join(cycle)


def test_pallas_kernels_imports_nothing_of_jaxkern():
  for module, imported in import_graph().items():
    if module.startswith("pallas_kernels"):
      assert not {m for m in imported if m.startswith("jaxkern")}, module


def test_the_cycle_finder_finds_one():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None
