"""What the app does for the analysis at start-up: load the comparison model, if any, and
compute every analysed model's weight spectra before serving.

The spectra (docs/analysis.md, "Weight spectra") take seconds on CPU for GPT-2 124M. Computed in
a background thread they competed for the cores with the first analysis request after start-up;
computed here, before the server listens, the first request pays nothing for them.
"""

from __future__ import annotations

from fastapi import FastAPI

from model.analysis import cached_weight_spectra
from service.analysis.report import Subject, load_subject
from service.settings import Settings


def prepare_analysis(app: FastAPI, settings: Settings, model) -> None:
    """Load the comparison model (a bad one stops start-up) and the weight spectra of both."""
    compare = None
    if settings.compare_model_dir is not None:
        compare = load_subject(
            settings.compare_model_dir, device=settings.device, dtype=settings.torch_dtype,
            name=settings.compare_model_name,
        )
    app.state.analysis_compare = compare
    for each in (model, compare.model if compare else None):
        if each is not None:
            cached_weight_spectra(each)


def compare_subject(app: FastAPI) -> Subject | None:
    return getattr(app.state, "analysis_compare", None)
