"""The dashboard page, one self-contained HTML file (its style and script inlined: machines that
run the server may have no internet, and a replay file must open from disk)."""

from __future__ import annotations

import html
import json
from importlib.resources import files

_STATIC = files("travelator.dashboard") / "static"


def render_page(replay: dict | None = None) -> str:
    """The live page, or with ``replay`` ({"title", "panels": [{"name", "info", "records", "t0"}]})
    a page that plays those records back, panels side by side."""
    page = (_STATIC / "dashboard.html").read_text()
    data = "" if replay is None else "window.TRAVELATOR_REPLAY = " + _script_json(replay) + ";"
    # The placeholders in the order they appear, each replaced once: no inserted text (the
    # script, the data) is searched for the ones after it.
    page = page.replace("/*STYLE*/", (_STATIC / "dashboard.css").read_text(), 1)
    head, _, tail = page.partition("/*DATA*/")
    tail = tail.replace("/*SCRIPT*/", (_STATIC / "dashboard.js").read_text(), 1)
    return head + data + tail


def _script_json(value) -> str:
    # Inside <script>, "</" could close the element: JSON allows "<\/" for it.
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/")


def login_page(error: str | None = None) -> str:
    message = f'<p class="error">{html.escape(error)}</p>' if error else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>travelator · the walkway</title>
<style>body {{ background: #0f1419; color: #d8dee6; font: 14px system-ui, sans-serif; display: grid;
place-items: center; height: 90vh; }} input, button {{ font: inherit; padding: 4px 8px; }}
.error {{ color: #ff5a5a; }}</style></head>
<body><form method="post" action="/dashboard/login">
<h1>travelator</h1><p>This server needs its API key to show the live view.</p>{message}
<input type="password" name="key" placeholder="API key" autofocus required> <button>Open</button>
</form></body></html>"""
