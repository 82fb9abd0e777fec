"""`kiln router --config FILE [--check]` and `python -m kiln.router --config FILE [--check]`.

Light to import (kiln.cli builds its parser from add_arguments); the configuration module and
pydantic are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

EXIT_CONFIG_ERROR = 2  # as kiln.cli
EXIT_NOT_SERVING = 1

log = logging.getLogger("kiln.router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", required=True, help="the router's TOML configuration file")
    parser.add_argument(
        "--check", action="store_true", help="validate, print the resolved configuration as JSON and exit"
    )


def run(args: argparse.Namespace) -> int:
    from kiln.router.config import RouterConfigError, load_router_config

    try:
        config = load_router_config(args.config)
    except RouterConfigError as e:
        for line in str(e).splitlines():  # one line per problem
            print(f"kiln router: error: {line}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(json.dumps(config.to_json(), indent=2))
    if args.check:
        return 0
    log.error("router serving is not built yet; use --check to validate a configuration")
    return EXIT_NOT_SERVING


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    parser = argparse.ArgumentParser(prog="python -m kiln.router", description="Route requests among Kiln workers.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
