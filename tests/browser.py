"""Headless Chromium for page checks: a screenshot of a URL as an RGB array, and the solid-colour
runs along a row of it. Tests that need it skip when no Chromium is installed (`.ci/run`
installs Debian's `chromium`)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def chromium() -> str:
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is None:
        pytest.skip("no Chromium here: install Debian's chromium (.ci/run does) to check pages in a browser")
    return found


def screenshot(url: str, width: int = 1280, height: int = 900, wait_ms: int = 0) -> np.ndarray:
    """The page at `url` rendered by headless Chromium, [height, width, 3] uint8. `wait_ms` lets
    the page's own scripts run first (Chromium's virtual time budget)."""
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "page.png"
        args = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                f"--user-data-dir={tmp}/profile", f"--window-size={width},{height}", f"--screenshot={out}"]
        if wait_ms:
            args.append(f"--virtual-time-budget={wait_ms}")
        proc = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
        assert out.exists(), f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr[-2000:]}"
        return np.asarray(Image.open(out).convert("RGB"))


def hex_rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour.lstrip("#")[i:i + 2], 16) for i in (0, 2, 4))


def runs(row: np.ndarray, colours: dict[str, str]) -> list[dict[str, int]]:
    """Contiguous stretches of a pixel row made only of the given colours (name -> hex), each
    with its pixel count per colour, left to right."""
    rgb = {name: np.all(row == hex_rgb(c), axis=-1) for name, c in colours.items()}
    any_colour = np.any(np.stack(list(rgb.values())), axis=0)
    out, start = [], None
    for x, inside in enumerate([*any_colour, False]):
        if inside and start is None:
            start = x
        elif not inside and start is not None:
            out.append({name: int(mask[start:x].sum()) for name, mask in rgb.items()} | {"start": start, "end": x})
            start = None
    return out
