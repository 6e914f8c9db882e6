"""README.md and docs/*.md against the code they describe (issue 28, point 7).

* Every command shown -- a line of a fenced shell block, or an inline code span -- that
  runs ``kvshm``, ``kvshm-workers`` or ``python -m`` one of kvshm's modules or tools names
  a subcommand that exists and only ``--flags`` its ``--help`` lists. All the ``--help``
  texts come from one child process (``runpy``, one import of torch and vLLM), so the
  check takes seconds; a tool whose optional third-party import is missing here is left
  out, not failed.
* ``bash tools/X.sh`` / ``python examples/X.py`` name files that exist, and a script's
  flags appear in it; a ``--kv-transfer-config`` JSON names kvshm's connector and only
  extra keys the connector knows.
* Every relative link resolves to a file, and to a heading of it when it names one;
  every repository path in backquotes exists.
* The README stays the front door: at most 220 lines, and no test-time claims (a claim
  nothing measures goes stale: it said "about 420 tests in 36 s" of a 541-test,
  47-100 s suite).
* The README's asyncio example runs as printed (slow: it spawns two workers).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
#: Files the docs name that another branch of the same issue adds; remove each entry
#: once its file is in the tree.
PENDING_PATHS: set[str] = set()
SEPARATORS = {"&&", "||", ";", "|", "&", ";;"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`]+)`")
REPO_PATH = re.compile(r"(?:kvshm|workers|tools|examples|tests|docs|\.ci)/[\w./-]*")
ENV_ASSIGN = re.compile(r"[A-Za-z_]\w*=")
TIME_CLAIM = re.compile(r"\b\d+(?:\.\d+)?\s*(?:s|sec|seconds?|min|minutes?)\b")

# One child process prints {key: {"rc", "out", "missing"}} for each (module, argv).
_HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys
jobs = json.loads(sys.argv[1])
out = {}
for key, (module, argv) in jobs.items():
    buf = io.StringIO()
    sys.argv = [module, *argv]
    rc, missing = 0, None
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except ModuleNotFoundError as e:
        rc, missing = 1, e.name
    except BaseException as e:  # noqa: BLE001 - reported, the test fails on it
        rc = 1
        buf.write(repr(e))
    out[key] = {"rc": rc, "out": buf.getvalue(), "missing": missing}
sys.stdout = sys.__stdout__
print("\n" + json.dumps(out))
"""


@dataclass(frozen=True)
class Command:
    """One simple command from the docs: where it was shown and its words."""

    where: str
    words: tuple[str, ...]


@dataclass
class Usage:
    """The flags the docs use with one ``--help`` (a module and its subcommand)."""

    module: str
    argv: tuple[str, ...]
    flags: dict[str, list[str]] = field(default_factory=dict)  # flag -> where shown
    where: list[str] = field(default_factory=list)


def _strip_fences(text: str) -> str:
    return FENCE.sub("", text)


def _shell_blocks(text: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in SHELL_LANGS]


def _words(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote in prose: plain words are enough
        return line.split()


def _simple_commands(line: str, where: str) -> list[Command]:
    """The simple commands of one shell line, leading ``VAR=value`` words dropped."""
    out: list[Command] = []
    current: list[str] = []
    for word in [*_words(line), ";"]:
        if word in SEPARATORS:
            while current and ENV_ASSIGN.match(current[0]):
                current.pop(0)
            if current:
                out.append(Command(where, tuple(current)))
            current = []
        else:
            current.append(word)
    return out


def _commands(path: Path) -> list[Command]:
    """Commands of the fenced shell blocks (continuation lines joined) and the inline
    code spans of the prose that start with one of kvshm's commands."""
    text = path.read_text()
    name = path.relative_to(ROOT).as_posix()
    out: list[Command] = []
    for body in _shell_blocks(text):
        for line in body.replace("\\\n", " ").splitlines():
            out += _simple_commands(line, f"{name}: {line.strip()[:80]}")
    for span in SPAN.findall(_strip_fences(text)):
        span = " ".join(span.split())
        if re.match(r"(kvshm|kvshm-workers|python3? -m) ", span + " "):
            out += [c for c in _simple_commands(span, f"{name}: `{span[:80]}`")
                    if _looks_like_a_command(c)]
    return out


def _looks_like_a_command(cmd: Command) -> bool:
    """An inline span is a command when only the subcommand (``kvshm``'s) stands before
    its flags: ``kvshm stats --name NAME`` is one, a quoted message such as ``kvshm
    needs the CPU tier's size`` is not."""
    w = list(cmd.words)
    head = 3 if w[0].startswith("python") else 1
    words = 1 if w[0] == "kvshm" else 0
    plain = 0
    for word in w[head:]:
        if word.startswith("--"):
            break
        plain += 1
    return plain <= words


def _usage_key(cmd: Command) -> tuple[str, tuple[str, ...], list[str]] | None:
    """(module, help argv, the words that may hold flags), or None when the command is
    not one of kvshm's."""
    w = list(cmd.words)
    if w[0] in ("python", "python3") and len(w) >= 3 and w[1] == "-m":
        module, rest = w[2], w[3:]
        if module in ("kvshm", "kvshm.cli"):
            w = ["kvshm", *rest]
        elif module == "workers" or module.startswith(("tools.", "kvshm.")):
            return module, ("--help",), rest
        else:
            return None
    if w[0] == "kvshm-workers":
        return "workers", ("--help",), w[1:]
    if w[0] == "kvshm":
        if len(w) > 1 and not w[1].startswith("-"):
            return "kvshm.cli", (w[1], "--help"), w[2:]
        return "kvshm.cli", ("--help",), w[1:]
    return None


def _flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]


def _all_commands() -> list[Command]:
    return [c for p in DOCS for c in _commands(p)]


@cache
def _help_texts(jobs: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, dict[str, object]]:
    """Every ``--help`` at once, in one child process (rc, output, a missing module)."""
    payload = {f"{m} {' '.join(a)}": [m, list(a)] for m, a in jobs}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TORCH_COMPILE_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-c", _HELP_RUNNER, json.dumps(payload)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, dict[str, object]] = json.loads(proc.stdout.rsplit("\n", 2)[-2])
    return result


def _own_module(name: str | None) -> bool:
    return bool(name) and str(name).split(".")[0] in ("kvshm", "workers", "tools")


def test_the_docs_show_commands_of_every_kind() -> None:
    """The parser finds what it is meant to check (a parser that finds nothing passes
    every other test here)."""
    usages = {(m, a) for c in _all_commands() if (k := _usage_key(c)) for m, a in [k[:2]]}
    modules = {m for m, _ in usages}
    assert {"kvshm.cli", "workers", "tools.bench_copy", "tools.chaos"} <= modules
    assert ("kvshm.cli", ("janitor", "--help")) in usages
    assert sum(1 for m in modules if m.startswith("tools.")) >= 10


def test_every_command_shown_uses_a_real_subcommand_and_real_flags() -> None:
    usages: dict[tuple[str, tuple[str, ...]], Usage] = {}
    for cmd in _all_commands():
        key = _usage_key(cmd)
        if key is None:
            continue
        module, argv, rest = key
        usage = usages.setdefault((module, argv), Usage(module, argv))
        usage.where.append(cmd.where)
        for flag in _flags(rest):
            usage.flags.setdefault(flag, []).append(cmd.where)
    helps = _help_texts(tuple(sorted(usages)))
    problems: list[str] = []
    for (module, argv), usage in sorted(usages.items()):
        got = helps[f"{module} {' '.join(argv)}"]
        if got["missing"] and not _own_module(str(got["missing"])):
            continue  # an optional package (vLLM) is not installed here
        shown = f"python -m {module} {' '.join(argv)}"
        if got["rc"] != 0:
            problems.append(f"{shown} (shown in {usage.where[0]}): exit {got['rc']}: "
                            f"{str(got['out'])[-300:]}")
            continue
        for flag, where in usage.flags.items():
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", str(got["out"])):
                problems.append(f"{shown} has no {flag} (shown in {where[0]})")
    assert not problems, "\n".join(problems)


def test_scripts_and_examples_shown_exist_and_take_the_flags_shown() -> None:
    problems: list[str] = []
    for cmd in _all_commands():
        w = cmd.words
        if len(w) >= 2 and (w[0] == "bash" or w[0].startswith("python")) \
                and re.fullmatch(r"(tools|examples)/[\w./-]+\.(sh|py)", w[1]):
            script = ROOT / w[1]
            if w[1] in PENDING_PATHS:
                continue
            if not script.is_file():
                problems.append(f"{cmd.where}: {w[1]} does not exist")
                continue
            text = script.read_text()
            problems += [f"{cmd.where}: {w[1]} knows no {f}" for f in _flags(list(w[2:]))
                         if f not in text]
    assert not problems, "\n".join(problems)


def test_every_kv_transfer_config_shown_is_one_the_connector_accepts() -> None:
    from kvshm.integrations.vllm.config import PUBLIC_KEYS

    seen = 0
    for cmd in _all_commands():
        w = list(cmd.words)
        for i, word in enumerate(w[:-1]):
            if word != "--kv-transfer-config":
                continue
            seen += 1
            cfg = json.loads(w[i + 1])
            assert cfg["kv_connector"] == "KvshmConnector", cmd.where
            assert cfg["kv_role"] == "kv_both", cmd.where
            assert cfg.get("kv_connector_module_path",
                           "kvshm.integrations.vllm") == "kvshm.integrations.vllm"
            assert cfg.get("kv_load_failure_policy", "recompute") == "recompute"
            extra = cfg.get("kv_connector_extra_config", {})
            assert set(extra) <= set(PUBLIC_KEYS), (cmd.where, set(extra) - set(PUBLIC_KEYS))
    assert seen >= 2  # the README's one line and docs/vllm.md's


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", _strip_fences(path.read_text()),
                                         re.MULTILINE)}


def test_every_link_and_path_in_the_docs_resolves() -> None:
    problems: list[str] = []
    for path in DOCS:
        text = _strip_fences(path.read_text())
        name = path.relative_to(ROOT).as_posix()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                problems.append(f"{name}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{name}: link to {target}: no such heading")
        for span in SPAN.findall(text):
            span = span.strip()
            if REPO_PATH.fullmatch(span) and span not in PENDING_PATHS \
                    and not (ROOT / span).exists():
                problems.append(f"{name}: `{span}` does not exist")
    assert not problems, "\n".join(problems)


def test_the_readme_is_a_front_door_without_test_time_claims() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 220
    claims = TIME_CLAIM.findall(_strip_fences(text))
    assert not claims, f"README claims times nothing checks: {claims}"
    two = text[text.index("## Two commands"):]
    blocks = re.findall(r"^```bash\n(.*?)^```", two, re.MULTILINE | re.DOTALL)
    assert "kvshm demo" in blocks[0] and "pytest" in blocks[1]  # what .ci/run extracts
    for page in ("vllm", "api", "remote", "pd", "operations", "benchmarks", "design"):
        assert f"](docs/{page}.md)" in text, page


@pytest.mark.slow
def test_the_readme_asyncio_example_runs_as_printed(tmp_path: Path) -> None:
    """The example under "## asyncio API" is a whole script: run it, expect its comment."""
    text = README.read_text()
    section = text[text.index("## asyncio API"):]
    code = re.search(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert code is not None
    script = tmp_path / "readme_example.py"
    script.write_text(code.group(1))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=180, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hit 96 tokens, load ok: True" in proc.stdout
