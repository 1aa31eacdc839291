"""The README's security paragraph says what docs/reliability.md's channel table says: every
channel the table lists with no authentication of its own is named in the README as such, and
the README does not claim that every channel is authenticated."""

from __future__ import annotations

import re

from tests.support.constants import REPO_ROOT

ROOT = REPO_ROOT


def _unauthenticated_channels() -> list[str]:
    """Channel names (before any parenthesis) whose Authentication cell starts with 'none'."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    head = text.index("| Channel | Authentication |")
    rows = []
    for line in text[head:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[1].lower().startswith("none"):
            rows.append(cells[0].split(" (")[0])
    return rows


def _security_paragraph() -> str:
    readme = (ROOT / "README.md").read_text()
    paragraphs = re.split(r"\n\s*\n", readme)
    found = [p for p in paragraphs if "Beyond loopback" in p]
    assert len(found) == 1, "README has one paragraph on channels beyond loopback"
    return " ".join(found[0].split())


def test_readme_matches_the_security_table():
    channels = _unauthenticated_channels()
    assert {"KV transfer", "JAX coordinator"} <= set(channels), channels
    paragraph = _security_paragraph()
    assert not re.search(r"every channel (is|are) authenticated", paragraph), paragraph
    for channel in channels:
        assert channel in paragraph, (channel, paragraph)
    assert "no authentication of their own" in paragraph and "fenced" in paragraph
