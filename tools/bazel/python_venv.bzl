"""A Python toolchain on the project's virtual environment (`.venv`, made by
`make install`): Bazel runs the tests with the interpreter that has the
pinned dependencies, so BUILD files name no pip repositories."""

def _venv_python_impl(ctx):
    root = ctx.path(Label("//:WORKSPACE")).dirname
    interpreter = root.get_child(".venv").get_child("bin").get_child("python")
    if not interpreter.exists:
        fail("%s is missing: run `make install` first" % interpreter)
    ctx.file("BUILD", """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "runtime",
    interpreter_path = "%s",
    python_version = "PY3",
)

py_runtime_pair(name = "runtime_pair", py3_runtime = ":runtime")

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""" % interpreter)

venv_python = repository_rule(implementation = _venv_python_impl, local = True)
