"""`python -m jaxkern.aot` (usage: `jaxkern.aot.cli`)."""

from absl import app

from jaxkern.aot import cli

__doc__ = cli.__doc__  # absl's --help shows the main module's doc

cli.define_flags()
app.run(cli.main)
