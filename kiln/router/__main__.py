"""`python -m kiln.router --config FILE [--check]`."""

import sys

from kiln.router.cli import main

if __name__ == "__main__":
    sys.exit(main())
