"""Every docs page's examples: the convention, the tutorial's project, the reference's facts.

The topic guides' project runs in test_readme_examples.py; here are the
other projects (the tutorial; the README's quick start), the examples
that are not run in a project (the LOGGING dict, through
``logging.config.dictConfig``), and the reference pages checked against
the code they describe (every ``DBWORKER`` key and default, every flag of
every command).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import get_commands, load_command_class
from django.db import connection

from django_dbworker.conf import DEFAULTS
from tests.docs.pages import (
    DOCS,
    GUIDE,
    README,
    Block,
    all_blocks,
    markdown_blocks,
    project_blocks,
    readme_blocks,
    toctree_pages,
)
from tests.docs.scratch import Project, scratch_project

#: Blocks that are only compiled; each says why in its first line.
MAX_ILLUSTRATIVE = 2


def test_every_block_follows_the_convention() -> None:
    blocks = all_blocks()
    projects = Counter(b.project for b in blocks)
    assert projects[GUIDE] >= 10 and projects["tutorial"] >= 5, projects
    illustrative = [b.where for b in blocks if b.kind == "illustrative"]
    assert len(illustrative) <= MAX_ILLUSTRATIVE, illustrative
    for block in blocks:
        compile(block.code, block.where, "exec")
        if block.kind == "settings":
            block.settings_code()


def test_every_page_is_read() -> None:
    # Pages outside the table of contents would be neither built nor tested
    # (Sphinx warns about them too; this names them without a build).
    read = set(toctree_pages())
    assert {p.resolve() for p in DOCS.rglob("*.md")} <= read, sorted(
        str(p) for p in {p.resolve() for p in DOCS.rglob("*.md")} - read
    )


# -- the tutorial ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    with scratch_project(tmp_path_factory.mktemp("tutorial"), project_blocks("tutorial")) as p:
        yield p


def test_tutorial_sends_the_welcome_from_a_worker(tutorial: Project) -> None:
    out = tutorial.manage("check", "--fail-level", "WARNING").stdout
    assert "System check identified no issues" in out, out
    # The reader's curl, through Django's test client (the dev server's host).
    status = tutorial.query(
        "from django.test import Client\n"
        "r = Client().post('/subscribe/', {'email': 'ada@example.com'}, HTTP_HOST='localhost')\n"
        "print(r.status_code)"
    )
    assert status == 201
    pending = tutorial.query(
        "import json\nfrom django_dbworker.models import WorkItem\n"
        "print(json.dumps(list(WorkItem.objects.values_list('handler', 'status'))))"
    )
    assert pending == [["send_welcome", "pending"]]

    worker = tutorial.manage("run_workers", "--burst")
    assert "Subject: Welcome!" in worker.stdout and "To: ada@example.com" in worker.stdout, (
        worker.stdout + worker.stderr
    )
    # The start line the tutorial shows (on this leg's database).
    assert (
        "Starting worker: handlers=dbworker.retention,send_welcome queues=all concurrency=8 "
        f"database={connection.vendor}" in worker.stderr
    ), worker.stderr
    after = tutorial.query(
        "import json\nfrom django_dbworker.models import WorkItem\n"
        "from myapp.models import Subscriber\n"
        "print(json.dumps([list(WorkItem.objects.values_list('status', 'result')), "
        "list(Subscriber.objects.values_list('welcomed', flat=True))]))"
    )
    assert after == [[["succeeded", {"sent_to": "ada@example.com"}]], [True]]


# -- the README's quick start --------------------------------------------------------


#: The handlers the README's batches example imports from the reader's app
#: (the example shows the enqueues, not the handlers; the batches guide has both).
README_BATCH_HANDLERS = """

# The scaffolding: the handlers of the README's batches example.
class ImportRow(WorkItemHandler):
    name = "import_row"

    def handle(self, payload):
        return {"imported": payload["row"]}


class ImportFinished(WorkItemHandler):
    name = "import_finished"

    def handle(self, payload):
        return payload


class Extract(WorkItemHandler):
    name = "extract"

    def handle(self, payload):
        return {"extracted": payload["source"]}


class Transform(WorkItemHandler):
    name = "transform"

    def handle(self, payload):
        return {"transformed": payload["table"]}


class Load(WorkItemHandler):
    name = "load"

    def handle(self, payload):
        return {"loaded": payload["tables"]}
"""


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    blocks = readme_blocks()
    assert blocks, "README.md's quick start has no code blocks"
    # "One of your apps": the reader's project has it installed already.
    with scratch_project(
        tmp_path_factory.mktemp("quickstart"),
        blocks,
        settings_tail='\n# The scaffolding\nINSTALLED_APPS += ["myapp"]\n',
    ) as p:
        with (p.dir / "myapp" / "workers.py").open("a") as workers:
            workers.write(README_BATCH_HANDLERS)
        yield p


def test_readme_quick_start_runs(quickstart: Project) -> None:
    blocks = readme_blocks()
    out = quickstart.manage("check", "--fail-level", "WARNING").stdout
    assert "System check identified no issues" in out, out
    shells = [b for b in blocks if b.kind == "shell"]
    assert shells, [b.where for b in blocks]
    for block in shells:
        quickstart.shell(block.code)
    worker = quickstart.manage("run_workers", "--burst")
    statuses = quickstart.query(
        "import json\nfrom django_dbworker.models import WorkItem\n"
        "print(json.dumps(sorted(WorkItem.objects.values_list('status', flat=True))))"
    )
    assert statuses and set(statuses) == {"succeeded"}, (statuses, worker.stderr)


def test_readme_batches_example_ran_in_order(quickstart: Project) -> None:
    """After the quick start's run: the callback's payload, the chain and the fan-in."""
    batches, rows = quickstart.query(
        "import json\nfrom django_dbworker.batches.models import Batch\n"
        "from django_dbworker.models import WorkItem\n"
        "print(json.dumps([list(Batch.objects.values_list('pk', flat=True)), "
        "[[i.handler, i.payload, i.claimed_at.isoformat(), i.finished_at.isoformat()] "
        "for i in WorkItem.objects.exclude(handler='greet').order_by('pk')]]))"
    )
    handlers = [row[0] for row in rows]
    assert handlers == [
        "import_row",
        "import_row",
        "extract",
        "extract",
        "transform",
        "load",
        "import_finished",
    ], rows
    (batch_id,) = batches
    assert rows[-1][1] == {
        "import_id": 7,
        "batch": batch_id,
        "succeeded": 2,
        "failed": 0,
        "cancelled": 0,
    }
    (_, extract_a, extract_other, transform, load, _) = rows[1:]
    assert transform[2] >= extract_a[3]
    assert load[2] >= max(transform[3], extract_other[3])


# -- examples that are not a project -------------------------------------------------


def _page_block(page: Path, pattern: str) -> Block:
    (block,) = [b for b in markdown_blocks(page) if re.search(pattern, b.code, re.M)]
    return block


def test_logging_example_configures_the_worker_loggers() -> None:
    block = _page_block(DOCS / "topics" / "deployment.md", r"^LOGGING = ")
    # In a process of its own: dictConfig changes the logging of the whole process.
    script = (
        "import logging, logging.config\n"
        f"{block.code}\n"
        "logging.config.dictConfig(LOGGING)\n"
        "logging.getLogger('django_dbworker.worker').info('worker line')\n"
        "logging.getLogger('django_dbworker.db').info('db line, not shown')\n"
        "logging.getLogger('django_dbworker.db').warning('db warning')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    lines = proc.stderr.splitlines()
    assert len(lines) == 2, proc.stderr
    assert re.fullmatch(r"\S+ \S+ INFO django_dbworker\.worker \d+: worker line", lines[0]), lines
    assert re.fullmatch(r"\S+ \S+ WARNING django_dbworker\.db \d+: db warning", lines[1]), lines


# -- the reference against the code ------------------------------------------------------


def test_settings_reference_has_every_key_and_its_default() -> None:
    page = DOCS / "reference" / "settings.md"
    block = _page_block(page, r"^DBWORKER = ")
    namespace: dict[str, object] = {}
    exec(block.code, namespace)
    assert namespace["DBWORKER"] == DEFAULTS
    text = page.read_text()
    for key in DEFAULTS:
        assert re.search(rf"^(`\w+`, )*`{key}`", text, re.M), f"{key} has no entry in {page.name}"


COMMANDS = sorted(name for name, app in get_commands().items() if app == "django_dbworker")


@pytest.mark.parametrize("name", COMMANDS)
def test_commands_reference_names_every_flag(name: str) -> None:
    text = (DOCS / "reference" / "commands.md").read_text()
    section = text.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
    command = load_command_class(get_commands()[name], name)
    parser = command.create_parser("manage.py", name)
    base = {"-h", "--help", "--version", "-v", "--verbosity", "--settings", "--pythonpath"}
    base |= {"--traceback", "--no-color", "--force-color", "--skip-checks"}
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            # A command of verbs (dbworker_queue): each verb's line and its flags.
            for verb, sub in action.choices.items():
                assert f"{name} [--database ALIAS] {verb}" in section, verb
                actions += [a for a in sub._actions if a.option_strings]
    for action in actions:
        flags = [f for f in action.option_strings if f not in base]
        if isinstance(action, argparse._SubParsersAction):
            continue
        if not action.option_strings:
            assert action.metavar and f"`{action.metavar} ...`" in section, action
        for flag in flags:
            assert f"`{flag}" in section, f"{name} {flag} is not in the commands reference"


@pytest.mark.parametrize("name", ["README", "CONTRIBUTING.md"])
def test_repository_pages_link_to_files_that_exist(name: str) -> None:
    # Sphinx checks the site's links; these pages are outside it.
    page = README if name == "README" else DOCS.parent / name
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    local = [t for t in targets if not re.match(r"[a-z]+:", t)]
    assert local, page.name
    missing = [t for t in local if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


def test_the_pages_written_from_the_code_are_current() -> None:
    # The API reference and the recipes read on the repository page as written;
    # a changed docstring or deploy/ file leaves them stale until the script runs.
    result = subprocess.run(
        [sys.executable, str(DOCS.parent / "scripts" / "docs_pages.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_the_hosted_docs_build_the_guide_with_its_own_extra() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML (the dev extra brings it) is not installed")
    config = yaml.safe_load((DOCS.parent / ".readthedocs.yaml").read_text())
    assert config["version"] == 2
    assert (DOCS.parent / config["sphinx"]["configuration"]) == DOCS / "conf.py"
    assert config["sphinx"]["fail_on_warning"] is True
    (install,) = config["python"]["install"]
    extras = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert install["extra_requirements"] == ["docs"] and "docs" in extras


def test_the_metrics_reference_names_every_metric() -> None:
    # The names are the 0.1 contract: a metric the code registers is documented.
    pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
    from prometheus_client import CollectorRegistry

    from django_dbworker.contrib.prometheus.collector import QueueCollector
    from django_dbworker.metrics import WorkerMetrics

    registry = CollectorRegistry()
    WorkerMetrics(registry)
    names = {metric.name for metric in registry.collect()}
    names |= {family.name for family in QueueCollector().describe()}
    text = (DOCS / "topics" / "observability.md").read_text()
    # prometheus_client drops a counter's _total from the family name.
    missing = {n for n in names if f"`{n}`" not in text and f"`{n}_total`" not in text}
    missing = {n for n in missing if not re.search(rf"`{n}(_total)?\{{", text)}
    assert len(names) >= 18 and not missing, f"not in observability.md: {sorted(missing)}"


def test_the_traces_reference_names_every_span_attribute() -> None:
    source = (DOCS.parent / "django_dbworker" / "tracing.py").read_text()
    attributes = set(re.findall(r'"((?:messaging|dbworker|worker)\.[a-z_.]+)"', source))
    text = (DOCS / "topics" / "observability.md").read_text()
    missing = {a for a in attributes if f"`{a}" not in text}
    assert len(attributes) >= 9 and not missing, f"not in observability.md: {sorted(missing)}"


def _listed_check_ids(text: str) -> set[str]:
    ids: set[str] = set()
    for first, last in re.findall(r"`([EW]\d{3})`(?:-`([EW]\d{3})`)?", text):
        ids.update(f"{first[0]}{n:03}" for n in range(int(first[1:]), int((last or first)[1:]) + 1))
    return ids


def test_the_checks_reference_names_every_check_id() -> None:
    package = DOCS.parent / "django_dbworker"
    used = {
        found
        for path in package.rglob("*.py")
        for found in re.findall(r"django_dbworker\.([EW]\d{3})", path.read_text())
    }
    listed = _listed_check_ids((DOCS / "reference" / "settings.md").read_text())
    assert len(used) >= 25 and used <= listed, f"not in settings.md: {sorted(used - listed)}"


def _docs_pages() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "docs_pages", DOCS.parent / "scripts" / "docs_pages.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "literal"),
    [
        ("two-space indent", ["  total = 2", "  print(total)"]),
        ("double backticks in the code", ['    empty = "``"', '    quoted = "``a``"']),
        ("a Markdown fence in the text", ["    ```python", "    x = 1", "    ```"]),
    ],
)
def test_docs_pages_turns_a_literal_block_into_a_fence_of_its_text(
    name: str, literal: list[str]
) -> None:
    """scripts/docs_pages.py writes reST's literal block ("Text::", a blank line, an indented
    block) as a Markdown fence: the page shows one code block, holding the block's text as
    written (any indentation reST allows), and the paragraph after it as a paragraph."""
    from markdown_it import MarkdownIt

    indent = len(literal[0]) - len(literal[0].lstrip())
    doc = "\n".join(["Run it like this::", "", *literal, "", "Then ``it`` ends."])
    page = _docs_pages()._markdown(doc)
    tokens = MarkdownIt("commonmark").parse(page)
    fences = [t for t in tokens if t.type in ("fence", "code_block")]
    assert [t.content for t in fences] == ["\n".join(li[indent:] for li in literal) + "\n"], page
    assert "Then `it` ends." in page
