"""Kernel configs declare the rules of their fields; one check applies them.

A kernel config is a frozen dataclass deriving from `KernelConfig` whose fields
are declared with `field(default, *rules)`:

    @dataclasses.dataclass(frozen=True)
    class GemmConfig(KernelConfig):
      block_m: int = field(128, DOT_BLOCK)
      num_warps: int = field(8, NUM_WARPS)

Constructing one (directly, with `dataclasses.replace`, or from JSON) checks
every rule; a broken one raises `ValueError` naming the class, the field, the
value and the rule: `GemmConfig.block_m=96 must be a power of two >= 16`.
Rules also state the type (a bool is not an int), so a config read from JSON
cannot smuggle in a float or a string. Every field must declare at least one
rule (nested stage configs: `instance_of`). Quantities derived from several
fields are checked through `KernelConfig._derived_rules` (a property name ->
rules), e.g. the number of points of a 3-D tile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from pallas_kernels.shared.common import MIN_DOT_DIM, is_pow2

_RULES = "rules"


@dataclasses.dataclass(frozen=True)
class Rule:
  """`text` completes "must be ..."; `holds(value, config)` tests it (the
  config gives access to the other fields)."""

  text: str
  holds: Callable[[Any, Any], bool]


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def pow2(minimum: int = 1) -> Rule:
  return Rule(f"a power of two >= {minimum}", lambda v, _: _is_int(v) and v >= minimum and is_pow2(v))


def at_least(minimum: int) -> Rule:
  return Rule(f"an int >= {minimum}", lambda v, _: _is_int(v) and v >= minimum)


def multiple_in(step: int, minimum: int, maximum: int) -> Rule:
  """A multiple of `step` in `[minimum, maximum]`."""
  return Rule(
    f"a multiple of {step} in [{minimum}, {maximum}]",
    lambda v, _: _is_int(v) and minimum <= v <= maximum and v % step == 0,
  )


def one_of(*choices: Any) -> Rule:
  return Rule(f"one of {choices}", lambda v, _: v in choices)


def multiple_of(other: str) -> Rule:
  """A multiple of the (positive int) field `other` of the same config."""

  def holds(value, config):
    divisor = getattr(config, other)
    return _is_int(value) and _is_int(divisor) and divisor > 0 and value % divisor == 0

  return Rule(f"a multiple of {other}", holds)


def only_with(*flags: str) -> Rule:
  """A bool that may be True only where the bool fields `flags` of the same
  config are True."""
  return Rule(
    f"a bool, True only with {' and '.join(flags)}",
    lambda v, config: isinstance(v, bool) and (not v or all(getattr(config, f) for f in flags)),
  )


def instance_of(cls: type) -> Rule:
  return Rule(f"a {cls.__name__}", lambda v, _: isinstance(v, cls))


# The rules most fields share.
DOT_BLOCK = pow2(MIN_DOT_DIM)  # a dot dimension on the Triton lowering
NUM_WARPS = pow2(1)  # Triton launches a power of two of warps
NUM_STAGES = at_least(1)


def field(default: Any, *rules: Rule) -> Any:
  """A config field with its default and its rules."""
  return dataclasses.field(default=default, metadata={_RULES: rules})


def _raise_unless(config: Any, name: str, rules: tuple[Rule, ...]) -> None:
  value = getattr(config, name)
  for rule in rules:
    if not rule.holds(value, config):
      raise ValueError(f"{type(config).__name__}.{name}={value!r} must be {rule.text}")


class KernelConfig:
  """Base of the frozen config dataclasses: checks the declared rules on
  construction."""

  _derived_rules: ClassVar[Mapping[str, tuple[Rule, ...]]] = {}
  # Set by @dataclasses.dataclass on each subclass; declared for the type checker.
  __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

  def __post_init__(self):
    for f in dataclasses.fields(self):
      rules = f.metadata.get(_RULES)
      if not rules:
        raise TypeError(f"{type(self).__name__}.{f.name} declares no rule; use config_rules.field")
      _raise_unless(self, f.name, rules)
    for name, rules in self._derived_rules.items():
      _raise_unless(self, name, rules)
