"""The documentation: references generated from the code and kept equal to it."""

from pathlib import Path

from orchestrator.cli import build_parser, reference
from orchestrator.config import documented_keys

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_references_are_what_the_code_generates():
    for path, content in reference.written_references().items():
        assert path.read_text() == content, f"{path} is stale: run python -m orchestrator.cli.reference"


def test_check_reports_stale_references_and_writing_them_fixes_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reference, "DOCS", tmp_path)
    assert reference.main(["--check"]) == 1
    assert "config-reference.md" in capsys.readouterr().err and not list(tmp_path.iterdir())
    assert reference.main([]) == 0
    assert reference.main(["--check"]) == 0
    (tmp_path / "cli-reference.md").write_text("edited by hand\n")
    assert reference.main(["--check"]) == 1


def test_the_config_reference_has_a_row_for_every_key():
    text = reference.config_reference()
    for key in documented_keys():
        assert f"\n| `{key.name}` | {key.kind} |" in text, key.name


def test_the_cli_reference_has_a_section_for_every_command_and_flag():
    text = reference.cli_reference()
    for words, command, _ in reference._commands(build_parser()):
        assert f"`dpfleet {' '.join(words)}`\n" in text, words
        for action in command._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in text, (words, option)
