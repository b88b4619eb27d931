"""`python -m jaxkern.aot` (usage: `jaxkern.aot.cli`)."""

from absl import app, flags

from jaxkern.aot import cli

__doc__ = cli.__doc__  # absl's --help shows the main module's doc

cli.define_flags()
flags.adopt_module_key_flags(cli)  # --help lists the main module's flags: these
app.run(cli.main)
