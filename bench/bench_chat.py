"""What a chat request costs over the same prompt through /v1/completions, as streaming clients
see it: one server with a chat template, rounds that alternate the two routes.

    .venv/bin/python -m bench.bench_chat                                   # weights/gpt2, CPU fp32
    .venv/bin/python -m bench.bench_chat --streams 8 --new-tokens 64 --rounds 5

Each round sends --streams concurrent streams through /v1/chat/completions (a conversation, the
server's --chat-template: ChatML by default), then the same number through /v1/completions with
the prompt's token ids as that template renders them (so the engine gets the same tokens), each
route first in every other round; greedy,
ignore_eos, --new-tokens each. Per stream: TTFT (send → the first token's event) and decode
speed (tokens after the first / seconds after the first). Printed: the medians per route and
chat/completions, the goal: TTFT and tok/s within 5% (the chat route's extra work is rendering
and tokenizing the conversation, on the HTTP side, before admission).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.common import ServiceProcess, add_smoke_argument, describe_machine
from service.http.chat_template import ChatTemplate, special_tokens
from weights.tokenizer import GPT2Tokenizer

REPO = Path(__file__).resolve().parent.parent
CHATML = REPO / "tests" / "service" / "chat_templates" / "chatml.jinja"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant who answers in full sentences."},
    {"role": "user", "content": "Tell me about the history of the printing press in Europe."},
]


def stream(url: str, path: str, body: dict) -> tuple[float, float, int]:
    """(TTFT s, decode tokens/s, tokens) of one stream."""
    start, first, last, tokens = time.perf_counter(), None, None, 0
    with httpx.stream("POST", url + path, json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            for choice in json.loads(line[5:])["choices"]:
                delta = choice.get("delta")
                # A token's event: its text (maybe empty, a character not yet complete); not the
                # chat's opening role delta, not a finish.
                text = choice.get("text") if delta is None else None if "role" in delta else delta.get("content")
                if text is not None and not choice.get("finish_reason"):
                    now = time.perf_counter()
                    first = first or now
                    last, tokens = now, tokens + 1
    if first is None:
        raise RuntimeError(f"{path}: no token streamed")
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")
    return first - start, decode, tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=REPO / "weights" / "gpt2")
    parser.add_argument("--chat-template", type=Path, default=CHATML)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.streams, args.new_tokens, args.rounds = 2, 4, 1
    template = ChatTemplate(args.chat_template.read_text(), special_tokens(args.model_dir), str(args.chat_template))
    ids = GPT2Tokenizer.from_dir(args.model_dir).encode(template.render(MESSAGES))
    common = {"model": "m", "max_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    routes = {"chat": ("/v1/chat/completions", {**common, "messages": MESSAGES}),
              "completions": ("/v1/completions", {**common, "prompt": ids})}
    flags = ["--model-dir", str(args.model_dir), "--model-name", "m", "--chat-template", str(args.chat_template),
             "--max-batch-size", str(max(args.streams, 4)), "--no-access-log"]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in routes}
    with ServiceProcess(flags) as server:
        server.wait_ready()
        with ThreadPoolExecutor(args.streams) as pool:
            for round_index in range(args.rounds + 1):  # the first round warms up, uncounted
                # Each route goes first in every other round: neither gains from its place.
                order = list(routes.items()) if round_index % 2 else list(routes.items())[::-1]
                for name, (path, body) in order:
                    done = list(pool.map(lambda _: stream(server.url, path, body), range(args.streams)))
                    if round_index:
                        results[name] += done
    print(f"{describe_machine()}; {args.model_dir}, prompt {len(ids)} tokens, {args.streams} streams x "
          f"{args.new_tokens} tokens, {args.rounds} rounds")
    medians = {}
    for name, rows in results.items():
        assert all(tokens == args.new_tokens for _, _, tokens in rows), f"{name}: a stream ended early"
        medians[name] = (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
        print(f"{name:12s} TTFT median {medians[name][0] * 1000:8.1f} ms   decode median {medians[name][1]:7.1f} tok/s")
    (chat_ttft, chat_speed), (plain_ttft, plain_speed) = medians["chat"], medians["completions"]
    print(f"chat/completions: TTFT {chat_ttft / plain_ttft:.3f}x, decode {chat_speed / plain_speed:.3f}x (goal: within 5%)")


if __name__ == "__main__":
    main()
