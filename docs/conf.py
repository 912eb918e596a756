"""Sphinx configuration of the user guide (docs/), built by scripts/test with warnings as errors.

    .venv/bin/sphinx-build -W --keep-going -b html docs .tmp/docs-html

Pages are Markdown (myst-parser), plain enough to read on the repository
page: the API reference and the deployment recipes are written into their
pages by scripts/docs_pages.py, not included at build time.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from django_dbworker.version import __version__  # noqa: E402

project = "django-dbworker"
author = "django-dbworker developers"
copyright = "django-dbworker developers"
version = release = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.intersphinx",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]

# Markdown: anchors for headings down to ### so that [text](page.md#a-heading)
# links resolve (and are checked: a broken one is a warning, so an error here).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# Names the docs link to (Django's own reference); offline builds resolve
# nothing and say nothing: no inventory is fetched unless asked for.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}

html_theme = "furo"
html_title = f"django-dbworker {release}"
html_static_path: list[str] = []
pygments_style = "default"
