"""Every shell command in README.md and docs/*.md runs as written.

Commands come from fenced ```bash blocks: backslash-continued lines are joined, comment-only lines skipped,
trailing `# comments` dropped (shlex, so a `#` inside quotes stays), `&&` splits a line into commands, and an env
prefix (`PJRT_DEVICE=CPU`) and a venv path (`.venv/bin/`, `.venv-xla/bin/`) are stripped: `.venv-xla/bin/neuron-opt`
is the same CLI from the same source tree, so this venv's parser checks it. Each command then matches exactly one
row of CHECKS, which says how it is checked. A command that no row matches fails: a new docs command gets a check
before it lands. A fenced block without a language that holds a command fails too (label it bash), and so does a
CHECKS row no command uses. The skips, reported by `pytest -rs`: guidellm's parser without the `clients` extra, and
Ray's without the `cluster` extra.

Examples and synopses. A command written in documentation syntax -- `[optional groups]`, `a|b` alternatives,
ALL-CAPS placeholders (`ARTIFACT`, `N`) -- is a synopsis. It expands into commands that must each pass its row's
check: the required part alone, plus each optional group alone, plus every group at once, for every alternative
(placeholders take the stand-ins in PLACEHOLDERS; `[...]`, "more flags", is dropped). So a synopsis may show only
flags that exist, with values they accept, in combinations that work: `compile ... [--backend cpu|eager|neuron]
... [--tp 2]` fails, because the default cpu backend compiles tp=1 only (`Backend.check_parallel`). Everything else
is an example and must pass as written.

Inline `code` spans in prose that name a command (`neuron-opt SUB`, `make TARGET`, `python scripts/X.py`) are
fragments, so only what they name is checked: the subcommand, target or script, and every --flag in them.

Nothing here compiles a graph or loads weights: about 8 s on 2 cores, mostly the scripts' own imports.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import itertools
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

from neuron_opt import cli, compiler

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = ("bash", "sh")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")

# Stand-ins for a synopsis's placeholders: any value of the right kind checks the same flags.
PLACEHOLDERS = {
    "ARTIFACT": "artifacts/smollm2",  # an artifact directory
    "PATH": "default",  # a checkpoint: the embedded default one stands in for any
    "NAME": "smollm2",
    "N": "4",
    "ADDR": "auto",  # a Ray cluster address
    "KEY": "sk-local",  # an API key
}

@dataclass(frozen=True)
class DocCommand:
    where: str  # "docs/serving.md:4"
    text: str  # as written, continuation lines joined
    argv: tuple[str, ...]  # env prefix, venv path and comment dropped

    @property
    def file(self) -> str:
        return self.where.rsplit(":", 1)[0]


# ---------------------------------------------------------------------------------------------- extraction


def fenced_blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """(language, line number of the first content line, lines) of each fenced block."""
    blocks: list[tuple[str, int, list[str]]] = []
    lang: str | None = None
    first, body = 0, list[str]()
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith("```"):
            if lang is None:
                lang, first, body = line[3:].strip(), i + 1, []
            else:
                blocks.append((lang, first, body))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def logical_lines(first: int, lines: list[str]) -> list[tuple[int, str]]:
    """Backslash-continued lines joined, each with the line number it starts on."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = first
    for i, line in enumerate(lines, start=first):
        if not pending:
            start = i
        if line.rstrip().endswith("\\"):
            pending.append(line.rstrip()[:-1].strip())
            continue
        out.append((start, " ".join([*pending, line.strip()])))
        pending = []
    if pending:
        out.append((start, " ".join(pending)))
    return out


def normalize(tokens: list[str]) -> tuple[str, ...]:
    while tokens and re.fullmatch(r"[A-Za-z_]\w*=\S*", tokens[0]):  # PJRT_DEVICE=CPU
        tokens = tokens[1:]
    if tokens:
        tokens = [re.sub(r"^(\./)?\.venv[\w-]*/bin/", "", tokens[0]), *tokens[1:]]
    return tuple(tokens)


def commands_in_block(rel: str, first: int, lines: list[str]) -> list[DocCommand]:
    out: list[DocCommand] = []
    for lineno, text in logical_lines(first, lines):
        tokens = shlex.split(text, comments=True)  # blank and comment-only lines give no tokens
        parts = [list(g) for is_sep, g in itertools.groupby(tokens, lambda t: t == "&&") if not is_sep]
        out += [DocCommand(f"{rel}:{lineno}", text, normalize(p)) for p in parts]
    return out


def doc_commands() -> list[DocCommand]:
    out: list[DocCommand] = []
    for path in DOCS:
        for lang, first, lines in fenced_blocks(path):
            if lang in SHELL_LANGS:
                out += commands_in_block(str(path.relative_to(ROOT)), first, lines)
    return out


# ---------------------------------------------------------------------------------------------- synopses


def is_synopsis(argv: tuple[str, ...]) -> bool:
    return any(c in t for t in argv for c in "[]|") or any(PLACEHOLDER.fullmatch(t) for t in argv)


def alternatives(token: str) -> list[str]:
    alts = token.split("|")
    unknown = [a for a in alts if PLACEHOLDER.fullmatch(a) and a not in PLACEHOLDERS]
    assert not unknown, f"placeholder(s) {unknown} have no stand-in: add them to PLACEHOLDERS"
    return [PLACEHOLDERS.get(a, a) for a in alts]


def optional_groups(argv: tuple[str, ...]) -> list[tuple[int | None, str]]:
    """Each token with the index of the [optional group] it is in (None: required); `[...]` is dropped."""
    items: list[tuple[int | None, str]] = []
    group: int | None = None
    n = 0
    for tok in argv:
        if tok.startswith("["):
            assert group is None, f"nested [ in {' '.join(argv)}"
            group, n, tok = n, n + 1, tok[1:]
        closes = tok.endswith("]")
        tok = tok.removesuffix("]")
        assert "[" not in tok and "]" not in tok, f"unbalanced brackets in {' '.join(argv)}"
        if tok != "...":
            items.append((group, tok))
        if closes:
            assert group is not None, f"unbalanced brackets in {' '.join(argv)}"
            group = None
    assert group is None, f"unclosed [ in {' '.join(argv)}"
    return items


def expand(argv: tuple[str, ...]) -> list[list[str]]:
    """An example as written; a synopsis as the commands it promises (see the module docstring)."""
    if not is_synopsis(argv):
        return [list(argv)]
    items = optional_groups(argv)
    groups = sorted({g for g, _ in items if g is not None})
    selections: list[set[int]] = [set()] + [{g} for g in groups] + ([set(groups)] if len(groups) > 1 else [])
    variants: list[list[str]] = []
    for sel in selections:
        tokens = [t for g, t in items if g is None or g in sel]
        for combo in itertools.product(*(alternatives(t) for t in tokens)):
            if list(combo) not in variants:
                variants.append(list(combo))
    return variants


# ---------------------------------------------------------------------------------------------- checks


@cache
def cli_parser() -> argparse.ArgumentParser:
    return cli.build_parser()


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in cli_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def parse_cli(argv: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return cli_parser().parse_args(argv[1:])
    except SystemExit:
        raise AssertionError(f"the CLI parser rejects it: {err.getvalue().strip()}") from None


def check_plan(cmd: DocCommand, argv: list[str]) -> None:
    out = io.StringIO()
    rc: object
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = cli.main(argv[1:])
    except SystemExit as e:
        rc = e.code
    assert rc == 0, f"exit code {rc} (1: does not fit, 2: usage error):\n{out.getvalue()[-2000:]}"


@cache
def model_config(model: str) -> Any:
    from neuron_opt.checkpoint import open_checkpoint

    return open_checkpoint(model).config  # config only: no weights read


def dry_compile(req: compiler.CompileRequest, log: Any = print, progress: bool = True) -> SimpleNamespace:
    """compile_artifact up to where graphs would be built: checkpoint config, buckets, head layout, backend tp."""
    from neuron_opt.backends import backend_class
    from neuron_opt.parallel import head_layout

    cfg = model_config(req.model)
    compiler.plan_buckets(cfg, req)
    lay = head_layout(cfg, req.parallel)
    backend = backend_class(req.backend)
    backend.check_parallel(req.parallel)  # what compile_artifact checks first
    backend.check_parallel(req.parallel, lay.kv_seq_shards)  # and once the head layout is known
    return SimpleNamespace(hits=[], misses={}, seconds=0.0)


def check_compile(cmd: DocCommand, argv: list[str]) -> None:
    args = parse_cli(argv)
    with mock.patch.object(compiler, "compile_artifact", dry_compile), contextlib.redirect_stdout(io.StringIO()):
        assert args.func(args) == 0  # the real `compile` command: flags -> CompileRequest -> dry_compile


def compiled_outs(file: str) -> set[str]:
    """--out of every compile command documented in `file` (synopses' required parts included)."""
    outs = set()
    for c in COMMANDS:
        if c.file == file and c.argv[:2] == ("neuron-opt", "compile") and "--out" in c.argv:
            outs.add(c.argv[c.argv.index("--out") + 1])
    return outs


def check_artifact_command(cmd: DocCommand, argv: list[str]) -> None:
    args = parse_cli(argv)
    if getattr(args, "artifact", None) and not is_synopsis(cmd.argv):
        assert str(args.artifact) in compiled_outs(cmd.file), (
            f"artifact {args.artifact} is made by no `neuron-opt compile --out` documented in {cmd.file}")


def check_make(cmd: DocCommand, argv: list[str]) -> None:
    assert len(argv) == 2, "one make target per command"
    r = subprocess.run(["make", "-n", argv[1]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"make -n {argv[1]}: {r.stderr.strip()}"


# Runs a script up to its own argparse parse, then exits: checks that --help works, parses the documented args
# strictly (unknown flags, bad values, missing required ones fail) and prints the option strings. Nothing runs.
_SCRIPT_STUB = r"""
import argparse, contextlib, io, json, os, runpy, sys
script, argv = sys.argv[1], json.loads(sys.argv[2])
real = argparse.ArgumentParser.parse_known_args
def intercept(self, args=None, namespace=None):
    argparse.ArgumentParser.parse_known_args = real  # only the script's own (first) parser is intercepted
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            real(self, ["--help"])
    except SystemExit as e:
        if e.code not in (0, None):
            sys.exit(f"--help exited {e.code}")
    if argv is not None:
        _, extras = real(self, argv, namespace)
        if extras:
            self.error("unrecognized arguments: " + " ".join(extras))
    print("OPTIONS " + json.dumps(sorted(s for a in self._actions for s in a.option_strings)))
    sys.exit(0)
argparse.ArgumentParser.parse_known_args = intercept
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
sys.argv = [script, *(argv or [])]
runpy.run_path(script, run_name="__main__")
sys.exit("finished without parsing its arguments with argparse")
"""


@cache
def script_options(script: str, argv: tuple[str, ...] | None) -> frozenset[str]:
    """The script's option strings; `argv` (None: none) parsed by its own parser on the way."""
    assert (ROOT / script).is_file(), f"{script} does not exist"
    r = subprocess.run([sys.executable, "-c", _SCRIPT_STUB, script, json.dumps(argv)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("OPTIONS ")]
    assert r.returncode == 0 and lines, f"{script} rejects it: {r.stderr.strip()[-2000:]}"
    return frozenset(json.loads(lines[-1].removeprefix("OPTIONS ")))


def check_script(cmd: DocCommand, argv: list[str]) -> None:
    script_options(argv[1], tuple(argv[2:]))


# guidellm switches the importing process's event loop policy (tests/neuron_opt/test_server_clients.py), so its
# own click parser runs in a subprocess: make_context parses and converts every option without running anything.
_CLICK_STUB = r"""
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
import click
module, attr, argv = json.loads(sys.argv[1])
cli = getattr(importlib.import_module(module), attr)
ctx = click.Context(cli)
cmd = cli.get_command(ctx, argv[0])
if cmd is None:
    sys.exit(f"{module} has no command {argv[0]!r}")
try:
    cmd.make_context(argv[0], argv[1:], parent=ctx)
except click.ClickException as e:
    sys.exit(e.format_message())
"""


def check_click(cmd: DocCommand, argv: list[str], package: str, cli: str, extra: str) -> None:
    """`argv[1:]` through the click group `cli` ("module:attribute") of `package`, skipped without the extra."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{cmd.where}: {package} is not installed (pip install -e .[{extra}]); its parser checks this")
    r = subprocess.run([sys.executable, "-c", _CLICK_STUB, json.dumps([*cli.split(":"), argv[1:]])], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{package}'s parser rejects it: {r.stderr.strip()[-2000:]}"


def check_guidellm(cmd: DocCommand, argv: list[str]) -> None:
    check_click(cmd, argv, "guidellm", "guidellm.__main__:cli", "clients")


def check_ray(cmd: DocCommand, argv: list[str]) -> None:  # Ray's import is slow, and it too stays out of here
    check_click(cmd, argv, "ray", "ray.scripts.scripts:cli", "cluster")


@dataclass(frozen=True)
class Check:
    pattern: str  # re.match against the command's argv joined by spaces
    how: str
    run: Callable[[DocCommand, list[str]], None]


CHECKS = (
    Check(r"neuron-opt plan\b", "run for real through neuron_opt.cli.main (config only, < 1 s); must exit 0",
          check_plan),
    Check(r"neuron-opt compile\b", "the CLI parser, then the real `compile` command with compile_artifact "
          "replaced by a dry run: checkpoint config, bucket plan, head layout, backend tp (Backend.check_parallel)",
          check_compile),
    Check(r"neuron-opt (inspect|generate|serve|run-batch)\b", "the CLI parser; an artifact argument must be the "
          "--out of a compile documented in the same file", check_artifact_command),
    Check(r"make [\w-]+$", "the target exists: make -n TARGET (a dry run)", check_make),
    Check(r"python scripts/\w+\.py\b", "the script exists, its --help runs and its own argparse parser accepts "
          "the args (nothing runs)", check_script),
    Check(r"guidellm run\b", "guidellm's own click parser accepts it (the `clients` extra)", check_guidellm),
    Check(r"ray (start|status|get-auth-token)\b", "Ray's own click parser accepts it (the `cluster` extra)",
          check_ray),
)


def check_for(argv: tuple[str, ...]) -> list[Check]:
    return [c for c in CHECKS if re.match(c.pattern, " ".join(argv))]


# ---------------------------------------------------------------------------------------------- tests

COMMANDS = doc_commands()


def test_commands_are_found() -> None:
    assert len(COMMANDS) >= 15 and any(c.argv[:2] == ("neuron-opt", "compile") for c in COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_doc_command(cmd: DocCommand) -> None:
    rows = check_for(cmd.argv)
    assert len(rows) == 1, (f"{cmd.where}: `{cmd.text}` matches {len(rows)} CHECKS rows; add exactly one row "
                            "saying how this command is checked")
    for argv in expand(cmd.argv):
        try:
            rows[0].run(cmd, argv)
        except Exception as e:  # pytest.skip is a BaseException and passes through
            pytest.fail(f"{cmd.where}: `{shlex.join(argv)}`\n  from `{cmd.text}`\n  check: {rows[0].how}\n"
                        f"  {type(e).__name__}: {e}", pytrace=False)


def test_every_check_row_is_used() -> None:
    unused = [c.pattern for c in CHECKS if not any(re.match(c.pattern, " ".join(d.argv)) for d in COMMANDS)]
    assert not unused, f"CHECKS rows no documented command uses (remove them): {unused}"


def test_unlabelled_blocks_hold_no_commands() -> None:
    hidden = []
    for path in DOCS:
        for lang, first, lines in fenced_blocks(path):
            if lang in SHELL_LANGS or lang == "python":
                continue
            rel = str(path.relative_to(ROOT))
            for lineno, text in logical_lines(first, lines):
                argv = normalize(text.split())
                if argv and check_for(argv):
                    hidden.append(f"{rel}:{lineno}: {text}")
    assert not hidden, "commands in fenced blocks not labelled bash (so unchecked):\n" + "\n".join(hidden)


def inline_mentions() -> list[tuple[str, list[str]]]:
    out = []
    for path in DOCS:
        lines = path.read_text().split("\n")
        for _, first, body in fenced_blocks(path):  # blank fenced blocks, fences included, keeping line numbers
            lines[first - 2:first + len(body)] = [""] * (len(body) + 2)
        text = "\n".join(lines)
        for m in re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", text):  # a span may wrap onto a second line
            tokens = normalize(m.group(1).split())
            if tokens[:1] == ("neuron-opt",) or re.match(r"(make [\w-]+$|python scripts/)", " ".join(tokens)):
                lineno = text.count("\n", 0, m.start()) + 1
                out.append((f"{path.relative_to(ROOT)}:{lineno}", list(tokens)))
    return out


MENTIONS = inline_mentions()


@pytest.mark.parametrize("where,tokens", MENTIONS, ids=[w for w, _ in MENTIONS])
def test_inline_mention(where: str, tokens: list[str]) -> None:
    flags = {re.sub(r"[\[\]]", "", t).split("=")[0] for t in tokens if re.match(r"\[?--[\w-]", t)}
    if tokens[0] == "neuron-opt":
        parsers = subcommand_parsers()
        sub = tokens[1] if len(tokens) > 1 else None  # `neuron-opt` alone names the program
        assert sub is None or sub in parsers, f"{where}: no subcommand {sub!r}"
        known = {s for a in parsers[sub]._actions for s in a.option_strings} if sub else set()
    elif tokens[0] == "make":
        check_make(DocCommand(where, " ".join(tokens), tuple(tokens)), tokens)
        known = set()
    else:
        known = set(script_options(tokens[1], None))
    assert flags <= known, f"{where}: `{' '.join(tokens)}` names flags that do not exist: {sorted(flags - known)}"
