"""Every document the repository refers to is inside it: relative links in Markdown resolve to a
tracked file, and no file cites the design documents that live outside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKIPPED = ("tui/node_modules/", "tests/node/node_modules/")
TEXT_SUFFIXES = {".md", ".py", ".sh", ".toml", ".yaml", ".yml", ".ts", ".txt", ".tpl", ""}
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Built from parts so that this file does not match itself.
OUTSIDE = [re.compile(part) for part in ("ARCHITECTURE" + r"(\.md)? *§", r"\.\./shared/", "STYLE" + r"\.md")]


def tracked() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return [name for name in listed.stdout.splitlines() if not name.startswith(SKIPPED)]


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = []
    for name in tracked():
        if not name.endswith(".md"):
            continue
        for target in LINK.findall((REPO / name).read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = (REPO / name).parent / target.split("#", 1)[0]
            if not path.exists():
                broken.append(f"{name}: {target}")
    assert broken == []


def test_no_file_cites_a_document_outside_the_repository() -> None:
    cited = []
    for name in tracked():
        path = REPO / name
        if path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if any(pattern.search(line) for pattern in OUTSIDE):
                cited.append(f"{name}:{number}: {line.strip()[:80]}")
    assert cited == []
