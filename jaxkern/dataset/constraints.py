"""The constraint language of definition files.

Constraints are data from definition files (which users import from
elsewhere), so they are never `eval`ed: they are parsed into a small
arithmetic-and-comparison language (integer literals, axis names,
+ - * // %, comparisons, and/or/not) and interpreted here."""

from __future__ import annotations

import ast
import operator
from collections.abc import Mapping
from typing import Any

_BINARY = {
  ast.Add: operator.add,
  ast.Sub: operator.sub,
  ast.Mult: operator.mul,
  ast.FloorDiv: operator.floordiv,
  ast.Mod: operator.mod,
}
_COMPARE = {
  ast.Eq: operator.eq,
  ast.NotEq: operator.ne,
  ast.Lt: operator.lt,
  ast.LtE: operator.le,
  ast.Gt: operator.gt,
  ast.GtE: operator.ge,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_STRUCTURE = (ast.Expression, ast.Name, ast.Load, ast.BoolOp, ast.And, ast.Or, ast.Compare, ast.BinOp, ast.UnaryOp)


def parse_constraint(expr: Any) -> ast.Expression:
  """`expr` as a syntax tree of the language; ValueError naming the first
  other construct."""
  if not isinstance(expr, str):
    raise ValueError(f"a constraint must be a string, got {type(expr).__name__}")
  try:
    tree = ast.parse(expr, mode="eval")
  except SyntaxError as e:
    raise ValueError(f"does not parse: {e.msg}") from None
  for node in ast.walk(tree):
    ok = (
      isinstance(node, _STRUCTURE)
      or type(node) in _BINARY
      or type(node) in _COMPARE
      or type(node) in _UNARY
      or (isinstance(node, ast.Constant) and type(node.value) is int)
    )
    if not ok:
      raise ValueError(
        f"{type(node).__name__} is not allowed (integers, axis names, + - * // %, comparisons, and/or/not only)"
      )
  return tree


def names(expr: str) -> set[str]:
  """The axis names a constraint uses (ValueError if it is not in the language)."""
  return {n.id for n in ast.walk(parse_constraint(expr)) if isinstance(n, ast.Name)}


def _evaluate(node: ast.AST, axes: Mapping[str, int]) -> Any:
  if isinstance(node, ast.Expression):
    return _evaluate(node.body, axes)
  if isinstance(node, ast.Constant):
    return node.value
  if isinstance(node, ast.Name):
    return axes[node.id]
  if isinstance(node, ast.UnaryOp):
    return _UNARY[type(node.op)](_evaluate(node.operand, axes))
  if isinstance(node, ast.BinOp):
    return _BINARY[type(node.op)](_evaluate(node.left, axes), _evaluate(node.right, axes))
  if isinstance(node, ast.BoolOp):
    values = (_evaluate(v, axes) for v in node.values)
    return all(values) if isinstance(node.op, ast.And) else any(values)
  assert isinstance(node, ast.Compare), node  # the last construct parse_constraint admits
  left = _evaluate(node.left, axes)
  for op, right_node in zip(node.ops, node.comparators):
    right = _evaluate(right_node, axes)
    if not _COMPARE[type(op)](left, right):
      return False
    left = right
  return True


def holds(expr: str, axes: Mapping[str, int]) -> bool:
  """Whether `axes` satisfy the constraint; a division by zero fails it."""
  try:
    return bool(_evaluate(parse_constraint(expr), axes))
  except ZeroDivisionError:
    return False
