"""The document's figure for one /analyze/spectrum report, as SVG (matplotlib, no display).

Layer on x; the mean spectral norm over texts and heads with its min–max band; the valid bounds
(lower = 1, colsum, prenorm, trivial √n when it fits the scale) as lines.
"""

from __future__ import annotations

import io

from matplotlib import rc_context
from matplotlib.figure import Figure

SVG_MEDIA_TYPE = "image/svg+xml"
# The SVG group (gid) of the mean curve: one marker per layer, which tests count.
MEAN_GID = "spectral-norm-mean"
# Bounds further above the measurements than this factor would flatten the curve; they are
# named in the caption instead of drawn.
MAX_SCALE_FACTOR = 4.0


def render_svg(report: dict) -> str:
    layers = [entry["layer"] for entry in report["layers"]]
    norms = [entry["spectral_norm"] for entry in report["layers"]]
    bounds = [entry["bounds"] for entry in report["layers"]]
    top = max(n["max"] for n in norms)

    # Figure directly, not pyplot: no global state, safe in worker threads.
    figure = Figure(figsize=(7.5, 4.8), layout="constrained")
    axes = figure.add_subplot()
    lows, highs, means = ([n[key] for n in norms] for key in ("min", "max", "mean"))
    axes.fill_between(layers, lows, highs, alpha=0.25, label="min–max over texts and heads")
    (mean_line,) = axes.plot(layers, means, marker="o", label="mean ‖A‖₂ (the document's figure)")
    mean_line.set_gid(MEAN_GID)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle=":", label="lower bound 1")
    off_scale = []
    for name, style, label in (
        ("colsum", "--", "colsum bound √(max column sum), mean"),
        ("prenorm", "-.", "weight-only prenorm bound, mean"),
        ("trivial", (0, (1, 3)), "trivial bound √n, mean"),
    ):
        values = [b[name]["mean"] for b in bounds]
        if max(values) > MAX_SCALE_FACTOR * top:
            off_scale.append(f"{name} ≈ {max(values):.3g}")
            continue
        axes.plot(layers, values, linestyle=style, linewidth=1.2, label=label)

    axes.set_xlabel("layer")
    axes.set_ylabel("spectral norm of attention ‖A‖₂")
    axes.set_xticks(layers)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    model = report.get("model", {})
    lengths = report["n_tokens"]
    axes.set_title(
        f"{model.get('name', 'GPT-2')}: attention spectral norm per layer\n"
        f"{report['n_sequences']} text(s), {min(lengths)}–{max(lengths)} tokens, method {report['method']}",
        fontsize=10,
    )
    if off_scale:
        figure.text(0.01, 0.005, "off scale: " + ", ".join(off_scale), fontsize=7)

    out = io.StringIO()
    # Text as <text> elements (searchable, selectable), and no timestamp: same report, same bytes.
    with rc_context({"svg.fonttype": "none"}):
        figure.savefig(out, format="svg", metadata={"Date": None})
    return out.getvalue()
