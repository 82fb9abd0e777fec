"""`python -m kiln.server [--config FILE] [--model PATH] [--host H] [--port P]`."""

import sys

from kiln.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
