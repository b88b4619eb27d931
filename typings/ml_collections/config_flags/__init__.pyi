# Typing for ml_collections.config_flags (no annotations upstream); see
# ../config_dict/__init__.pyi for why these stubs exist. Partial: the module
# `__getattr__` keeps the names jaxkern does not use importable.
from typing import Any

from _typeshed import Incomplete
from absl import flags
from ml_collections.config_dict import ConfigDict

def DEFINE_config_file(
  name: str,
  default: str | None = None,
  help_string: str = "path to config file.",
  flag_values: flags.FlagValues = ...,
  lock_config: bool = True,
  accept_new_attributes: bool = False,
  sys_argv: list[str] | None = None,
  **kwargs: Any,
) -> flags.FlagHolder[ConfigDict]: ...
def __getattr__(name: str) -> Incomplete: ...
