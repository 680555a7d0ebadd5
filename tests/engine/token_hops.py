"""The path of one streamed token through the project's own code, traced rather than read.

Issue 45's goal: a streamed token crosses at most 25 distinct functions of the project in at most
12 files, from the engine step that makes it to the bytes written to the client. This starts the
real server (`python -m service`: the HTTP process and the engine core process it spawns, as
served, uvicorn's httptools protocol included), streams one long greedy answer per route (TGI's
/generate_stream, OpenAI's /v1/completions), and records in both processes, with
`sys.setprofile`, every call into a function defined under model/, service/ or weights/.

One token's window, token k of a request (k in the middle of a long stream, so admission, the
prefill and the first token's own path are behind it, and the stream's end is ahead):

- engine core process: from the call of `EngineCore.step` whose returned step holds the request's
  k-th token, to the call of the ZeroMQ socket `send` that sends that step's message to the HTTP
  process (the step's own work, the model's forward included, and its encoding and sending);
- HTTP process: from the call of `EngineClient._take_step` for the message that holds the
  request's k-th token, to the call of the asyncio transport `write` that puts bytes on the
  client's connection (turning ids into text, stop strings, the route's event formatting, and the
  write: straight from the core reader, or through the response's task where the stream takes
  that way);
- in each, the functions called inside the window, plus the project function that made the
  window's opening call (the core's step loop, the HTTP process's socket callback);
- comprehensions and generator expressions (`<genexpr>`, `<listcomp>`, ...) are part of the
  function they are written in, not hops of their own; lambdas and nested functions are hops.

Only the thread that opens the window is traced (the core's step loop, the HTTP event loop), so
other threads' work (tokenizing a new prompt, memory logging) is not counted, and what happens
between steps (the core's poll for new messages, idle waits) is outside the window. A token's
path is its two processes' functions together: the distinct (qualified name, file) pairs of
either, and the distinct files.

Each path is counted twice: whole, and its serving part, the functions outside model/. model/ is
the model package (the forward's layers, its KV cache, the token choice and the host/device
transfers it offers); the serving path counts a call into it as the model's work, not as hops,
as the walk through nano-vllm that issue 45 compares with (~9 hops over 5 files) counts its
model and layers. docs/engine.md says which count the goal is held against.

    .venv/bin/python -m tests.engine.token_hops                        # weights/gpt2, both routes
    .venv/bin/python -m tests.engine.token_hops --model-dir DIR --tokens 24 --token 12
    .venv/bin/python -m tests.engine.token_hops --markdown             # docs/engine.md's table

The recording, inside the server's processes, is tests/engine/hop_recorder.py. The streams are
greedy with ignore_eos, so every run walks the same code; tests/engine/test_token_hops.py checks
that two middle tokens take the same path, and bounds its length.
"""


from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import DEFAULT_MODEL_DIR, REPO
from tests.engine.hop_recorder import ARM, ENGINE_STEP, HTTP_MESSAGE, OUT_VARIABLE, Hop
from tests.processes import STARTUP_TIMEOUT_S, clean_env, engine_core_pid, free_port

ROUTES = ("tgi", "openai")
PROMPT = "The quick brown fox jumps over the lazy dog."
MODEL_DIR = "model/"  # the model package: outside the serving path


def files_of(hops: list[Hop]) -> list[str]:
    return sorted({file for _, file in hops})


@dataclass
class TokenPath:
    """The functions one token crossed, by process."""

    route: str
    token: int
    engine: list[Hop]
    http: list[Hop]

    @property
    def functions(self) -> list[Hop]:
        return sorted(set(self.engine) | set(self.http))

    @property
    def files(self) -> list[str]:
        return files_of(self.functions)

    @property
    def serving(self) -> list[Hop]:
        """The functions outside model/ (the module's doc says why that part is counted apart)."""
        return [hop for hop in self.functions if not hop[1].startswith(MODEL_DIR)]

    def report(self) -> str:
        serving = self.serving
        lines = [f"{self.route}: token {self.token} crosses {len(self.functions)} functions in {len(self.files)} files; "
                 f"serving path (outside model/): {len(serving)} functions in {len(files_of(serving))} files; "
                 f"HTTP process: {len(self.http)} functions in {len(files_of(self.http))} files"]
        for process, hops in (("engine core process", self.engine), ("HTTP process", self.http)):
            lines.append(f"  {process} ({len(hops)}):")
            lines += [f"    {name:<52} {file}" for name, file in hops]
        lines.append("  files: " + ", ".join(self.files))
        return "\n".join(lines)


ROUTE_NAMES = {"tgi": "TGI", "openai": "OpenAI"}


def markdown(paths: list[TokenPath]) -> str:
    """The functions the routes' tokens cross as one table by file (docs/engine.md's listing);
    a function only some routes cross says which."""
    found: dict[str, dict[str, tuple[set[str], set[str]]]] = {}  # file → function → (processes, routes)
    for path in paths:
        for process, hops in (("engine core", path.engine), ("HTTP", path.http)):
            for name, file in hops:
                processes, routes = found.setdefault(file, {}).setdefault(name, (set(), set()))
                processes.add(process)
                routes.add(path.route)
    every_route = {path.route for path in paths}

    def process_of(file: str) -> str:
        processes = set().union(*(procs for procs, _ in found[file].values()))
        return " and ".join(sorted(processes, reverse=True))

    def function(name: str, processes: set[str], routes: set[str], shared: bool) -> str:
        notes = [" and ".join(sorted(processes, reverse=True))] if shared else []
        if routes != every_route:
            notes.append(", ".join(ROUTE_NAMES[r] for r in sorted(routes)) + " only")
        return f"`{name}`" + (f" ({'; '.join(notes)})" if notes else "")

    lines = [f"- {ROUTE_NAMES[p.route]} (token {p.token}): {len(p.functions)} functions in {len(p.files)} files; "
             f"serving path (outside `model/`): {len(p.serving)} functions in {len(files_of(p.serving))} files; "
             f"HTTP process: {len(p.http)} functions in {len(files_of(p.http))} files"
             for p in paths]
    lines += ["", "| process | file | functions |", "| --- | --- | --- |"]
    order = {"engine core": 0, "engine core and HTTP": 1, "HTTP": 2}
    for file in sorted(found, key=lambda f: (order[process_of(f)], f)):
        shared = " and " in process_of(file)
        names = ", ".join(function(name, procs, routes, shared)
                          for name, (procs, routes) in sorted(found[file].items()))
        lines.append(f"| {process_of(file)} | `{file}` | {names} |")
    return "\n".join(lines)


def stream(url: str, route: str, tokens: int) -> int:
    """Stream one greedy answer of `tokens` tokens; returns the token events received."""
    if route == "tgi":
        path = "/generate_stream"
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": tokens, "ignore_eos": True}}
    else:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        path, body = "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": tokens, "stream": True,
                                          "ignore_eos": True, "temperature": 0}
    received = 0
    with httpx.stream("POST", url + path, json=body, timeout=60) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                received += 1
    return received


def wait_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the traced server exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the traced server did not answer /health within {STARTUP_TIMEOUT_S} s")


def arm(server: subprocess.Popen, out_dir: Path) -> None:
    """Start both processes' recording, and wait until each says it has."""
    for pid in (server.pid, engine_core_pid(server.pid)):
        os.kill(pid, ARM)
    deadline = time.monotonic() + 30
    while not all((out_dir / f"{role}.armed").exists() for role in ("http", "engine")):
        if time.monotonic() > deadline:
            raise RuntimeError("the server's processes did not arm their tracing within 30 s")
        time.sleep(0.05)


def windows_of(path: Path) -> list[dict]:
    if not path.exists():
        raise RuntimeError(f"{path.name} was not written: the traced process did not end normally")
    return json.loads(path.read_text())


def token_hops(windows: list[dict], request_id: str, token: int, process: str, opening: str) -> list[Hop]:
    """The functions of the one window that holds the request's token `token`."""
    found = [w for w in windows if token in w["tokens"].get(request_id, [])]
    if len(found) != 1:
        raise RuntimeError(f"{process}: {len(found)} windows hold token {token} of {request_id}, not one "
                           f"(a window opens at each call of {opening}: was it renamed?)")
    if not found[0]["written"]:
        raise RuntimeError(f"{process}: token {token}'s window never reached its socket write")
    return sorted(tuple(hop) for hop in found[0]["hops"])


def trace(model_dir: Path, tokens: int = 24, token_numbers: tuple[int, ...] = (12,),
          routes: tuple[str, ...] = ROUTES, device: str = "cpu") -> dict[str, list[TokenPath]]:
    """Serve `model_dir` traced on `device`, stream `tokens` tokens per route (one request each, in turn), and
    return each route's path of each token number asked for."""
    if not all(1 < k < tokens for k in token_numbers):
        raise ValueError("trace middle tokens: neither the first nor the last")
    with tempfile.TemporaryDirectory(prefix="token-hops-") as out:
        out_dir = Path(out)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = out_dir / "server.log"
        command = [sys.executable, "-c", "import sys; from tests.engine.hop_recorder import serve_traced; "
                   "serve_traced(sys.argv[1:])", "--model-dir", str(model_dir), "--port", str(port),
                   "--device", device, "--threads", "1", "--drain-seconds", "5"]
        with log.open("w") as log_file:
            process = subprocess.Popen(command, cwd=REPO, env={**clean_env(), OUT_VARIABLE: out}, stdout=log_file,
                                       stderr=subprocess.STDOUT)
            try:
                wait_healthy(process, url, log)
                arm(process, out_dir)
                for route in routes:
                    received = stream(url, route, tokens)
                    if received < tokens:  # OpenAI's stream may end with an event of its own
                        raise RuntimeError(f"{route}: {received} events streamed, fewer than its {tokens} tokens")
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=60)
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=30)
        engine, http = windows_of(out_dir / "engine.json"), windows_of(out_dir / "http.json")
    # The requests in the order they were streamed: one per route.
    request_ids = list(dict.fromkeys(r for w in http for r in w["tokens"]))
    if len(request_ids) != len(routes):
        raise RuntimeError(f"{len(request_ids)} requests streamed tokens, not {len(routes)}")
    paths: dict[str, list[TokenPath]] = {}
    for route, request_id in zip(routes, request_ids):
        paths[route] = [
            TokenPath(route, k, token_hops(engine, request_id, k, "engine core", ENGINE_STEP),
                      token_hops(http, request_id, k, "HTTP", HTTP_MESSAGE))
            for k in token_numbers
        ]
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.engine.token_hops", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--tokens", type=int, default=24, help="tokens streamed per route")
    parser.add_argument("--token", type=int, default=12, help="the token traced (a middle one)")
    parser.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--markdown", action="store_true", help="one table by file, as docs/engine.md lists it")
    args = parser.parse_args(argv)
    paths = [path for [path] in trace(args.model_dir, args.tokens, (args.token,), tuple(args.routes),
                                                         args.device).values()]
    print(markdown(paths) if args.markdown else "\n".join(path.report() for path in paths))


if __name__ == "__main__":
    main()
