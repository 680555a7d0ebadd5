"""gpt2-analyze --model-dir DIR [--model-dir DIR2 ...] [--lora NAME=DIR ...] --texts FILE --json OUT --svg OUT

Runs /analyze/spectrum's analysis without a server: the same JSON report and SVG figure for the
texts of a file. Several --model-dir (GPT-2 and Post-LN GPT-1 folders) are measured on the same
texts and drawn on one plot, the document's Pre-LN against Post-LN figure; each --lora adds the
first model with that LoRA adapter applied, a fine-tune beside its base. FILE is a JSON list
of strings, a CSV with a `token_sequence` column (the source document's input), or plain text
with one text per non-empty line.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from model.lora import LoraSet
from model.spectral import METHODS
from service.analysis.figure import FigureUnavailable, check_available, render_svg
from service.analysis.report import Subject, check_request, combined, encode, load_subject, reports
from model.config import DTYPES
from weights.checkpoint import CheckpointError

CSV_COLUMN = "token_sequence"
DEFAULT_MODEL_DIR = Path("weights/gpt2")


def read_texts(path: Path) -> list[str]:
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        texts = json.loads(raw)
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{path}: expected a JSON list of strings")
        return texts
    if path.suffix == ".csv":
        rows = list(csv.DictReader(raw.splitlines()))
        if rows and CSV_COLUMN not in rows[0]:
            raise ValueError(f"{path}: no {CSV_COLUMN!r} column (columns: {', '.join(rows[0])})")
        return [row[CSV_COLUMN] for row in rows]
    return [line for line in raw.splitlines() if line.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpt2-analyze", description=__doc__.split("\n\n")[1])
    parser.add_argument(
        "--model-dir", type=Path, action="append", help="a model folder; repeat to compare models (default weights/gpt2)"
    )
    parser.add_argument("--texts", type=Path, required=True, help=".json list, .csv with token_sequence, or lines")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--svg", type=Path, help="write the figure here")
    parser.add_argument("--method", choices=METHODS, default="fast")
    parser.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], help="e.g. 0,5,11; default all")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--name", action="append", help="model name in the report, one per --model-dir; default the folder's name")
    parser.add_argument(
        "--lora", action="append", default=[], metavar="NAME=DIR",
        help="also the first model with this peft LoRA adapter applied; repeat for several",
    )
    args = parser.parse_args(argv)
    args.model_dir = args.model_dir or [DEFAULT_MODEL_DIR]
    if args.json is None and args.svg is None:
        parser.error("give --json and/or --svg")
    if args.name and len(args.name) != len(args.model_dir):
        parser.error(f"{len(args.name)} --name for {len(args.model_dir)} --model-dir; give one per model or none")
    bad = [item for item in args.lora if not all(part.strip() for part in item.partition("=")[::2])]
    if bad:
        parser.error(f"--lora {bad[0]!r}: expected NAME=DIR")
    args.lora = [tuple(part.strip() for part in item.partition("=")[::2]) for item in args.lora]
    return args


def with_adapters(base: Subject, adapters: list[tuple[str, str]]) -> list[Subject]:
    """The base model with each adapter applied in turn (AdapterError, a ValueError, if refused)."""
    resident = LoraSet(base.model)
    for name, folder in adapters:
        resident.load(name, folder)
    return [Subject(base.name, base.model, base.tokenizer, resident.applied(name)) for name, _ in adapters]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    names = args.name or [None] * len(args.model_dir)
    try:
        if args.svg is not None:
            check_available()
        texts = read_texts(args.texts)
        subjects = [
            load_subject(path, device=args.device, dtype=DTYPES[args.dtype], name=name)
            for path, name in zip(args.model_dir, names)
        ]
        subjects += with_adapters(subjects[0], args.lora)
        token_ids = encode(subjects, texts, None)
        check_request(subjects, token_ids, args.layers)
    except (OSError, ValueError, CheckpointError, FigureUnavailable) as exc:
        sys.exit(f"error: {exc}")
    measured = reports(subjects, token_ids, args.method, args.layers)
    if args.json is not None:
        args.json.write_text(json.dumps(combined(measured), indent=1) + "\n")
    if args.svg is not None:
        args.svg.write_text(render_svg(measured))
    for report in measured:
        means = ", ".join(f"{entry['spectral_norm']['mean']:.4f}" for entry in report["layers"])
        adapter = f" + {report['model']['adapter']}" if report["model"]["adapter"] else ""
        print(f"{report['model']['name']}{adapter}: {len(texts)} texts, mean spectral norm per layer: {means}")


if __name__ == "__main__":
    main()
