"""The README's Guide as the tests read it: its fenced Python blocks, each with a kind.

The first line of a ```python block in the Guide says what the block is:

- ``# settings.py``: lines of the project's settings module. In a list,
  ``[...,`` stands for the setting's existing entries
  (``INSTALLED_APPS = [..., "django_dbworker"]``).
- ``# <path>.py`` (``# myapp/workers.py``, ``# tests/test_signup.py``): the
  contents of that file of the reader's project, ``myapp`` being one of its
  apps and ``mysite`` the project package; blocks naming the same file are
  concatenated in order (``# myapp/workers.py (continued)``). A file under
  ``tests/`` is a pytest module.
- ``# illustrative: <why>``: a sketch that is only compiled, not run. Keep
  these few: every other block runs in ``test_readme_examples.py``.
- anything else: code typed into ``manage.py shell`` (with ``--no-imports``,
  so the block's own imports are what it gets), run after the files exist.

Nothing here runs code; it only reads README.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"

FILE_MARKER = re.compile(r"#\s+(?P<path>[\w./-]+?\.py)\b")
ILLUSTRATIVE_MARKER = re.compile(r"#\s+illustrative:\s*\S")
ELLIPSIS_LIST = re.compile(r"^(?P<name>[A-Z_]+) = \[\.\.\., ", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    heading: str  # the ### section it sits in
    line: int  # README line of its first code line
    code: str

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0] if self.code else ""

    @property
    def path(self) -> str | None:
        """The project file this block is (or adds to), if it names one."""
        match = FILE_MARKER.match(self.first_line)
        return match["path"] if match else None

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
        return f"README.md:{self.line} ({self.heading})"

    def settings_code(self) -> str:
        """A settings block as settings-module code: ``[...,`` keeps existing entries."""
        code = ELLIPSIS_LIST.sub(lambda m: f"{m['name']} = [*{m['name']}, ", self.code)
        if "..." in code:
            raise ValueError(f"{self.where}: '...' outside 'NAME = [..., ' in a settings block")
        return code


def guide_blocks(text: str | None = None) -> list[Block]:
    """The ```python blocks between ``## Guide`` and the next ``##`` heading."""
    lines = (README.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    in_guide = False
    heading = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            in_guide = line.strip() == "## Guide"
        elif line.startswith("### "):
            heading = line[4:].strip()
        elif in_guide and line.strip() == "```python":
            start = i + 1
            end = start
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise ValueError(f"README.md:{i + 1}: unterminated ```python block")
            blocks.append(Block(heading, start + 1, "\n".join(lines[start:end]) + "\n"))
            i = end
        i += 1
    return blocks
