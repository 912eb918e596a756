"""The docs' Markdown pages as the tests read them: fenced Python blocks, each with a kind.

Pages are docs/**/*.md in the order of the site's table of contents (the
``{toctree}`` blocks, from docs/index.md down), then README.md's quick start.
The first line of a ```python block says what the block is:

- ``# settings.py``: lines of the project's settings module. In a list,
  ``[...,`` stands for the setting's existing entries
  (``INSTALLED_APPS = [..., "django_dbworker"]``).
- ``# settings.py (PostgreSQL)``, ``(MySQL)``: settings for that database
  only; the tests apply it on that database's leg (pointing it at the
  leg's server through the environment variables it reads) and only
  compile it on the others.
- ``# settings.py (alternative)``: another value of a setting the page
  already has; the tests check it with ``manage.py check`` in a settings
  module of its own (``from mysite.settings import *`` plus the block).
- ``# <path>.py`` (``# myapp/workers.py``, ``# tests/test_signup.py``): the
  contents of that file of the reader's project, ``myapp`` being one of its
  apps and ``mysite`` the project package; blocks naming the same file are
  concatenated in order (``# myapp/workers.py (continued)``). A file under
  ``tests/`` is a pytest module.
- ``# illustrative: <why>``: a sketch that is only compiled, not run. Keep
  these few: every other block runs in tests/docs.
- anything else: code typed into ``manage.py shell`` (with ``--no-imports``,
  so the block's own imports are what it gets), run after the files exist.

Blocks belong to a *project*, the scratch Django project the tests build
for them: a page's blocks go to the project ``guide`` (the topic guides,
which build on each other like one reader's project) unless the page says
otherwise with a line ``<!-- docs-test: project NAME -->`` (the tutorial
and the README's quick start are projects of their own).

Nothing here runs code; it only reads Markdown.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

FILE_MARKER = re.compile(r"#\s+(?P<path>[\w./-]+?\.py)\b")
VARIANT_MARKER = re.compile(r"#\s+settings\.py\s+\((?P<variant>PostgreSQL|MySQL|alternative)\)")
ILLUSTRATIVE_MARKER = re.compile(r"#\s+illustrative:\s*\S")
ELLIPSIS_LIST = re.compile(r"^(?P<name>[A-Z_]+) = \[\.\.\., ", re.MULTILINE)
PROJECT_MARKER = re.compile(r"^<!--\s*docs-test:\s*project\s+(?P<name>[\w-]+)\s*-->\s*$", re.M)
TOCTREE = re.compile(r"^```\{toctree\}\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)
#: The project of pages that name none.
GUIDE = "guide"
#: Vendors whose settings blocks the tests can point at the leg's server.
VENDORS = {"postgresql": "PostgreSQL", "mysql": "MySQL"}


@dataclass(frozen=True)
class Block:
    page: Path
    heading: str  # the heading it sits under
    line: int  # line of its first code line
    code: str
    project: str

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0] if self.code else ""

    @property
    def path(self) -> str | None:
        """The project file this block is (or adds to), if it names one."""
        match = FILE_MARKER.match(self.first_line)
        return match["path"] if match else None

    @property
    def variant(self) -> str | None:
        """``PostgreSQL``, ``MySQL`` or ``alternative`` for those settings blocks."""
        match = VARIANT_MARKER.match(self.first_line)
        return match["variant"] if match else None

    @property
    def kind(self) -> str:
        if ILLUSTRATIVE_MARKER.match(self.first_line):
            return "illustrative"
        if self.path == "settings.py":
            return "settings"
        if self.path is not None:
            return "test" if self.path.startswith("tests/") else "file"
        return "shell"

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.heading})"

    def applies_to(self, vendor: str) -> bool:
        """Whether a settings block is part of the project on ``vendor``'s leg."""
        if self.variant in (None, "alternative"):
            return self.variant is None
        return VENDORS.get(vendor) == self.variant

    def settings_code(self) -> str:
        """A settings block as settings-module code: ``[...,`` keeps existing entries."""
        code = ELLIPSIS_LIST.sub(lambda m: f"{m['name']} = [*{m['name']}, ", self.code)
        if "..." in code:
            raise ValueError(f"{self.where}: '...' outside 'NAME = [..., ' in a settings block")
        return code


def markdown_blocks(
    page: Path, *, text: str | None = None, section: str | None = None
) -> list[Block]:
    """The ```python blocks of ``page`` (only under the ``## section`` heading, if given)."""
    text = page.read_text() if text is None else text
    marker = PROJECT_MARKER.search(text)
    project = marker["name"] if marker else GUIDE
    lines = text.splitlines()
    blocks: list[Block] = []
    inside = section is None
    heading = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## ") and section is not None:
            inside = line[3:].strip() == section
            heading = line[3:].strip()
        elif line.startswith("#") and re.match(r"#{1,6} ", line):
            heading = line.lstrip("#").strip()
        elif inside and line.strip() == "```python":
            indent = line[: len(line) - len(line.lstrip())]
            start = i + 1
            end = start
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise ValueError(f"{page}:{i + 1}: unterminated ```python block")
            body = "\n".join(lines[start:end]) + "\n"
            if indent:  # a block inside a list item
                body = textwrap.dedent(body)
            blocks.append(Block(page, heading, start + 1, body, project))
            i = end
        elif line.lstrip().startswith("```"):
            # Skip other fences whole: a "# comment" line in a shell block is no heading.
            fence = line.lstrip()[:3]
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith(fence):
                i += 1
        i += 1
    return blocks


def toctree_pages(index: Path | None = None) -> list[Path]:
    """The docs pages in the order of the site's table of contents."""
    index = index or DOCS / "index.md"
    pages = [index]
    for tree in TOCTREE.finditer(index.read_text()):
        for raw in tree["body"].splitlines():
            entry = raw.strip()
            if not entry or entry.startswith(":"):
                continue
            target = re.search(r"<([^>]+)>$", entry)
            name = target[1] if target else entry
            page = (index.parent / f"{name}.md").resolve()
            pages += toctree_pages(page) if TOCTREE.search(page.read_text()) else [page]
    return pages


def readme_blocks() -> list[Block]:
    """The README's blocks (its quick start, the batches example): a project of its own."""
    return markdown_blocks(README)


def all_blocks() -> list[Block]:
    blocks = [b for page in toctree_pages() for b in markdown_blocks(page)]
    return blocks + readme_blocks()


def project_blocks(project: str) -> list[Block]:
    return [b for b in all_blocks() if b.project == project]
