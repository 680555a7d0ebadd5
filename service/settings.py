"""All service settings in one place: command-line flags and GPT2_* environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPT2_", extra="ignore")

    model_dir: Path = Field(Path("weights/gpt2"), description="folder with config.json, model.safetensors, tokenizer")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (CPU); default: torch's choice")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
