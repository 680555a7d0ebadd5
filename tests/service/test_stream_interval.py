"""--stream-interval N on a real server: a stream's tokens leave in writes of N events (the first
and the last at once), and every client still reads the same tokens and text.

The groups are read from the HTTP/1.1 chunked framing on a raw connection: each write is one
chunk whatever the TCP segments, so the framing shows how the server wrote the stream.
"""

from __future__ import annotations

import json
import socket

import httpx
import huggingface_hub.constants
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI

from tests.service.live import forbid_network, live_server

pytestmark = pytest.mark.slow

PROMPT = "The meaning of life is"
INTERVAL = 4


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with live_server(tiny_model_dir, stream_interval=INTERVAL) as running:
        yield running


def chunked_frames(port: int, path: str, body: dict) -> list[bytes]:
    """The response body's chunks, as the server framed them."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
        connection.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
        raw = b""
        while data := connection.recv(1 << 16):
            raw += data
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
    frames = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return frames
        frames.append(rest[:size])
        rest = rest[size + 2:]


def test_tgi_stream_writes_the_first_token_alone_then_groups(server):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 13, "ignore_eos": True, "details": True}}
    frames = chunked_frames(server.port, "/generate_stream", body)
    events = [[json.loads(line[6:]) for line in frame.split(b"\n\n") if line.startswith(b"data: ")] for frame in frames]
    sizes = [len(e) for e in events]
    assert sum(sizes) == 13 and sizes[0] == 1, sizes
    # Tokens 2-9 in groups of 4 (two held groups may share a write when they queued together);
    # 10-12 are held and leave with the 13th, the last, which carries the details.
    assert all(size % INTERVAL == 0 for size in sizes[1:-1]) and sizes[-1] == 4, sizes
    flat = [event for group in events for event in group]
    assert [e["index"] for e in flat] == list(range(1, 14))
    whole = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert [e["token"]["id"] for e in flat] == [t["id"] for t in whole["details"]["tokens"]]
    assert "".join(e["token"]["text"] for e in flat) == flat[-1]["generated_text"] == whole["generated_text"]


def test_official_clients_read_the_same_answer_streamed_or_not(server, monkeypatch):
    forbid_network(monkeypatch)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hf = InferenceClient(base_url=server.url, timeout=60)
    out = hf.text_generation(PROMPT, max_new_tokens=10, details=True)
    events = list(hf.text_generation(PROMPT, max_new_tokens=10, stream=True, details=True))
    assert [e.token.id for e in events] == [t.id for t in out.details.tokens]
    assert "".join(e.token.text for e in events) == out.generated_text == events[-1].generated_text

    oai = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    whole = oai.completions.create(model="gpt2", prompt=[PROMPT, "Once upon"], max_tokens=9, temperature=0)
    chunks = list(oai.completions.create(model="gpt2", prompt=[PROMPT, "Once upon"], max_tokens=9, temperature=0,
                                         stream=True, logprobs=1))
    for choice in whole.choices:
        assert "".join(c.text for chunk in chunks for c in chunk.choices if c.index == choice.index) == choice.text
