"""`kiln` command line: config, serve, warmup, qualify, adapters, train, router.

Every subcommand resolves settings through add_settings_arguments + settings_from_args, so
`kiln config` shows exactly what `kiln serve` and `kiln warmup` would use; `kiln router` alone
reads its own configuration file instead (kiln/router/config.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from kiln.config import COMMAND_LINE_OPTIONS, KEYS, SCHEMA, Settings, resolve_settings
from kiln.errors import ConfigError

EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C


SERVER_FLAGS = ("--host", "--port")  # only for the commands that serve HTTP (and `config`, which shows them)


def add_settings_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (), server: bool = False
                           ) -> None:
    """The flags every settings-consuming command accepts (but `exclude`, flags it uses otherwise, and
    the server's address unless it serves: `server`)."""
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    for dotted, flag in COMMAND_LINE_OPTIONS.items():
        if flag in exclude or (flag in SERVER_FLAGS and not server):
            continue
        key = KEYS[dotted]
        parser.add_argument(
            flag,
            dest=_dest(flag),
            metavar=key.name.upper(),
            help=f"{key.help} (overrides [{key.section}] {key.name} and {key.env})",
        )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Resolve settings from parsed flags (see add_settings_arguments); raises ConfigError."""
    overrides = {
        dotted: value
        for dotted, flag in COMMAND_LINE_OPTIONS.items()
        if (value := getattr(args, _dest(flag), None)) is not None
    }
    return resolve_settings(args.config, command_line=overrides)


def settings_from_argv(argv: Sequence[str] | None = None) -> Settings:
    """Resolve settings from argv holding only the shared flags (e.g. for `python -m kiln.server`)."""
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, server=True)
    return settings_from_args(parser.parse_args(argv))


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def format_settings(settings: Settings) -> str:
    """Human-readable `kiln config`: TOML-like values with their sources."""
    lines = [f"config file: {settings.config_file or '(none)'}"]
    doc = settings.to_json()
    rows: list[tuple[str, str]] = []
    section = None
    for key in SCHEMA:
        if key.section != section:
            if section is not None:
                rows.append(("", ""))
            section = key.section
            rows.append((f"[{section}]", ""))
        entry = doc["settings"][key.section][key.name]
        source = entry["source"]
        if source == "environment":
            source += f" {key.env}"
        elif source == "command_line":
            source += f" {COMMAND_LINE_OPTIONS[key.dotted]}"
        rows.append((f"{key.name} = {json.dumps(entry['value'])}", source))
    width = max(len(left) for left, _ in rows)
    for left, source in rows:
        lines.append(f"{left.ljust(width)}  # {source}" if source else left)
    lines.append("")
    lines.extend(settings.serving_profile.log_lines())
    return "\n".join(lines)


def backend_choice(settings: Settings) -> dict:
    """The backend route `kiln serve` would take, and why (probes the devices; loads no model)."""
    from kiln.engine.backends import select_backend
    from kiln.errors import BackendUnavailable
    from kiln.models.loader import resolve_dtype

    try:
        route = select_backend(settings.backend.route, settings.iree_cache_dir(), resolve_dtype(settings.model.dtype))
    except BackendUnavailable as exc:
        return {"route": settings.backend.route, "available": False, "reason": str(exc)}
    return {**route.choice.to_json(), "available": True}


def mesh_choice(settings: Settings, backend: dict) -> dict:
    """The devices `kiln serve` would split the model over and `kiln train` a run's batches and weights
    over (this process's devices: a run over several processes spans theirs too), or why they cannot;
    and the paged attention's kernel."""
    from kiln.errors import KilnError
    from kiln.kernels import cpu as kernels
    from kiln.models.paged_attention import kernel_for
    from kiln.models.sharding import AXIS, DATA, serving_mesh, training_mesh

    def devices(mesh) -> list[str]:
        return [str(d) for d in mesh.devices.flat] if mesh is not None else []

    try:
        iree = backend["available"] and backend["route"] != "xla"
        serving = serving_mesh(settings.engine.tensor_parallel, backend["route"] if iree else None)
        training = training_mesh(settings.train.data_parallel, settings.engine.tensor_parallel)
        # Kiln's CPU kernels where a server would build them (one device, a C++ compiler)
        cpu_kernels = kernels.wanted(settings.engine.cpu_kernels, iree, serving) and kernels.compiler() is not None
        attention = "xla" if iree else kernel_for(settings.engine.attention, cpu_kernels=cpu_kernels)
    except KilnError as exc:
        return {"error": str(exc)}
    return {
        "serving": {"axis": AXIS if serving else None, "size": serving.shape[AXIS] if serving else 1,
                    "devices": devices(serving)},
        "training": {"data_parallel": training.shape[DATA] if training else 1,
                     "tensor_parallel": training.shape[AXIS] if training else 1, "devices": devices(training)},
        "attention": attention,
    }


def quantization_choice(settings: Settings, backend: dict) -> dict:
    """The weights' format `kiln serve` would hold the layers in, and why (reads the model file's
    header, loads no weights)."""
    from kiln.errors import KilnError
    from kiln.models.loader import auto_quantization

    if (setting := settings.model.quantization) != "auto":
        return {"value": setting, "source": "[model] quantization"}
    if backend["available"] and backend["route"] != "xla":
        return {"value": "none", "source": f"auto: the {backend['route']} route runs float weights"}
    try:
        value, source = auto_quantization(settings.model.path or None)
    except KilnError as exc:
        return {"value": None, "source": f"unresolved: {exc}"}
    return {"value": value, "source": source}


def _cmd_config(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    backend = backend_choice(settings)
    quantization = quantization_choice(settings, backend)
    mesh = mesh_choice(settings, backend)
    if args.json:
        print(json.dumps({**settings.to_json(), "backend": backend, "model": {"quantization": quantization},
                          "mesh": mesh}, indent=2))
    else:
        print(format_settings(settings))
        state = "" if backend["available"] else "unavailable: "
        print(f"backend route: {backend['route']} ({state}{backend['reason']})")
        print(f"weights: {quantization['value']} ({quantization['source']})")
        if "error" in mesh:
            print(f"mesh: {mesh['error']}")
        else:
            t = mesh["training"]
            print(f"mesh: serving over {mesh['serving']['size']} device(s), training over {t['data_parallel']} x "
                  f"{t['tensor_parallel']} (data x tensor parallel); attention: {mesh['attention']}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    _apply_log_level(settings)
    try:  # the port accepts connections before JAX, the model or the HTTP stack is loaded
        sock = _listen(settings)
    except OSError as exc:
        print(f"kiln: error: cannot listen on {settings.server.host}:{settings.server.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    if settings.distributed.num_processes > 1:  # one server over several processes (hosts): 0 serves requests
        from kiln.distributed import initialize

        if index := initialize(settings):
            logging.basicConfig(level=settings.server.log_level.upper(),
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            from kiln.server.follower import serve_follower

            return serve_follower(settings, index, sock)
    from kiln.server.lifecycle import serve  # lazy: pulls in JAX and the HTTP stack

    return serve(settings, sock) or 0


def _listen(settings: Settings):
    """The server's listening socket, bound first: from the first moment a connection is accepted (it
    waits in the backlog until the HTTP server answers it, with 503 `starting` until ready)."""
    import socket

    host, port = settings.server.host, settings.server.port
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


def _cmd_warmup(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    _apply_log_level(settings)
    from kiln.engine.setup import warmup  # lazy: pulls in JAX
    from kiln.engine.warmup import list_step_set

    return (list_step_set(settings) if args.list else warmup(settings)) or 0


def _cmd_qualify(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    _apply_log_level(settings)
    from kiln import qualify  # lazy: pulls in JAX and IREE

    return qualify.run(args, settings)


def _cmd_adapters(args: argparse.Namespace) -> int:
    from kiln.adapters import cli  # lazy: pulls in orbax

    return cli.run(args, settings_from_args(args))


def _cmd_train(args: argparse.Namespace) -> int:
    from kiln.train import cli  # lazy: pulls in JAX

    return cli.run(args, settings_from_args(args))


def _cmd_eval(args: argparse.Namespace) -> int:
    from kiln.eval import cli  # lazy: pulls in JAX

    return cli.run(args, settings_from_args(args))


def _cmd_router(args: argparse.Namespace) -> int:
    from kiln.router import cli  # reads the router's configuration (pydantic, imported when run), not Kiln's

    return cli.run(args)


def _apply_log_level(settings: Settings) -> None:
    logging.getLogger().setLevel(settings.server.log_level.upper())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Serve and train an LLM in one JAX process.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("config", help="print the resolved configuration and each value's source")
    add_settings_arguments(p, server=True)
    p.add_argument("--json", action="store_true", help="print JSON (as /v1/config) instead of text")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_settings_arguments(p, server=True)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("warmup", help="build the engine's step executables into the cache (the next start loads them)")
    add_settings_arguments(p)
    p.add_argument("--list", action="store_true", help="print the step executables for these settings and exit")
    p.set_defaults(func=_cmd_warmup)

    from kiln.qualify import add_parser as add_qualify_parser

    add_qualify_parser(sub, add_settings_arguments)
    sub.choices["qualify"].set_defaults(func=_cmd_qualify)

    from kiln.adapters.cli import add_parser

    add_parser(sub, add_settings_arguments)
    sub.choices["adapters"].set_defaults(func=_cmd_adapters)

    from kiln.train.cli import add_parser as add_train_parser

    add_train_parser(sub, add_settings_arguments)
    sub.choices["train"].set_defaults(func=_cmd_train)

    from kiln.eval.cli import add_parser as add_eval_parser

    add_eval_parser(sub, add_settings_arguments)
    sub.choices["eval"].set_defaults(func=_cmd_eval)

    from kiln.router.cli import add_arguments as add_router_arguments

    p = sub.add_parser("router", help="route requests among Kiln workers (--check: validate the router configuration)")
    add_router_arguments(p)
    p.set_defaults(func=_cmd_router)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Logs (including config warnings) go to stderr; stdout stays clean for `config --json`.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        message = " ".join(str(e).split("\n"))
        print(f"kiln: error: {message}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:  # Ctrl-C in a command that does not handle it (`kiln serve` drains)
        print(f"kiln: {args.command} interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
