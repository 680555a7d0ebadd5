"""python -m service.analyze_cli --model-dir DIR --texts FILE --json OUT --svg OUT

Runs /analyze/spectrum's analysis without a server: the same JSON report and SVG figure for the
texts of a file. FILE is a JSON list of strings, a CSV with a `token_sequence` column (the
source document's input), or plain text with one text per non-empty line.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from model.analysis import check_inputs
from model.spectral import METHODS
from service.analysis_figure import render_svg
from service.analysis_routes import report_dict
from service.settings import DTYPES
from weights.checkpoint import CheckpointError, load_model
from weights.tokenizer import GPT2Tokenizer

CSV_COLUMN = "token_sequence"


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
    parser = argparse.ArgumentParser(prog="python -m service.analyze_cli", description=__doc__.split("\n\n")[1])
    parser.add_argument("--model-dir", type=Path, default=Path("weights/gpt2"))
    parser.add_argument("--texts", type=Path, required=True, help=".json list, .csv with token_sequence, or lines")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--svg", type=Path, help="write the figure here")
    parser.add_argument("--method", choices=METHODS, default="fast")
    parser.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], help="e.g. 0,5,11; default all")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--name", default=None, help="model name in the report; default the folder's name")
    args = parser.parse_args(argv)
    if args.json is None and args.svg is None:
        parser.error("give --json and/or --svg")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        texts = read_texts(args.texts)
        model = load_model(args.model_dir, device=args.device, dtype=DTYPES[args.dtype])
        tokenizer = GPT2Tokenizer.from_dir(args.model_dir)
    except (OSError, ValueError, CheckpointError) as exc:
        sys.exit(f"error: {exc}")
    token_ids = tokenizer.encode_batch(texts)
    try:
        check_inputs(model.config, token_ids, args.layers)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    report = report_dict(model, args.name or args.model_dir.resolve().name, token_ids, args.method, args.layers)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.svg is not None:
        args.svg.write_text(render_svg(report))
    means = ", ".join(f"{entry['spectral_norm']['mean']:.4f}" for entry in report["layers"])
    print(f"{len(texts)} texts, mean spectral norm per layer: {means}")


if __name__ == "__main__":
    main()
