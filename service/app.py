"""Builds the FastAPI application: loads the model at start-up, mounts the routes."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
from fastapi import FastAPI

from model.gpt2 import GPT2
from service.settings import Settings
from weights.checkpoint import load_model
from weights.prepare import read_origin
from weights.tokenizer import GPT2Tokenizer


@dataclass
class ServiceState:
    settings: Settings
    model: GPT2
    tokenizer: GPT2Tokenizer
    origin: dict


def load_state(settings: Settings) -> ServiceState:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    model = load_model(settings.model_dir, device=settings.device, dtype=settings.torch_dtype)
    tokenizer = GPT2Tokenizer.from_dir(settings.model_dir)
    return ServiceState(settings, model, tokenizer, read_origin(settings.model_dir))


def create_app(settings: Settings) -> FastAPI:
    # Load before serving: a bad checkpoint must stop start-up, not the first request.
    state = load_state(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.service = state
        yield

    app = FastAPI(title="gpt2-serve", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app
