"""The document's figure for /analyze/spectrum reports, as SVG (matplotlib, no display).

Layer on x; per model, the mean spectral norm over texts and heads with its min–max band. One
model: its valid bounds (lower = 1, colsum, prenorm, trivial √n when it fits the scale) as
lines. Several (the document's Pre-LN against Post-LN figure): every model's curve and its
colsum bound in the same colour. matplotlib is imported here, on the first figure asked for:
the service and the JSON reports do not need it.
"""

from __future__ import annotations

import importlib.util
import io

SVG_MEDIA_TYPE = "image/svg+xml"
# The SVG group (gid) of the first model's mean curve (one marker per layer, which tests count);
# further models' curves are MEAN_GID-1, MEAN_GID-2, ...
MEAN_GID = "spectral-norm-mean"
# Bounds further above the measurements than this factor would flatten the curve; they are
# named in the caption instead of drawn.
MAX_SCALE_FACTOR = 4.0
MISSING = "the SVG figure needs matplotlib, which is not installed here (pip install matplotlib); JSON needs nothing more"


class FigureUnavailable(RuntimeError):
    """matplotlib is not installed."""


def check_available() -> None:
    """Raise FigureUnavailable before any work is done for a figure that cannot be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        raise FigureUnavailable(MISSING)


def render_svg(reports: dict | list[dict]) -> str:
    """The figure of one report, or of several models' reports on one plot."""
    check_available()
    from matplotlib import rc_context
    from matplotlib.figure import Figure

    reports = [reports] if isinstance(reports, dict) else reports
    # Figure directly, not pyplot: no global state, safe in worker threads.
    figure = Figure(figsize=(7.5, 4.8), layout="constrained")
    axes = figure.add_subplot()
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle=":", label="lower bound 1")
    off_scale = []
    for index, report in enumerate(reports):
        off_scale += _draw_model(axes, report, index, alone=len(reports) == 1)

    first = reports[0]
    axes.set_xlabel("layer")
    axes.set_ylabel("spectral norm of attention ‖A‖₂")
    axes.set_xticks(sorted({entry["layer"] for r in reports for entry in r["layers"]}))
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    lengths = first["n_tokens"]
    names = " vs ".join(_name(r) for r in reports)
    axes.set_title(
        f"{names}: attention spectral norm per layer\n"
        f"{first['n_sequences']} text(s), {min(lengths)}–{max(lengths)} tokens, method {first['method']}",
        fontsize=10,
    )
    if off_scale:
        figure.text(0.01, 0.005, "off scale: " + ", ".join(off_scale), fontsize=7)

    out = io.StringIO()
    # Text as <text> elements (searchable, selectable), and no timestamp: same report, same bytes.
    with rc_context({"svg.fonttype": "none"}):
        figure.savefig(out, format="svg", metadata={"Date": None})
    return out.getvalue()


def _draw_model(axes, report: dict, index: int, alone: bool) -> list[str]:
    """One model's curve, band and bounds; returns the bounds left off the scale."""
    layers = [entry["layer"] for entry in report["layers"]]
    norms = [entry["spectral_norm"] for entry in report["layers"]]
    bounds = [entry["bounds"] for entry in report["layers"]]
    top = max(n["max"] for n in norms)
    lows, highs, means = ([n[key] for n in norms] for key in ("min", "max", "mean"))
    colour = f"C{index}"
    name = "" if alone else f"{_name(report)}: "
    axes.fill_between(layers, lows, highs, alpha=0.2, color=colour, label=f"{name}min–max over texts and heads")
    (mean_line,) = axes.plot(
        layers, means, marker="o", color=colour, label=f"{name}mean ‖A‖₂ (the document's figure)"
    )
    mean_line.set_gid(MEAN_GID if index == 0 else f"{MEAN_GID}-{index}")
    drawn = (
        (("colsum", "--", "colsum bound √(max column sum), mean"),)
        if not alone
        else (
            ("colsum", "--", "colsum bound √(max column sum), mean"),
            ("prenorm", "-.", "weight-only prenorm bound, mean"),
            ("trivial", (0, (1, 3)), "trivial bound √n, mean"),
        )
    )
    off_scale = []
    for bound, style, label in drawn:
        values = [b[bound]["mean"] for b in bounds]
        if max(values) > MAX_SCALE_FACTOR * top:
            off_scale.append(f"{name}{bound} ≈ {max(values):.3g}")
            continue
        axes.plot(layers, values, linestyle=style, linewidth=1.2, color=None if alone else colour, label=name + label)
    return off_scale


def _name(report: dict) -> str:
    model = report.get("model", {})
    adapter = model.get("adapter")
    return model.get("name", "GPT-2") + (f" + {adapter}" if adapter else "")


def heatmaps_svg(maps, layers: list[int], tokens: list[str]) -> str:
    """/analyze/attention's figure: one heatmap per (layer, head), query down, key across."""
    check_available()
    from matplotlib.figure import Figure

    n_layers, n_heads = maps.shape[:2]
    figure = Figure(figsize=(1.6 * n_heads + 1, 1.6 * n_layers + 0.5), layout="constrained")
    grid = figure.subplots(n_layers, n_heads, squeeze=False)
    for i, layer in enumerate(layers):
        for head in range(n_heads):
            axes = grid[i][head]
            image = axes.imshow(maps[i, head].numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
            axes.set_xticks([])
            axes.set_yticks([])
            axes.set_title(f"L{layer} H{head}", fontsize=7)
    figure.colorbar(image, ax=grid, shrink=0.6, label="attention probability")
    figure.suptitle(f"attention over {len(tokens)} tokens")
    out = io.StringIO()
    figure.savefig(out, format="svg")
    return out.getvalue()
