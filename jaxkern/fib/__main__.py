import sys

from jaxkern.fib.cli import main

sys.exit(main())
