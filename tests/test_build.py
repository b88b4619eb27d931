"""BUILD stays in sync with the tree: every library is a glob that covers
each module of its package (and nothing of another), every test file gets
its py_test from one comprehension over the test files, and no hand list of
files is left to forget a new family."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_kernels", "jaxkern", "configs", "examples")


def build_text():
  return (REPO / "BUILD").read_text()


def library_block(name: str) -> str:
  return re.search(rf'py_library\(\s*name = "{name}".*?\n\)', build_text(), re.S).group(0)


def glob_patterns(block: str) -> list[str]:
  match = re.search(r"srcs = glob\(\[(.*?)\]", block, re.S)
  assert match, f"srcs is not a glob: {block}"
  return re.findall(r'"([^"]+)"', match.group(1))


def matches(pattern: str, path: str) -> bool:
  """Bazel glob semantics: `**/` is any number of folders (none included),
  `*` any part of one name."""
  regex, i = "", 0
  while i < len(pattern):
    if pattern.startswith("**/", i):
      regex, i = regex + "(?:[^/]+/)*", i + 3
    elif pattern[i] == "*":
      regex, i = regex + "[^/]*", i + 1
    else:
      regex, i = regex + re.escape(pattern[i]), i + 1
  return re.fullmatch(regex, path) is not None


def sources(package: str) -> set[str]:
  return {str(p.relative_to(REPO)) for p in (REPO / package).rglob("*.py") if "__pycache__" not in p.parts}


def test_every_library_globs_exactly_its_package():
  for package in PACKAGES:
    patterns = glob_patterns(library_block(package))
    on_disk = sources(package)
    covered = {s for s in on_disk if any(matches(p, s) for p in patterns)}
    assert on_disk - covered == set(), f"{package}: not covered by {patterns}"
    others = set().union(*(sources(p) for p in PACKAGES if p != package), sources("tests"))
    assert not any(matches(p, s) for p in patterns for s in others), package
  # No module is listed by hand any more.
  assert not re.search(r'"(jaxkern|pallas_kernels|configs|examples)/[\w/]+\.py"', build_text())


def test_every_test_file_gets_its_py_test_from_one_comprehension():
  """py_test rules come from `glob(["tests/test_*.py"])`, each named after
  its file and carrying every file of tests/ (helpers, hook providers)."""
  text = build_text()
  assert re.search(r'TEST_SOURCES = glob\(\["tests/\*\.py"\]\)', text)
  assert re.search(r'name = src\[len\("tests/"\):-len\("\.py"\)\],\s*srcs = TEST_SOURCES \+', text)
  assert re.search(r'args = \["\$\(location %s\)" % src\],', text)
  # Without a generated tests/__init__.py, tests import kit, numerics and each
  # other by name (as pytest runs them).
  assert "legacy_create_init = False" in text
  assert re.search(r'\) for src in glob\(\["tests/test_\*\.py"\]\)\]', text)
  assert "TESTS = [" not in text
  tests = {p.name for p in (REPO / "tests").glob("*.py")}
  assert {"kit.py", "numerics.py", "test_build.py", "test_definitions.py"} <= tests
  # The Makefile's Bazel subset names targets that exist.
  makefile = (REPO / "Makefile").read_text()
  subset = re.search(r"^BAZEL_TESTS \?= (.*)$", makefile, re.M).group(1).split()
  assert subset and all((REPO / "tests" / f"{t[len('//:') :]}.py").exists() for t in subset), subset


def test_libraries_mirror_the_packages():
  text = build_text()
  for lib in PACKAGES:
    assert re.search(rf'py_library\(\s*name = "{lib}"', text), lib
  # The import graph is one-way: pallas_kernels depends on nothing of ours.
  assert ":jaxkern" not in library_block("pallas_kernels")
  for p in (REPO / "pallas_kernels").rglob("*.py"):
    assert not re.search(r"^\s*(from|import) jaxkern", p.read_text(), re.M), p.name


def test_bazel_needs_no_download():
  """Native rules on the .venv interpreter: no pip or rules_python repository
  (the Bazel run is offline), and pytest files run through the pytest entry
  point (run directly they would pass without testing anything)."""
  text = build_text()
  assert "@rules_python" not in text and "requirement(" not in text
  assert 'main = "//tools/bazel:pytest_main.py"' in text
  assert "register_toolchains" in (REPO / "WORKSPACE").read_text()
