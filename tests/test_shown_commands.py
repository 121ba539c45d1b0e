"""Every `raytrain-app` command the project shows runs as written: the code blocks of README.md and
of every page under docs/, each command's `--help` examples and the comments in `cluster/*.yaml`.

Each command must name only files that exist (inputs: configs, profiles, scripts, data; not the
outputs it writes, nor the run directories and jobs earlier commands make), and must parse: a
command that would submit runs with `--dry-run`, which plans the whole job (config, cluster
shape, builders) and sends nothing; any other runs with `--help` appended, which click refuses
for an unknown command or option. A line whose arguments are placeholders (`CONFIG`, `RUN_DIR`)
or optional parts (`[--nodes N]`) is a command's grammar: each option it names must exist.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from dataclasses import dataclass

import click
import pytest

from raytrain_app.cli import main
from tests.commands import command
from tests.conftest import REPO

FILE = re.compile(r"\.(ya?ml|py|csv|parquet|json|pt|png|sbatch|whl)$|^(examples|cluster|tests|benchmarks)/")
PRODUCT = re.compile(r"^(\.\./)?(runs|sweeps|exports|models|data)/|^[a-z0-9]+://|^/")  # made by earlier commands
OUTPUT_OPTIONS = {"-o", "--output", "--run-dir"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.py)?$|[\[\]|]|\.\.\.")
CONTROL = {"&&", "||", "|", ";", "&"}
REDIRECT = {">", ">>", "<", "2>", "2>&1"}
pytestmark = pytest.mark.slow  # a hundred commands, a minute of CPU


@dataclass(frozen=True)
class Shown:
    where: str  # file:line, or the command whose --help shows it
    tokens: tuple[str, ...]  # after `raytrain-app`
    cwd: str = "."  # where it runs, relative to the checkout: a documented block may `cd` first

    def __str__(self) -> str:
        return f"{self.where}: raytrain-app {shlex.join(self.tokens)}"


def commands_in(line: str, where: str, cwd: str = ".") -> tuple[list[Shown], str]:
    """The `raytrain-app` commands of one shell line, split at `&&`, `|`, `;` (comments, variable
    assignments and redirections with their targets dropped), and the directory a `cd` in it
    leaves the shell in."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: not a shell line
        return [], cwd
    found, segment = [], []
    for token in [*tokens, ";"]:
        if token in CONTROL:
            while segment and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", segment[0]):
                segment.pop(0)
            if segment[:1] == ["raytrain-app"] and len(segment) > 1:
                found.append(Shown(where, tuple(segment[1:]), cwd))
            elif segment[:1] == ["cd"] and len(segment) == 2:
                cwd = os.path.normpath(os.path.join(cwd, segment[1]))
            segment = []
        elif segment and segment[-1] in REDIRECT:
            segment.pop()  # the redirection's target: an output, or a file the shell reads
        else:
            segment.append(token)
    return [Shown(s.where, tuple(t for t in s.tokens if t not in REDIRECT), s.cwd) for s in found], cwd


DOCUMENTS = ["README.md", *sorted(os.path.relpath(path, REPO) for path in
                                  glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))]


def document_commands() -> list[Shown]:
    """The commands in the code blocks of README.md and every docs/ page."""
    return [shown for document in DOCUMENTS for shown in commands_in_document(document)]


def commands_in_document(document: str) -> list[Shown]:
    found, fenced, cwd = [], False, "."
    lines = open(os.path.join(REPO, document)).read().split("\n")
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced, cwd = not fenced, "."  # each block starts in the checkout
        elif fenced and not line.rstrip().endswith("\\"):
            start = number
            while start > 1 and lines[start - 2].rstrip().endswith("\\"):
                start -= 1
            joined = " ".join(part.rstrip().rstrip("\\") for part in lines[start - 1:number])
            shown, cwd = commands_in(joined, f"{document}:{number}", cwd)
            found += shown
    return found


def profile_comment_commands() -> list[Shown]:
    found = []
    for path in sorted(glob.glob(os.path.join(REPO, "cluster", "**", "*.yaml"), recursive=True)):
        for number, line in enumerate(open(path), 1):
            text = line.strip()
            if text.startswith("#") and "raytrain-app " in text:
                found += commands_in(text.lstrip("# "), f"{os.path.relpath(path, REPO)}:{number}")[0]
    return found


def help_example_commands() -> list[Shown]:
    found = []

    def visit(cmd: click.Command, path: tuple[str, ...]) -> None:
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                visit(sub, (*path, name))
        examples = (cmd.help or "").split("Examples:", 1)
        for line in examples[1].splitlines() if len(examples) == 2 else ():
            found.extend(commands_in(line.strip(), f"raytrain-app {' '.join(path)} --help".replace("  ", " "))[0])

    visit(main, ())
    return found


SHOWN = document_commands() + profile_comment_commands() + help_example_commands()


def command_of(tokens: tuple[str, ...]) -> tuple[click.Command, int]:
    """The click command the tokens name, and how many tokens its name took."""
    cmd, used = main, 0
    while isinstance(cmd, click.Group) and used < len(tokens) and tokens[used] in cmd.commands:
        cmd, used = cmd.commands[tokens[used]], used + 1
    return cmd, used


def options_of(cmd: click.Command) -> set[str]:
    return {opt for param in cmd.params for opt in [*param.opts, *param.secondary_opts]} | {"--help", "-h"}


def test_the_project_shows_commands_from_every_source():
    """Not vacuous: the README, the docs' pages, the profiles' comments and the --help examples each
    show many."""
    sources = {shown.where.split(":")[0].split(" ")[0] for shown in SHOWN}
    assert {"README.md", "docs/getting-started.md", "docs/how-to/ray-clusters.md", "docs/how-to/slurm.md",
            "cluster/kuberay.yaml", "raytrain-app"} <= sources
    assert len(SHOWN) > 80
    assert commands_in("cd a && raytrain-app k8s render x.yaml --cluster c.yaml > out.yaml  # said", "t") == (
        [Shown("t", ("k8s", "render", "x.yaml", "--cluster", "c.yaml"), "a")], "a")


@pytest.mark.parametrize("shown", SHOWN, ids=str)
def test_a_shown_command_names_files_that_exist_and_parses(shown, tmp_path):
    cmd, used = command_of(shown.tokens)
    assert used, f"{shown}: no such command"
    args = shown.tokens[used:]
    unknown = [a.split("=")[0] for a in args if a.startswith("-") and a != "--" and a.split("=")[0]
               not in options_of(cmd) and "--" not in args[:args.index(a)]]
    assert not unknown, f"{shown}: {cmd.name} has no option {', '.join(unknown)}"
    if any(PLACEHOLDER.search(a) for a in args):
        return  # a command's grammar: its options exist, which is all it says
    script_args = args.index("--") if "--" in args else len(args)
    named = [a if a.startswith("-") or "://" in a else os.path.normpath(os.path.join(shown.cwd, a))
             for a in args[:script_args]]  # relative to the checkout
    missing = [a for i, a in enumerate(named) if FILE.search(args[i]) and not PRODUCT.search(a)
               and (i == 0 or args[i - 1] not in OUTPUT_OPTIONS) and not os.path.exists(os.path.join(REPO, a))
               and not _convert_output(cmd, args, i)]
    assert not missing, f"{shown}: names {', '.join(missing)}, which does not exist"
    # A submission plans whole with --dry-run, unless it continues what an earlier command made.
    submits = (cmd.name == "submit" or (cmd.name == "sweep" and "--cluster" in args)) and not any(
        PRODUCT.search(a) for a in named)
    if submits and "--dry-run" not in args:
        args = (*args[:script_args], "--dry-run", *args[script_args:])
    elif not submits:
        args = (*args[:script_args], "--help")
    where = os.path.join(REPO, shown.cwd)
    proc = command([*shown.tokens[:used], *args], where if os.path.isdir(where) else REPO,
                   {**os.environ, "HOME": str(tmp_path)}, 120)
    assert proc.returncode == 0, f"{shown}: {proc.stderr.strip()[-500:]}"


def _convert_output(cmd: click.Command, args: tuple[str, ...], i: int) -> bool:
    """`convert csv|images INPUT OUTPUT`: its second positional is the Parquet folder it writes."""
    flags = {opt for param in cmd.params if getattr(param, "is_flag", False) for opt in param.opts}
    positional = [j for j, a in enumerate(args)
                  if not a.startswith("-") and (j == 0 or not args[j - 1].startswith("-") or args[j - 1] in flags)]
    return cmd.name in ("csv", "images") and len(positional) > 1 and i == positional[1]
