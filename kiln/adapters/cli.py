"""`kiln adapters list | import | export`: the adapter store from the command line."""

from __future__ import annotations

import argparse
import json

from kiln.config import Settings


def add_parser(sub, add_settings_arguments) -> None:
    p = sub.add_parser("adapters", help="list, import (PEFT) and export (PEFT) adapters in the store")
    cmds = p.add_subparsers(dest="adapters_command", required=True, metavar="ACTION")
    q = cmds.add_parser("list", help="adapters in the store (latest complete version of each)")
    add_settings_arguments(q)
    q.add_argument("--json", action="store_true")
    q = cmds.add_parser("import", help="import a PEFT LoRA directory as a Kiln artifact bound to the configured model")
    add_settings_arguments(q)
    q.add_argument("name")
    q.add_argument("peft_dir")
    q = cmds.add_parser("export", help="write a stored adapter as a PEFT directory (transformers + peft, vLLM)")
    add_settings_arguments(q)
    q.add_argument("name")
    q.add_argument("out_dir")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from kiln.adapters.registry import export_peft, import_peft
    from kiln.adapters.store import AdapterStore
    from kiln.errors import KilnError

    store = AdapterStore(settings.adapter_store())
    try:
        if args.adapters_command == "list":
            rows = [a.summary() for a in store.list()]
            if args.json:
                print(json.dumps(rows, indent=2))
            for r in [] if args.json else rows:
                print(f"{r['name']}  v{r['version']}  rank {r['rank']}  base {r['base_model']}  "
                      f"{r['manifest_digest'][:19]}  {r['path']}")
            return 0
        if args.adapters_command == "import":
            from kiln.engine.setup import load_model_from_settings

            model = load_model_from_settings(settings, show_progress=False)
            artifact = import_peft(store, args.name, args.peft_dir, model, settings.adapters.max_lora_rank)
            print(f"imported {args.name} as {artifact.path} ({artifact.manifest_digest})")
            return 0
        artifact = store.latest(args.name)
        if artifact is None:
            print(f"kiln: error: no adapter named {args.name!r} in {store.root}")
            return 1
        print(f"exported {args.name} v{artifact.version} to {export_peft(artifact, args.out_dir)}")
        return 0
    except (KilnError, OSError) as exc:
        print(f"kiln: error: {exc}")
        return 1
