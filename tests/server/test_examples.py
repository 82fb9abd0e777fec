"""The shipped example configuration resolves to exactly the defaults."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _config(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    proc = subprocess.run([sys.executable, "-m", "kiln", "config", "--json", *args], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_example_toml_matches_defaults():
    example = _config("--config", str(ROOT / "server" / "kiln.toml"))
    defaults = _config()
    for section, keys in defaults["settings"].items():
        for key, value in keys.items():
            assert example["settings"][section][key]["value"] == value["value"], (section, key)
            assert example["settings"][section][key]["source"] == "config_file", (section, key)
