"""BUILD stays in sync with the tree: every module in a py_library, every
test file in a py_test of the same name, and nothing listed that is gone."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent


def build_text():
  return (REPO / "BUILD").read_text()


def test_every_module_and_config_is_in_build():
  """Library sources are listed file by file (tests: see the TESTS list;
  tests/numerics.py, their shared assertions, is in every py_test)."""
  listed = set(re.findall(r'"([\w/]+\.py)"', build_text())) - {"tests/numerics.py"}
  assert (REPO / "tests" / "numerics.py").exists()
  on_disk = {str(p.relative_to(REPO)) for d in ("jaxkern", "pallas_kernels", "configs", "examples")
             for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts}
  assert on_disk - listed == set(), "missing from BUILD"
  assert listed - on_disk == set(), "listed in BUILD but not on disk"


def test_every_test_file_has_its_py_test():
  """The py_test rules come from one TESTS list: it names every test file."""
  text = build_text()
  listed = re.search(r"^TESTS = \[(.*?)\]", text, re.S | re.M).group(1)
  tests = re.findall(r'"(\w+)"', listed)
  assert tests == sorted(set(tests))
  assert set(tests) == {p.stem for p in (REPO / "tests").glob("test_*.py")}
  assert re.search(r'srcs = \["tests/%s\.py" % test.*\) for test in TESTS\]', text, re.S)


def test_libraries_mirror_the_packages():
  text = build_text()
  for lib in ("pallas_kernels", "jaxkern", "configs", "examples"):
    assert re.search(rf'py_library\(\s*name = "{lib}"', text), lib
  # The import graph is one-way: pallas_kernels depends on nothing of ours.
  block = re.search(r'py_library\(\s*name = "pallas_kernels".*?\n\)', text, re.S).group(0)
  assert ':jaxkern' not in block
  for p in (REPO / "pallas_kernels").glob("*.py"):
    assert not re.search(r"^\s*(from|import) jaxkern", p.read_text(), re.M), p.name


def test_bazel_needs_no_download():
  """Native rules on the .venv interpreter: no pip or rules_python repository
  (the Bazel run is offline), and pytest files run through the pytest entry
  point (run directly they would pass without testing anything)."""
  text = build_text()
  assert "@rules_python" not in text and "requirement(" not in text
  assert 'main = "//tools/bazel:pytest_main.py"' in text
  assert "register_toolchains" in (REPO / "WORKSPACE").read_text()
