"""The documentation: generated references equal to the code, a short README, no development history, live links."""

import re
import subprocess
import sys
from pathlib import Path

import markdown
import pytest
from mkdocs.config import load_config

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


README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# Words about how the project was developed, which mean nothing to a user.
HISTORY = re.compile(
    r"\b(sessions?|this run|(earlier|previous|prior|last) (runs?|attempts?|versions?)|no longer|used to|"
    r"originally|at first|(first|second|third|fourth|fifth) (attempt|try))\b",
    re.IGNORECASE,
)


def github_slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, each space a hyphen (``a = b``: ``a--b``)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def github_anchors(path: Path) -> set[str]:
    """The anchors of a page as GitHub renders it (the READMEs are read there)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {github_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def site_markdown() -> markdown.Markdown:
    """The Markdown converter `mkdocs build` renders the site's pages with: mkdocs.yml's extensions and settings."""
    config = load_config(str(ROOT / "mkdocs.yml"))
    return markdown.Markdown(extensions=config.markdown_extensions, extension_configs=config.mdx_configs)


def anchors(path: Path) -> set[str]:
    """The anchors of a page of the site, as MkDocs names them (its toc extension: ``a = b`` is ``a-b``)."""
    converter = site_markdown()
    converter.convert(path.read_text())
    found, tokens = set(), list(converter.toc_tokens)
    while tokens:
        token = tokens.pop()
        found.add(token["id"])
        tokens.extend(token["children"])
    return found


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_the_quick_start_begins_by_setting_up_and_activating_the_venv():
    quick_start = README.read_text().split("**Quick start**", 1)[1]
    assert re.findall(r"`([^`]+)`", quick_start)[:2] == ["make setup", "source .venv/bin/activate"]


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.parametrize("path", [README, ROOT / "deploy" / "README.md", *PAGES], ids=lambda path: path.name)
def test_no_word_of_development_history(path):
    found = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert found == []


def test_the_history_pattern_catches_what_it_is_for():
    for phrase in ("in the third session", "this run measured", "earlier runs gave", "a status no longer walks"):
        assert HISTORY.search(phrase), phrase
    for phrase in ("on first use", "epsilon so far", "the run's summary", "one run each"):
        assert not HISTORY.search(phrase), phrase


@pytest.mark.parametrize("page, headings", [
    ("training.md", ["how-a-step-runs", "the-layer-rules", "configs", "data", "tasks",
                     "shards-data-that-stays-on-its-nodes", "faults"]),
    ("privacy.md", ["accountants-which-numbers-are-rigorous", "microbatches", "adaptive-clipping", "noise-schedules",
                    "per-layer-clipping", "secure-noise", "threat-model-who-sees-what"]),
    ("ledger.md", ["admission-a-privacy-filter", "the-theorem", "guarantees", "service", "dpfleet-ledger",
                   "training-against-the-ledger"]),
    ("auditing.md", ["how-to-read-an-audit"]),
    ("cluster.md", ["dpfleet-submit-any-running-ray-cluster", "the-tokens", "the-ledger-service-kubernetes",
                    "ray-up-the-cluster-launcher-aws", "kuberay-a-rayjob", "one-node-per-silo"]),
    ("benchmarks.md", ["the-main-job", "speed", "ledger"]),
])
def test_each_page_has_its_sections(page, headings):
    assert set(headings) <= anchors(DOCS / page)


def test_every_benchmark_has_its_command_in_the_benchmarks_page():
    from bench.__main__ import BENCHMARKS

    text = (DOCS / "benchmarks.md").read_text()
    for name in BENCHMARKS:
        assert f"python -m bench.{name}" in text, name


@pytest.mark.parametrize("path", [README, ROOT / "deploy" / "README.md", *PAGES], ids=lambda path: path.name)
def test_local_links_and_their_anchors_resolve(path):
    """Each anchor by the rule of the site that shows the linking page: MkDocs' for docs/, GitHub's for a README."""
    anchors_of = anchors if path.parent == DOCS else github_anchors
    for target in links(path):
        if re.match(r"[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        assert linked.exists(), target
        if anchor:
            assert anchor in anchors_of(linked), target


def test_anchors_are_named_by_each_site_s_rule():
    heading = 'Dropped rows under `check_data = "lenient"`'
    assert github_slug(heading) == "dropped-rows-under-check_data--lenient"
    assert "dropped-rows-under-check_data-lenient" in anchors(DOCS / "privacy.md")
    assert "dropped-rows-under-check_data--lenient" not in anchors(DOCS / "privacy.md")


def test_the_site_lists_every_page_and_builds_strictly(tmp_path):
    nav = (ROOT / "mkdocs.yml").read_text()
    assert {page.name for page in PAGES} == set(re.findall(r"([\w-]+\.md)", nav))
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
