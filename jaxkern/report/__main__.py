"""`python -m jaxkern.report` (usage: `jaxkern.report.cli`)."""

import sys

from jaxkern.report.cli import main

sys.exit(main())
