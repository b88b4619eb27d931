"""`python -m jaxkern.dataset`: convert, validate, stats (see `importer.USAGE`)."""

import sys

from jaxkern.dataset.importer import main

sys.exit(main())
