"""Reading a viewer page (attnkit.tools.viewer) back in Python: the JSON its script reads, and its byte strings."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any


def payload(page: Any) -> dict:
    """The JSON the page's script reads, from an AttentionView, the page's text, or its path."""
    if isinstance(page, Path):
        page = page.read_text(encoding="utf-8")
    text = page.html if hasattr(page, "html") else page
    (data,) = re.findall(r'<script type="application/json" id="attnkit-data">(.*?)</script>', text, re.DOTALL)
    return json.loads(data)


def blob(data: dict, i: int) -> bytes:
    return base64.b64decode(data["blobs"][i])
