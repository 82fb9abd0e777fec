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


def chromium(required: bool = True) -> str | None:
    """Chromium's path; without one, a test that requires it skips (and one that does not gets None)."""
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is None and required:
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


def page_dom(url: str, wait_ms: int = 2500) -> str:
    """The page at `url` as headless Chromium's DOM after its scripts ran for `wait_ms` of virtual
    time (network waits do not count against it), serialized as HTML."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp}/profile",
                f"--virtual-time-budget={wait_ms}", "--dump-dom", url]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout, f"no DOM (exit {proc.returncode}): {proc.stderr[-2000:]}"
        return proc.stdout


def elements(html: str, **attrs: str) -> list[dict[str, str]]:
    """The attributes of every element of `html` whose attributes include `attrs` (underscores in
    names stand for dashes: data_state="live")."""
    from html.parser import HTMLParser

    want = {k.replace("_", "-"): v for k, v in attrs.items()}
    found = []

    class Finder(HTMLParser):
        def handle_starttag(self, tag, attributes):
            a = {k: v or "" for k, v in attributes}
            if all(a.get(k) == v for k, v in want.items()):
                found.append({"tag": tag, **a})

    Finder().feed(html)
    return found


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
