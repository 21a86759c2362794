"""`python -m pdcompile` runs the command line."""

import sys

from pdcompile.cli import main

sys.exit(main())
