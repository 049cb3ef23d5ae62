"""The README and the pages under docs/: the README stays short and links every page, every local
link resolves, and every `titan-async` command in their shell blocks works as written.

Commands are the lines of ```bash (sh, shell, console) blocks that start with `titan-async `, with
backslash continuations joined. The cheap ones run here, in this process and in an empty working
directory: `--help`, `--version`, `config show`, and `plan` on up to 8 GPUs (larger layouts are
planned by test_plan.py, test_plan_moe.py and test_simulation.py; TITAN_ASYNC_DOCS_ALL_PLANS=1
runs them here too). A trailing comment `# exit status N` makes N the expected status. Every other
command (train, resume, eval, export, report, compare) must parse: its subcommand and each of its
options appear in `titan-async SUBCOMMAND --help`, argparse accepts it, its `--config` is a shipped
config or an existing file (or the config.toml of a documented run), `config show` accepts its
`--set` keys, `train` and `resume` pass the config checks `train` makes before it starts (parallel
degrees against the process count among them), and every run directory it reads is one that a
documented `train` writes. `python tools/X.py` commands must name an existing script and options
its source defines."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from conftest import REPO, cli_in_process

README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
MAX_README_LINES = 200
CHEAP_PLAN_GPUS = 8
ALL_PLANS = os.environ.get("TITAN_ASYNC_DOCS_ALL_PLANS") == "1"


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    text: str

    @property
    def args(self) -> list[str]:
        """The arguments after `titan-async` (or after the interpreter), comments removed."""
        return shlex.split(self.text, comments=True)[1:]

    @property
    def status(self) -> int:
        found = re.search(r"#.*\bexit status (\d+)", self.text)
        return int(found.group(1)) if found else 0

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}: {self.text}"


def shell_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of every line in the page's shell code blocks, continuations joined."""
    lines, fence, pending, start = [], None, "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = stripped[3:].strip() if fence is None else None
            continue
        if fence not in SHELL_BLOCKS:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append((start, pending + stripped))
        pending = ""
    return lines


def commands(prefix: str = "titan-async ") -> list[Command]:
    return [Command(page, number, text) for page in PAGES for number, text in shell_lines(page) if text.startswith(prefix)]


COMMANDS = commands()
TOOLS = [c for c in commands("python ") + commands(".venv/bin/python ") + commands("bash tools/")
         if c.args and c.args[0].startswith("tools/")]


def option(args: list[str], name: str) -> str | None:
    """The value of the last `name VALUE` (or `name=VALUE`) in args."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def sets(args: list[str]) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--set"]


def subcommand(args: list[str]) -> list[str]:
    return args[:2] if args[:1] == ["config"] else args[:1]


TRAINED = {option(c.args, "--run-dir"): c for c in COMMANDS if c.args[:1] == ["train"] and option(c.args, "--run-dir")}
"""Run directory -> the documented `train` command that writes it."""


def config_of(command: Command) -> tuple[str, list[str]]:
    """(--config as `config show` takes it, --set assignments) that decide `command`'s run config:
    for a command on a documented run directory, that of the `train` that writes it."""
    args = command.args
    run_dir = option(args, "--run-dir") if args[0] == "resume" else None
    config = option(args, "--config")
    if config and Path(config).name == "config.toml" and str(Path(config).parent) in TRAINED:
        run_dir = str(Path(config).parent)
    if run_dir:
        assert run_dir in TRAINED, f"{command}\n  {run_dir} is not the --run-dir of a documented train command"
        base, base_sets = config_of(TRAINED[run_dir])
        return base, base_sets + sets(args)
    return config or "debug_cpu", sets(args)


def runs_read(args: list[str]) -> list[str]:
    """The run directories a command reads."""
    found = []
    if args[0] in ("resume", "report"):
        found.append(option(args, "--run-dir"))
    if args[0] in ("eval", "export"):
        found.append(str(Path(option(args, "--checkpoint")).parent.parent))
    if args[0] == "compare":
        found += [a for a in args[1:] if not a.startswith("--") and option(args, "--target") != a and option(args, "--out") != a]
    for name in ("--baseline", "--costs-from"):
        if option(args, name):
            found.append(option(args, name))
    return found


def is_cheap(command: Command) -> bool:
    args = command.args
    if args[-1:] in (["--help"], ["--version"]) or args[:1] == ["config"] or command.status:
        return True
    if args[:1] != ["plan"]:
        return False
    config = option(args, "--config") or ""
    gpus = int(option(args, "--nodes") or 1) * int(option(args, "--gpus-per-node") or 1)
    produced = Path(config).name == "config.toml" and str(Path(config).parent) in TRAINED
    return not produced and (ALL_PLANS or gpus <= CHEAP_PLAN_GPUS)


@cache
def help_text(*sub: str) -> str:
    """`titan-async SUB --help`, run in this process."""
    from titan_async import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([*sub, "--help"])
    return out.getvalue()


def help_options(*sub: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", help_text(*sub)))


def _id(command: Command) -> str:
    return f"{command.page.name}:{command.line}"


# --- the pages -----------------------------------------------------------------------------


def local_links(page: Path) -> list[str]:
    """Targets of the page's markdown links and images that are not web addresses."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug)
    return found


def test_readme_is_short_and_links_every_docs_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"
    assert len(PAGES) > 1, "no pages under docs/"
    linked = {(README.parent / t.split("#")[0]).resolve() for t in local_links(README)}
    missing = [p.relative_to(REPO).as_posix() for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_readme_starts_with_the_two_set_up_commands():
    first = shell_lines(README)[:2]
    assert first[0][1].startswith("python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/titan-async train")
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert first[1][1].split("#")[0].strip() == ci, "the README's test command is not the one .ci/run runs"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_local_link_resolves(page):
    broken = []
    for target in local_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: links to nothing: {broken}"


def test_every_page_opens_with_a_title_and_a_summary():
    for page in PAGES[1:]:
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# "), f"{page.name}: no title"
        body = next((line for line in lines[1:] if line.strip()), "")
        assert body and not body.startswith(("#", "```", "|", "-")), f"{page.name}: no summary paragraph under the title"


# --- the commands ----------------------------------------------------------------------------


def test_the_pages_hold_commands():
    assert len(COMMANDS) >= 30 and any(is_cheap(c) for c in COMMANDS)


@pytest.mark.parametrize("command", [c for c in COMMANDS if is_cheap(c)], ids=_id)
def test_cheap_command_runs_as_written(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli_in_process(capsys, *command.args)
    assert code == command.status, f"{command}\n  exited {code}\n{out[-2000:]}\n{err[-2000:]}"
    if command.status:
        assert len(err.strip().splitlines()) == 1, f"{command}\n  not one line:\n{err}"


@pytest.mark.parametrize("command", [c for c in COMMANDS if not is_cheap(c)], ids=_id)
def test_other_command_parses(command, capsys, monkeypatch):
    from titan_async.cli import _config_path, _parser
    from titan_async.config.run_config import load_run_config
    from titan_async.core.errors import UserError

    args = command.args
    sub = subcommand(args)
    listed = re.search(r"\{([\w,]+)\}", help_text()).group(1).split(",")
    assert sub[0] in listed, f"{command}\n  no subcommand {sub[0]!r} in `titan-async --help`"
    known = help_options(*sub)
    unknown = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in known]
    assert not unknown, f"{command}\n  options not in `titan-async {' '.join(sub)} --help`: {unknown}"
    try:
        _parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{command}\n  argparse refuses it: {capsys.readouterr().err}")

    for run_dir in runs_read(args):
        assert run_dir in TRAINED, f"{command}\n  reads {run_dir}, which no documented train command writes"
    monkeypatch.chdir(REPO)  # the pages' relative paths start at the repository root
    config, assignments = config_of(command)
    if args[0] in ("train", "resume", "plan"):
        code, _, err = cli_in_process(capsys, "config", "show", "--config", config,
                                      *[x for a in assignments for x in ("--set", a)])
        assert code == 0, f"{command}\n  config show refuses its config or keys: {err}"
    if args[0] in ("train", "resume"):
        nproc = option(args, "--nproc-per-node")
        if nproc is None and args[0] == "resume":
            nproc = option(TRAINED[option(args, "--run-dir")].args, "--nproc-per-node")
        try:
            load_run_config(_config_path(config), assignments).check(int(nproc or 1))
        except UserError as err:
            pytest.fail(f"{command}\n  train would stop before it starts: {err}")
    if args[0] in ("eval", "export"):
        checkpoint = Path(option(args, "--checkpoint"))
        step = int(checkpoint.name.removeprefix("step-"))
        run_config, run_sets = config_of(TRAINED[str(checkpoint.parent.parent)])
        run = load_run_config(_config_path(run_config), run_sets)
        saved = step % run.checkpoint.interval == 0 or step == run.training.steps
        assert step <= run.training.steps and saved, f"{command}\n  its run saves no checkpoint at step {step}"


@pytest.mark.parametrize("command", TOOLS, ids=_id)
def test_tool_command_names_a_script_and_its_options(command):
    script = REPO / command.args[0]
    assert script.is_file(), f"{command}\n  no such script"
    source = script.read_text()
    unknown = [a for a in command.args[1:] if a.startswith("--") and f'"{a.split("=")[0]}"' not in source]
    assert not unknown, f"{command}\n  options {script.name} does not define: {unknown}"
