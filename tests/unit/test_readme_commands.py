"""tools/readme_commands.py: how CI finds the README's two commands (the marker: the
first two ```bash blocks under ``## Two commands``, one line each) and refuses a README
that breaks the marker instead of running something else."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.readme_commands import HEADING, Command, MarkerError, command, main, readme_commands

README = Path(__file__).resolve().parents[2] / "README.md"
DEMO = "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && kvshm demo"
TEST = "pip install -e '.[test]' && python -m pytest -q"


def doc(*blocks: str, before: str = "# kvshm\n\nintro\n\n", after: str = "") -> str:
    return before + HEADING + "\n\n" + "\n\n".join(blocks) + "\n" + after


def bash(body: str) -> str:
    return f"```bash\n{body}\n```"


def test_the_repository_readme_holds_both_commands() -> None:
    got = readme_commands(README.read_text())
    assert "kvshm demo" in got[Command.DEMO]
    assert "pytest" in got[Command.TEST]


def test_other_fences_and_comment_lines_inside_blocks_are_skipped() -> None:
    text = doc("```text\n## not a heading\n```", bash(DEMO), "```console\n$ x\n```",
               bash(TEST), after="\n## Next\n\n" + bash("echo later"))
    assert readme_commands(text) == {Command.DEMO: DEMO, Command.TEST: TEST}


def test_quick_appends_to_kvshm_demo_only_in_the_demo_command() -> None:
    text = doc(bash(DEMO), bash(TEST))
    assert command(text, Command.DEMO, quick=True) == DEMO + " --quick"
    assert command(text, Command.TEST, quick=True) == TEST
    assert command(text, Command.DEMO) == DEMO


@pytest.mark.parametrize(("text", "problem"), [
    ("# kvshm\n\n" + bash(DEMO) + "\n" + bash(TEST), "no heading"),
    (doc(bash(DEMO)), "1 ```bash block"),
    (doc(bash(DEMO), after="\n## Next\n\n" + bash(TEST)), "1 ```bash block"),
    (doc(bash(DEMO + "\necho two"), bash(TEST)), "holds 2 lines"),
    (doc(bash("pip install -e ."), bash(TEST)), "does not contain 'kvshm demo'"),
    (doc(bash(DEMO), bash("pip install -e ."),), "does not contain 'pytest'"),
    (doc(bash(DEMO), "```bash\n" + TEST), "unclosed"),
])
def test_a_broken_marker_is_an_error_naming_what_is_missing(text: str, problem: str) -> None:
    with pytest.raises(MarkerError, match=problem):
        readme_commands(text)


def test_cli_prints_the_line_or_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text(doc(bash(DEMO), bash(TEST)))
    bad.write_text("# nothing\n")
    assert main(["demo", "--quick", "--readme", str(good)]) == 0
    assert capsys.readouterr().out == DEMO + " --quick\n"
    assert main(["test", "--readme", str(bad)]) == 2
    assert "no heading '## Two commands'" in capsys.readouterr().err
