"""The documentation site (mkdocs.yml, docs/) and README.md: the site builds with no broken link
or anchor, every Python block in them runs (or says why not), every page in the nav exists, and
the README stays short. The commands they show are run by tests/test_shown_commands.py."""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO

DOCUMENTS = ["README.md", *sorted(os.path.relpath(path, REPO) for path in
                                  glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->\s*$")


def python_blocks() -> list[tuple[str, int, str, str | None]]:
    """Each ```python block: its document, line, code, and the reason a `<!-- not run: ... -->`
    comment on the line before it gives (None: it runs)."""
    found = []
    for document in DOCUMENTS:
        lines = open(os.path.join(REPO, document)).read().split("\n")
        number = 0
        while number < len(lines):
            if lines[number].strip() == "```python":
                end = next(i for i in range(number + 1, len(lines)) if lines[i].strip() == "```")
                previous = NOT_RUN.search(lines[number - 1]) if number else None
                found.append((document, number + 1, "\n".join(lines[number + 1:end]),
                              previous.group(1) if previous else None))
                number = end
            number += 1
    return found


BLOCKS = python_blocks()


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: validation in mkdocs.yml makes a broken link or anchor fail it."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "raytrain-app train" in cli and "--max-failures" in cli  # mkdocs-click rendered the commands
    api = (tmp_path / "site" / "reference" / "python-api" / "index.html").read_text()
    assert 'id="raytrain_app.api.fit"' in api  # mkdocstrings rendered the API


def test_the_docs_show_python_and_few_blocks_are_not_run():
    assert len(BLOCKS) >= 3
    skipped = [(document, line, reason) for document, line, _, reason in BLOCKS if reason]
    assert len(skipped) <= 2, skipped


@pytest.mark.parametrize("document, line, code, reason", BLOCKS, ids=[f"{d}:{n}" for d, n, _, _ in BLOCKS])
def test_a_python_block_runs(document, line, code, reason, tmp_path, monkeypatch):
    """In a fresh namespace, from a folder of its own where `examples/` is the checkout's, so
    what it writes (`runs/...`) stays there."""
    if reason:
        pytest.skip(f"{document}:{line} is marked not run: {reason}")
    os.symlink(os.path.join(REPO, "examples"), tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(REPO)
    namespace = {"__name__": "__main__"}
    exec(compile("\n" * line + code, os.path.join(REPO, document), "exec"), namespace)


def test_every_page_in_the_nav_exists_and_every_page_is_in_it():
    config = yaml.safe_load(open(os.path.join(REPO, "mkdocs.yml")))
    assert config["docs_dir"] == "docs"

    def pages(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [page for item in node for page in pages(item)]
        return [page for value in node.values() for page in pages(value)]

    nav = pages(config["nav"])
    assert [page for page in nav if not os.path.isfile(os.path.join(REPO, "docs", page))] == []
    assert sorted(nav) == sorted(os.path.relpath(d, "docs") for d in DOCUMENTS if d.startswith("docs/"))


def test_the_readme_is_short_and_links_into_the_docs():
    readme = open(os.path.join(REPO, "README.md")).read()
    assert len(readme.splitlines()) <= 150
    linked = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert linked and all(os.path.exists(os.path.join(REPO, path)) for path in linked), linked


def console_shape(text: str) -> list[list[str]]:
    """Each line's words, with what differs from run to run (numbers, durations, paths, the rules'
    widths, which follow the paths') as N, PATH and RULE."""
    shapes = []
    for line in text.strip().splitlines():
        line = re.sub(r"^-+$", "RULE", re.sub(r"/\S+", "PATH", line))
        line = re.sub(r"[-+~]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?", "N", line)
        shapes.append(line.split())
    return shapes


@pytest.mark.slow
def test_the_console_the_readme_shows_is_what_its_command_prints(tmp_path):
    """The README's 30-second example, run as written (but into a fresh run directory): the same
    lines in the same order, numbers, durations and paths aside."""
    from tests.commands import command

    readme = open(os.path.join(REPO, "README.md")).read()
    shown_command, shown = re.search(r"```bash\n(raytrain-app train [^\n]+)\n```\s*```text\n(.*?)```", readme,
                                     re.S).groups()
    args = shlex.split(shown_command)[1:]
    args[args.index("--run-dir") + 1] = str(tmp_path / "run")
    done = command(args, REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert console_shape(done.stdout + done.stderr) == console_shape(shown), done.stdout + done.stderr
