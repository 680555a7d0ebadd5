"""All service settings in one place: command-line flags and GPT2_* environment variables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from model.config import DTYPES
from service.engine.ngram_drafter import NgramSettings


CPU_PREFILL_TOKENS, CUDA_PREFILL_TOKENS = 256, 2048
# Rows a forward adds for the price of one pass over the weights (service/engine/draft_policy.py).
# CPU: the float32 products of one decode step take 17.6 ms for 1 row and 51.0 ms for 32 rows
# (bench/kernels.py), ~1.08 ms a row, so ~16 rows per weight pass. CUDA: an H100's fp16 decode
# graph replays in 0.76 ms at batch 1 and 1.74 ms at 256, ~200 rows per pass (verification
# runs eagerly there: to be measured on a GPU).
CPU_WEIGHT_PASS_ROWS, CUDA_WEIGHT_PASS_ROWS = 16.0, 200.0


class Settings(BaseSettings):
    """Serve a GPT-2 model over HTTP. Each setting is a flag and a GPT2_* variable; flags win."""

    model_config = SettingsConfigDict(env_prefix="GPT2_", extra="ignore")

    # --- model and process ----------------------------------------------------------------
    model_dir: Path = Field(Path("weights/gpt2"), description="folder with config.json, model.safetensors, tokenizer")
    model_name: str = Field("gpt2", min_length=1, max_length=200, description="model id shown by /v1/models and /info")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    quantize: Literal["none", "int8", "int4"] = Field(
        "none",
        description="weights the engine core generates with: none (--dtype's), int8 (CPU, float32 activations:"
        " int8 per output channel on FBGEMM) or int4 (CPU, float32 activations: int4 in groups of 64 inputs,"
        " bfloat16 products, int8 token embedding); the /analyze routes always read the float weights",
    )
    chat_template: str | None = Field(
        None, max_length=200_000,
        description="the chat template for /v1/chat/completions: a file's path, or the jinja2 template itself;"
        " default: the model folder's (chat_template.jinja, or chat_template in tokenizer_config.json)",
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (CPU); default: torch's choice")
    cuda_graphs: bool = Field(True, description="on CUDA, replay decode steps as CUDA graphs captured at start-up")
    decode_attention: Literal["gather", "paged"] = Field(
        "gather", description="on CUDA, how a decode step's attention reads the KV cache's blocks: gather (each row's"
        " blocks copied out, then PyTorch's attention) or paged (a Triton kernel reading them in place); the CPU"
        " always attends row by row",
    )
    overlap: Literal["auto", "on", "off"] = Field(
        "auto", description="launch each engine step before reading the previous one's tokens, hiding the host's "
        "work behind the device's; auto: on for CUDA (on a CPU it only delays tokens by a step)"
    )

    # --- engine limits ----------------------------------------------------------------------
    max_batch_size: int = Field(16, ge=1, le=1024, description="sequences decoded together (running rows); the KV"
                                " cache's memory, --kv-cache-bytes, bounds their tokens")
    kv_cache_bytes: int | None = Field(
        None, ge=1, description="bytes of keys and values the KV cache's block pool holds; default on CPU: 16 full-context"
        " sequences' (the cache of 16 fixed slots before it was paged: 1.2 GB for GPT-2 124M in float32), on CUDA:"
        " --kv-cache-memory-fraction",
    )
    kv_cache_memory_fraction: float = Field(
        0.8, gt=0, le=1, description="on CUDA, without --kv-cache-bytes: the fraction of the GPU memory free after"
        " loading the weights that the KV cache's block pool takes, at most --max-batch-size full-context sequences'"
        " (as vLLM's --gpu-memory-utilization, of free memory: the rest is for activations, CUDA graphs and the"
        " analysis process)",
    )
    max_seq_len: int | None = Field(
        None, ge=2, description="prompt + generated tokens per sequence; default: the model's context"
    )
    max_waiting: int = Field(64, ge=1, le=100_000, description="requests that may wait beyond max_batch_size running; more get 429")
    max_prefill_tokens: int | None = Field(
        None, ge=1, le=1_000_000,
        description="prompt tokens prefilled per engine step; longer prompts are prefilled in chunks between decode steps; default 256 on CPU, 2048 on CUDA",
    )
    # Off by default: priced drafts pay for one client on repetitive or quoting text on the CPU and
    # break even elsewhere; on CUDA verification runs eagerly beside the graphs and measured
    # 0.23-0.51x on one H200 (docs/engine.md).
    speculative_ngram: bool = Field(
        False, description="speculative decoding: draft tokens from the sequence's own n-grams, verified in one forward"
    )
    speculative_ngram_min: int = Field(1, ge=1, le=16, description="shortest n-gram looked up for a draft")
    speculative_ngram_max: int = Field(3, ge=1, le=16, description="longest n-gram looked up (tried first)")
    speculative_tokens: int = Field(4, ge=1, le=16, description="the most tokens a sequence drafts per step (k)")
    speculative_weight_pass_rows: float | None = Field(
        None, gt=0, le=1e9,
        description="rows a forward adds for the cost of one pass over the weights: a sequence drafts a token only"
        " while its recent acceptance pays for the row at the step's batch size; default 16 on CPU, 200 on CUDA;"
        " 1e9: always draft k",
    )
    prefix_caching: bool = Field(True, description="keep computed KV blocks findable by their content; a prompt shares the blocks of its longest cached prefix")
    max_new_tokens: int = Field(1024, ge=1, description="largest max_new_tokens a request may ask for")
    default_max_new_tokens: int = Field(20, ge=1, description="max_new_tokens when a TGI request gives none")
    max_prompts_per_request: int = Field(16, ge=1, le=1024, description="prompts in one list-valued `inputs`")
    max_beams: int = Field(8, ge=1, le=64, description="largest num_beams / num_return_sequences / best_of")
    max_stop_sequences: int = Field(4, ge=0, le=64, description="stop strings per request")
    max_stop_chars: int = Field(64, ge=1, le=4096, description="characters per stop string")

    # --- HTTP -------------------------------------------------------------------------------
    api_servers: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        1, description="HTTP processes accepting on the one port, all fed by one engine core; auto: the CPU cores"
        " the core's threads leave (at most 8)",
    )
    stream_interval: int = Field(
        1, ge=1, le=1024, description="tokens a stream gathers before they are written together (its first and last"
        " go at once): fewer writes, less HTTP CPU per token, burstier streams; 1 writes each token as it comes",
    )
    max_body_bytes: int = Field(1_000_000, ge=1, description="request bodies above this get 413 before parsing")
    api_key: SecretStr | None = Field(None, description="if set, bearer token required on all but /health, /metrics")
    drain_seconds: float = Field(30.0, ge=0, description="on SIGTERM, how long in-flight requests may finish")
    retry_after_seconds: int = Field(1, ge=0, le=3600, description="Retry-After sent with 429")
    # Against idle, slow and flooding clients (service/http/server.py).
    max_connections: int = Field(1000, ge=1, description="open connections; one more closes the oldest idle one")
    keep_alive_seconds: int = Field(5, ge=1, le=3600, description="an idle kept-alive connection is closed after this")
    header_timeout_seconds: float = Field(10.0, gt=0, le=3600, description="a request's headers must arrive within this")
    body_timeout_seconds: float = Field(30.0, gt=0, le=3600, description="a request's body must arrive within this")
    allowed_hosts: str | None = Field(
        None,
        description="Host names served, comma-separated, '*.example.com' for its subdomains, '*' for any;"
        " default: loopback names when bound to loopback",
    )
    cors_origins: str = Field(
        "", max_length=4000, description="comma-separated origins browsers may call from ('*': any); empty: CORS off"
    )
    log_format: Literal["text", "json"] = Field("text", description="json: one JSON object per log line")
    access_log: bool = Field(
        True, description="a log line per request (uvicorn's access log); --no-access-log saves its CPU (~60 us a request on 2 cores)",
    )
    playground: bool = Field(
        True, description="serve the playground page at GET / (--no-playground: the API alone, GET / is 404)"
    )

    # --- /analyze/spectrum --------------------------------------------------------------------
    analysis_max_texts: int = Field(8, ge=1, le=256, description="texts per analysis request")
    analysis_max_tokens: int | None = Field(
        None, ge=1, description="tokens per analysed text; default (and at most): the model's context"
    )
    analysis_max_concurrent: int = Field(1, ge=1, le=64, description="analyses running at once; more get 429")
    compare_model_dir: Path | None = Field(
        None, description="a second, analysis-only model (GPT-2 or Post-LN GPT-1) that /analyze/spectrum also measures"
    )
    compare_model_name: str | None = Field(
        None, min_length=1, max_length=200, description="its name in reports; default the folder's name"
    )
    inspect_max_tokens: int = Field(64, ge=1, le=1024, description="tokens per /analyze/attention or /analyze/logit-lens text")

    # --- LoRA adapters ----------------------------------------------------------------------
    lora: list[str] = Field(
        default_factory=list, max_length=64,
        description="NAME=DIR: serve the peft LoRA adapter in DIR under NAME (repeat the flag for more); "
        "requests choose it by name (OpenAI model, TGI adapter_id)",
    )

    @field_validator("allowed_hosts")
    @classmethod
    def _host_patterns(cls, value: str | None) -> str | None:
        # Starlette's TrustedHostMiddleware checks them (an assert) only at the first request.
        for pattern in (value or "").split(","):
            pattern = pattern.strip()
            if "*" in pattern[1:] or (pattern.startswith("*") and pattern != "*" and not pattern.startswith("*.")):
                raise ValueError(f"{pattern!r}: a wildcard must be '*' alone or lead a domain, as '*.example.com'")
        return value

    @field_validator("lora")
    @classmethod
    def _adapter_pairs(cls, value: list[str]) -> list[str]:
        names = []
        for item in value:
            name, _, folder = item.partition("=")
            if not name.strip() or not folder.strip():
                raise ValueError(f"{item!r}: expected NAME=DIR (a name, then the adapter's peft folder)")
            names.append(name.strip())
        if len(set(names)) < len(names):
            raise ValueError(f"adapter names must be distinct: {names}")
        return value

    @property
    def adapters(self) -> tuple[tuple[str, str], ...]:
        """The --lora adapters as (name, folder) pairs."""
        return tuple((name.strip(), folder.strip()) for name, _, folder in (item.partition("=") for item in self.lora))

    @model_validator(mode="after")
    def _consistent(self) -> "Settings":
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(
                f"speculative_ngram_min ({self.speculative_ngram_min}) exceeds speculative_ngram_max ({self.speculative_ngram_max})"
            )
        if self.decode_attention == "paged" and self.device != "cuda":
            raise ValueError("decode_attention 'paged' is a CUDA kernel: it needs --device cuda")
        if self.default_max_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"default_max_new_tokens ({self.default_max_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})"
            )
        return self

    @property
    def api_server_count(self) -> int:
        if self.api_servers != "auto":
            return self.api_servers
        cores = os.cpu_count() or 1
        core_threads = self.threads or (1 if self.device == "cuda" else cores)
        return max(1, min(8, cores - core_threads))

    @property
    def cors_origin_list(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def speculation(self) -> NgramSettings | None:
        if not self.speculative_ngram:
            return None
        return NgramSettings(
            self.speculative_ngram_min, self.speculative_ngram_max, self.speculative_tokens, self.weight_pass_rows
        )

    @property
    def weight_pass_rows(self) -> float:
        if self.speculative_weight_pass_rows is not None:
            return self.speculative_weight_pass_rows
        return CUDA_WEIGHT_PASS_ROWS if self.device == "cuda" else CPU_WEIGHT_PASS_ROWS

    @property
    def prefill_budget(self) -> int:
        """Prompt tokens per step. On the CPU a 256-token chunk costs ~5 decode steps of 16
        rows (bench/bench_prefix.py's long-arrival), so streams slow but never stall; a GPU
        prefills 2048 in about one decode step's time."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return CUDA_PREFILL_TOKENS if self.device == "cuda" else CPU_PREFILL_TOKENS

    def context_length(self, n_positions: int) -> int:
        """Longest sequence (prompt + generated) served: the setting, capped by the model."""
        return min(self.max_seq_len or n_positions, n_positions)
