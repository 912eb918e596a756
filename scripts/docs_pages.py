#!/usr/bin/env python3
"""Writes the generated blocks of the docs pages, so that they read on the repository page.

    .venv/bin/python scripts/docs_pages.py           # rewrite the blocks in place
    .venv/bin/python scripts/docs_pages.py --check   # exit 1 naming each stale page

GitHub renders Markdown, not Sphinx directives: an ``autoclass`` or a
``literalinclude`` shows as nothing there, where most readers look. So the
API reference and the deployment recipes are committed as plain Markdown,
written by this script between marker comments, and a test
(tests/docs/test_docs_examples.py) fails when a docstring or a recipe file
changed without them:

    <!-- api: django_dbworker.WorkItemHandler members=handle,enqueue [signature=no] -->
    ... the class's signature and docstring, then each member's ...
    <!-- /api -->

    <!-- file: deploy/systemd/mysite-worker@.service ini -->
    ... the file, fenced ...
    <!-- /file -->

Docstrings are written with reST's double backticks; they become Markdown
code spans. Nothing else of reST is used in the package's docstrings.
Signatures are fenced as ``py``, not ``python``: the docs tests run every
``python`` block of every page as an example (tests/docs/pages.py), and a
signature is none.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "docs" / "reference" / "api.md", ROOT / "docs" / "topics" / "deployment.md"]
BLOCK = re.compile(
    r"(?P<open><!-- (?P<kind>api|file): (?P<args>[^\n]*?) -->\n)"
    r"(?P<body>.*?)(?P<close><!-- /(?P=kind) -->)",
    re.S,
)


def _setup_django() -> None:
    """The docstrings' objects import models: a minimal configuration, no project, no database."""
    sys.path.insert(0, str(ROOT))
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            INSTALLED_APPS=[
                "django.contrib.contenttypes",
                "django.contrib.auth",
                "django_dbworker",
            ],
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
            USE_TZ=True,
        )
        django.setup()


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return importlib.import_module(dotted)


def _markdown(doc: str | None) -> str:
    """A docstring as Markdown: reST's literal blocks fenced, its ``code`` as `code`.

    A literal block ("Text::", a blank line, lines indented by any amount) is
    kept as written, in a fence longer than any run of backticks inside it;
    the code-span rewrite touches only the prose around it.
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    out: list[str] = []
    prose: list[str] = []

    def flush() -> None:
        out.extend(re.sub(r"``([^`]+)``", r"`\1`", line) for line in prose)
        prose.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        opens = line.rstrip().endswith("::") and i + 1 < len(lines) and not lines[i + 1].strip()
        if not opens:
            prose.append(line)
            i += 1
            continue
        head = line.rstrip()[:-2].rstrip()
        prose += [head + ":"] if head else []
        flush()
        i += 2
        block: list[str] = []
        while i < len(lines) and (not lines[i].strip() or lines[i][:1].isspace()):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            block.pop()
        indent = min(len(b) - len(b.lstrip()) for b in block if b.strip()) if block else 0
        longest = max((len(run) for run in re.findall(r"`+", "\n".join(block))), default=0)
        fence = "`" * max(3, longest + 1)
        out += ["", f"{fence}py", *(b[indent:] for b in block), fence, ""]
    flush()
    return "\n".join(out).strip()


def _signature(name: str, obj: Any) -> str:
    """``name(params) -> result`` with the annotations as written, without their quotes."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    if inspect.isclass(obj) and not sig.parameters:
        return name
    # The package's annotations are strings (``from __future__ import annotations``).
    unquote = {
        p.name: p.replace(annotation=_unquoted(p.annotation)) for p in sig.parameters.values()
    }
    sig = sig.replace(
        parameters=list(unquote.values()), return_annotation=_unquoted(sig.return_annotation)
    )
    return f"{name}{sig}"


class _Written:
    """An annotation shown as its source text (no quotes around it)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _unquoted(annotation: Any) -> Any:
    return _Written(annotation) if isinstance(annotation, str) else annotation


def _api_block(args: str) -> str:
    dotted, *options = args.split()
    opts = dict(option.split("=", 1) for option in options)
    obj = _resolve(dotted)
    short = dotted.rpartition(".")[2]
    parts: list[str] = []
    if inspect.ismodule(obj):
        parts.append(_markdown(obj.__doc__))
    else:
        kind = "class" if inspect.isclass(obj) else ""
        head = short if kind and issubclass(obj, BaseException) else _signature(short, obj)
        # signature=no: a class whose constructor is Django's, not the user's to call
        # (and spelled differently by each Django and Python version).
        if opts.get("signature") == "no" or not (callable(obj) or inspect.isclass(obj)):
            head = short
        parts.append(f"### `{short}`\n\n```py\n{(kind + ' ') if kind else ''}{head}\n```")
        doc = obj.__doc__ if (inspect.isclass(obj) or callable(obj)) else opts.get("doc", "")
        if doc:
            parts.append(_markdown(doc))
    for member in filter(None, opts.get("members", "").split(",")):
        value = inspect.getattr_static(obj, member)
        func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        prefix = "classmethod " if isinstance(value, classmethod) else ""
        # A module's functions are headed like classes; a class's members a level below.
        qual, level = (member, "###") if inspect.ismodule(obj) else (f"{short}.{member}", "####")
        if isinstance(value, property):
            parts.append(f"{level} `{qual}`\n\n```py\nproperty {member}\n```")
            func = value.fget
        else:
            bound = getattr(obj, member)
            head = f"{prefix}{_signature(member, bound)}"
            parts.append(f"{level} `{qual}`\n\n```py\n{head}\n```")
        text = _markdown(getattr(func, "__doc__", None))
        if text:
            parts.append(text)
    return "\n\n".join(parts) + "\n"


def _file_block(args: str) -> str:
    path, language = [*args.split(), "text"][:2]
    text = (ROOT / path).read_text().rstrip("\n")
    fence = "````" if "```" in text else "```"
    return f"{fence}{language}\n{text}\n{fence}\n"


def render(page: Path) -> str:
    def replace(match: re.Match[str]) -> str:
        build = _api_block if match["kind"] == "api" else _file_block
        return match["open"] + build(match["args"]) + match["close"]

    return BLOCK.sub(replace, page.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Change nothing; exit 1 if stale.")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    _setup_django()
    stale = []
    for page in PAGES:
        text = render(page)
        if text != page.read_text():
            stale.append(page)
            if not args.check:
                page.write_text(text)
    for page in stale:
        verb = "is stale" if args.check else "rewritten"
        print(f"{page.relative_to(ROOT)} {verb}", file=sys.stderr)
    if stale and args.check:
        print("Run: .venv/bin/python scripts/docs_pages.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
