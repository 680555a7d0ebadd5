"""gpt2-analyze (python -m service.analysis.cli): the route's report and figure for the texts of a file."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from model.analysis import analyze
from service.analysis.cli import main
from service.analysis.figure import MEAN_GID
from tests.analysis.conftest import TEXTS
from tests.conftest import REPO, TINY


def means(report: dict) -> list[float]:
    return [entry["spectral_norm"]["mean"] for entry in report["layers"]]


@pytest.mark.parametrize("suffix", [".txt", ".json", ".csv"])
def test_cli_writes_the_report_and_figure(tmp_path, tiny_model_dir, tiny_model, tokenizer, suffix, capsys) -> None:
    texts = TEXTS[:3]
    source = tmp_path / f"texts{suffix}"
    if suffix == ".json":
        source.write_text(json.dumps(texts))
    elif suffix == ".csv":
        # The document's input: a CSV with a token_sequence column (quoted: the texts hold commas).
        source.write_text("id,token_sequence\n" + "".join(f'{i},"{t}"\n' for i, t in enumerate(texts)))
    else:
        source.write_text("\n".join(texts) + "\n\n")
    out_json, out_svg = tmp_path / "report.json", tmp_path / "figure.svg"
    main(["--model-dir", str(tiny_model_dir), "--texts", str(source), "--json", str(out_json), "--svg", str(out_svg), "--method", "exact"])
    report = json.loads(out_json.read_text())
    expected = analyze(tiny_model, tokenizer.encode_batch(texts), "exact").to_dict()
    assert report["n_tokens"] == expected["n_tokens"]
    assert means(report) == pytest.approx(means(expected), rel=1e-6)
    assert ET.parse(out_svg).getroot().tag.endswith("svg")
    assert f"{len(texts)} texts" in capsys.readouterr().out


def test_cli_refuses_bad_input_with_a_message(tmp_path, tiny_model_dir) -> None:
    source = tmp_path / "texts.csv"
    source.write_text("sentence\nhello\n")
    with pytest.raises(SystemExit, match="token_sequence"):
        main(["--model-dir", str(tiny_model_dir), "--texts", str(source), "--json", str(tmp_path / "r.json")])
    too_long = tmp_path / "long.txt"
    too_long.write_text("word" + " word" * TINY.n_positions + "\n")
    with pytest.raises(SystemExit, match=r"text\[0\] has"):
        main(["--model-dir", str(tiny_model_dir), "--texts", str(too_long), "--svg", str(tmp_path / "f.svg")])
    short = tmp_path / "short.txt"
    short.write_text("hello\n")
    with pytest.raises(SystemExit, match=r"layers \[9\] do not exist"):
        main(["--model-dir", str(tiny_model_dir), "--texts", str(short), "--json", str(tmp_path / "r.json"), "--layers", "0,9"])
    with pytest.raises(SystemExit, match="none.txt"):
        main(["--model-dir", str(tiny_model_dir), "--texts", str(tmp_path / "none.txt"), "--json", str(tmp_path / "r.json")])


def test_module_entry_point_runs(tmp_path, tiny_model_dir) -> None:
    source = tmp_path / "texts.txt"
    source.write_text("Hello there\n")
    result = subprocess.run(
        [sys.executable, "-m", "service.analysis.cli", "--model-dir", str(tiny_model_dir), "--texts", str(source),
         "--json", str(tmp_path / "r.json"), "--layers", "0,2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert [entry["layer"] for entry in json.loads((tmp_path / "r.json").read_text())["layers"]] == [0, 2]


def test_two_model_dirs_are_measured_and_drawn_on_one_plot(tmp_path, tiny_model_dir, tiny_post_ln_dir, tiny_post_ln_model, tokenizer, capsys) -> None:
    source = tmp_path / "texts.txt"
    source.write_text("\n".join(TEXTS[:2]) + "\n")
    out_json, out_svg = tmp_path / "both.json", tmp_path / "both.svg"
    main(["--model-dir", str(tiny_model_dir), "--model-dir", str(tiny_post_ln_dir), "--name", "pre", "--name", "post",
          "--texts", str(source), "--json", str(out_json), "--svg", str(out_svg), "--method", "exact"])
    report = json.loads(out_json.read_text())
    [other] = report["compare"]
    assert (report["model"]["name"], other["model"]["name"]) == ("pre", "post")
    assert other["model"]["architecture"] == "post-ln"
    expected = analyze(tiny_post_ln_model, tokenizer.encode_batch(TEXTS[:2]), "exact").to_dict()
    assert means(other) == pytest.approx(means(expected), rel=1e-6)
    ids = {g.get("id") for g in ET.parse(out_svg).getroot().iter("{http://www.w3.org/2000/svg}g")}
    assert {MEAN_GID, f"{MEAN_GID}-1"} <= ids
    printed = capsys.readouterr().out
    assert "pre: 2 texts" in printed and "post: 2 texts" in printed
    with pytest.raises(SystemExit):
        main(["--model-dir", str(tiny_model_dir), "--model-dir", str(tiny_post_ln_dir), "--name", "only-one",
              "--texts", str(source), "--json", str(out_json)])


def test_cli_imports_neither_the_http_routes_nor_matplotlib() -> None:
    code = (
        "import sys, service.analysis.cli; "
        "bad = [m for m in ('service.analysis.routes', 'fastapi', 'matplotlib') if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_cli_says_when_matplotlib_is_missing(tmp_path, tiny_model_dir, monkeypatch) -> None:
    source = tmp_path / "texts.txt"
    source.write_text("hello\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match="matplotlib"):
        main(["--model-dir", str(tiny_model_dir), "--texts", str(source), "--svg", str(tmp_path / "f.svg")])
