"""What the app needs for the analysis at start-up, holding no weights: the configs that requests
are checked against before they leave this process, a lone server's check of the comparison
checkpoint (a bad folder stops start-up here, in one line), and the analysis process's settings.

The weights themselves, and their spectra (docs/analysis.md, "Weight spectra": seconds on CPU
for GPT-2 124M), are the analysis process's (service/analysis/process.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from fastapi import FastAPI
from starlette.requests import Request

from model.config import GPT2Config
from model.gpt2 import GPT2
from model.post_ln import MODEL_TYPE, PostLNConfig, PostLNGPT
from service.analysis.process import AnalysisProcessConfig
from service.analysis.remote import AnalysisClient
from service.settings import Settings
from weights.checkpoint import CONFIG_FILE, CheckpointError, check_checkpoint, load_config
from weights.post_ln import TIED as POST_LN_TIED
from weights.post_ln import model_type


@dataclass(frozen=True)
class AnalysisModels:
    """What the HTTP side knows of the analysed models: enough to refuse a request (422)."""

    config: GPT2Config
    compare: GPT2Config | PostLNConfig | None  # the comparison model's, if the server has one


def analysis_config(model_dir: Path, dtype: torch.dtype | None = None) -> GPT2Config | PostLNConfig:
    """A GPT-2 or Post-LN folder's config; with `dtype`, its checkpoint checked against it,
    values too (weights.checkpoint.check_checkpoint)."""
    if model_type(model_dir) == MODEL_TYPE:
        try:
            config = PostLNConfig.from_json(model_dir / CONFIG_FILE)
        except (OSError, ValueError) as exc:
            raise CheckpointError(str(exc)) from exc
        if dtype is not None:
            check_checkpoint(model_dir, config, PostLNGPT, POST_LN_TIED, dtype)
        return config
    config = load_config(model_dir)
    if dtype is not None:
        check_checkpoint(model_dir, config, GPT2, dtype=dtype)
    return config


def analysis_models(settings: Settings, config: GPT2Config, check: bool) -> AnalysisModels:
    """`check`: the comparison checkpoint too, as a lone server checks its model (service/app.py)."""
    compare = None
    if settings.compare_model_dir is not None:
        compare = analysis_config(settings.compare_model_dir, settings.torch_dtype if check else None)
    return AnalysisModels(config, compare)


def process_config(settings: Settings, address: str = "") -> AnalysisProcessConfig:
    """The analysis process's settings (`address`: filled in by whoever makes its directory)."""
    return AnalysisProcessConfig(
        address=address, model_dir=settings.model_dir, model_name=settings.model_name, device=settings.device,
        dtype=settings.dtype, threads=settings.threads, max_concurrent=settings.analysis_max_concurrent,
        max_tokens=settings.analysis_max_tokens, compare_model_dir=settings.compare_model_dir,
        compare_model_name=settings.compare_model_name, adapters=settings.adapters,
    )


def prepare_analysis(app: FastAPI, models: AnalysisModels, client: AnalysisClient) -> None:
    app.state.analysis_models = models
    app.state.analysis = client


def analysis_models_of(request: Request) -> AnalysisModels:
    return request.app.state.analysis_models


def analysis_client(request: Request) -> AnalysisClient:
    return request.app.state.analysis
