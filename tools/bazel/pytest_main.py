"""Bazel's py_test entry point: runs pytest on the test files given as
arguments (pytest files define no `__main__`, so running them directly would
pass without testing anything)."""

import sys

import pytest

if __name__ == "__main__":
  sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
