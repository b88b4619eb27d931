# Typing for ml_collections.config_dict, which ships no annotations: without
# this stub pyright infers ConfigDict's `__getattr__` from its implementation
# (a union of every value type a field can hold, None included) and flags each
# `cfg.field` use. A ConfigDict is a dynamic record: its fields are typed by the
# config that defines them (jaxkern.replay_config), so reads are Any here.
# Only what jaxkern uses is spelled out; the module `__getattr__` keeps the rest
# of the module importable (a partial stub).
from collections.abc import Mapping
from typing import Any

from _typeshed import Incomplete

class FieldReference:
  def get(self) -> Any: ...

class ConfigDict:
  def __init__(
    self,
    initial_dictionary: Mapping[str, Any] | None = None,
    type_safe: bool = True,
    convert_dict: bool = True,
    *,
    allow_dotted_keys: bool = False,
    sort_keys: bool = True,
  ) -> None: ...
  def __getattr__(self, attribute: str) -> Any: ...
  def __setattr__(self, attribute: str, value: Any) -> None: ...
  def __getitem__(self, key: str) -> Any: ...
  def __setitem__(self, key: str, value: Any) -> None: ...
  def __contains__(self, key: object) -> bool: ...
  def get(self, key: str, default: Any = None) -> Any: ...

def placeholder(field_type: type, required: bool = False) -> FieldReference: ...
def __getattr__(name: str) -> Incomplete: ...
