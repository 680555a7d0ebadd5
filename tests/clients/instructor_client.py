"""Run in .venv-clients (instructor pins a jiter the test venv outgrows): instructor's `from_openai`
against the server at argv[1], in the mode named by argv[2] (TOOLS, its default, or JSON_SCHEMA);
prints the validated instance as JSON and the request instructor sent, for the test to check."""

from __future__ import annotations

import json
import sys
from typing import Literal

import instructor
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field


class Verdict(BaseModel):
    """Bounded fields: an untrained model finishes it within a few tokens."""

    model_config = ConfigDict(extra="forbid")
    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=9)


def main(base_url: str, mode: str) -> None:
    sent: list[dict] = []
    client = instructor.from_openai(OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60),
                                    mode=instructor.Mode[mode])
    client.on("completion:kwargs", lambda *args, **kwargs: sent.append(kwargs))
    verdict = client.chat.completions.create(
        model="gpt2", response_model=Verdict, max_retries=0, max_tokens=30,
        messages=[{"role": "user", "content": "Is the sea wet?"}],
    )
    assert isinstance(verdict, Verdict)
    keys = sorted(k for k in sent[0] if k in ("tools", "tool_choice", "response_format"))
    print(json.dumps({"verdict": verdict.model_dump(), "sent": keys}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
