"""`kiln router --config FILE [--check]` and `python -m kiln.router --config FILE [--check]`.

Without --check the router serves until SIGTERM or SIGINT (kiln/router/serve.py). Light to import
(kiln.cli builds its parser from add_arguments); the configuration module, pydantic and the
servers are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

EXIT_CONFIG_ERROR = 2  # as kiln.cli


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
    if args.check:
        print(json.dumps(config.to_json(), indent=2))
        return 0
    from kiln.router.serve import run as serve

    return serve(config)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    parser = argparse.ArgumentParser(prog="python -m kiln.router", description="Route requests among Kiln workers.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
