"""The recording half of tests/engine/token_hops.py, which runs inside the traced server's two
processes: a profile function per process that keeps the project calls of each step's window
(token_hops.py's docstring defines the windows), and the entry points that install it.

`serve_traced` is `python -m service` with the HTTP process recorded and its engine core spawned
through `traced_run_core`; each starts recording on SIGUSR1 and writes its windows as JSON when
its process ends.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType

from tests.conftest import REPO

Hop = tuple[str, str]  # (qualified name, file relative to the repository)

PROJECT_DIRS = ("model", "service", "weights")
ENGINE_STEP = "EngineCore.step"
HTTP_MESSAGE = "EngineClient._take_step"
# Where each process writes what it recorded (the server's environment; GPT2_* would be a setting).
OUT_VARIABLE = "TOKEN_HOPS_OUT"
COMPREHENSIONS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")


def project_hop(code: CodeType) -> Hop | None:
    """The (qualified name, file) of a function defined in the project, or None."""
    path = Path(code.co_filename)
    if not path.is_absolute():
        return None
    try:
        relative = path.relative_to(REPO)
    except ValueError:
        return None
    if relative.parts[0] not in PROJECT_DIRS or code.co_name in COMPREHENSIONS:
        return None
    return code.co_qualname, relative.as_posix()


@dataclass
class Window:
    """The calls of one step's message, in one process."""

    hops: set[Hop]
    # The tokens it carried, numbered within their request from 1; None until known.
    tokens: dict[str, list[int]] | None = None
    written: bool = False  # closed by its send (engine) or its write to the client (HTTP)


class Recorder:
    """A profile function that keeps the project calls of each window (see the module's doc)."""

    opening = ""

    def __init__(self) -> None:
        self.windows: list[Window] = []
        self.open: list[Window] = []
        self.seen: Counter[str] = Counter()  # tokens so far, by request
        self._hops: dict[CodeType, Hop | None] = {}

    def profile(self, frame: FrameType, event: str, arg) -> None:
        if event == "call":
            code = frame.f_code
            try:
                hop = self._hops[code]
            except KeyError:
                hop = self._hops[code] = project_hop(code)
            if hop is not None and code.co_qualname == self.opening:
                for window in self.open:
                    window.hops.add(hop)
                window = Window({hop})
                caller = frame.f_back
                caller_hop = project_hop(caller.f_code) if caller is not None else None
                if caller_hop is not None:
                    window.hops.add(caller_hop)
                self.windows.append(window)
                self.open.append(window)
                self.opened(window, frame)
            elif self.open:
                if hop is not None:
                    for window in self.open:
                        window.hops.add(hop)
                elif self.closes(frame):
                    for window in [w for w in self.open if w.tokens is not None]:
                        window.written = True
                        self.open.remove(window)
        elif event == "return":
            self.returned(frame, arg)

    def opened(self, window: Window, frame: FrameType) -> None: ...

    def returned(self, frame: FrameType, value) -> None: ...

    def closes(self, frame: FrameType) -> bool:
        raise NotImplementedError

    def label(self, window: Window, request_ids: list[str]) -> None:
        tokens: dict[str, list[int]] = {}
        for request_id in request_ids:
            self.seen[request_id] += 1
            tokens.setdefault(request_id, []).append(self.seen[request_id])
        window.tokens = tokens

    def dump(self, path: Path) -> None:
        windows = [{"tokens": w.tokens or {}, "written": w.written, "hops": sorted(w.hops)} for w in self.windows]
        path.write_text(json.dumps(windows))


def step_request_ids(step) -> list[str]:
    """The request of each token of a CoreStep (service/engine/types.py)."""
    return list(step.tokens.request_ids)


class EngineRecorder(Recorder):
    opening = ENGINE_STEP

    def __init__(self) -> None:
        super().__init__()
        self._step_frame: FrameType | None = None

    def opened(self, window: Window, frame: FrameType) -> None:
        self._step_frame = frame

    def returned(self, frame: FrameType, value) -> None:
        if frame is self._step_frame:
            self._step_frame = None
            self.label(self.open[-1], step_request_ids(value))

    def closes(self, frame: FrameType) -> bool:
        return frame.f_code.co_name == "send" and "zmq" in frame.f_code.co_filename


class HttpRecorder(Recorder):
    opening = HTTP_MESSAGE

    def opened(self, window: Window, frame: FrameType) -> None:
        step = getattr(frame.f_locals.get("message"), "step", None)
        self.label(window, step_request_ids(step) if step is not None else [])

    def closes(self, frame: FrameType) -> bool:
        return frame.f_code.co_name == "write" and isinstance(frame.f_locals.get("self"), asyncio.Transport)


# --- the processes' entry points ------------------------------------------------------------------
# Each process records from when the tracer arms it (SIGUSR1, once the server is up): tracing the
# start-up (imports, model loading) would only slow it, and none of it is a token's path.
ARM = signal.SIGUSR1


def arm_on_signal(recorder: Recorder, role: str) -> None:
    def arm(*_) -> None:
        sys.setprofile(recorder.profile)  # the main thread's: the one the signal is handled in
        (Path(os.environ[OUT_VARIABLE]) / f"{role}.armed").touch()

    signal.signal(ARM, arm)


def traced_run_core(config) -> None:
    """The engine core process's target, traced: service.engine.process.run_core under EngineRecorder."""
    from service.engine.process import run_core

    recorder = EngineRecorder()
    arm_on_signal(recorder, "engine")
    try:
        run_core(config)
    finally:
        sys.setprofile(None)
        recorder.dump(Path(os.environ[OUT_VARIABLE]) / "engine.json")


def serve_traced(argv: list[str]) -> None:
    """`python -m service ARGV` in this process, traced once armed, its engine core spawned traced too."""
    import service.__main__ as launcher
    import service.http.core_process as core_process

    if not hasattr(core_process, "run_core"):
        raise RuntimeError("service/http/core_process.py no longer spawns the core with run_core: trace its new target")
    core_process.run_core = traced_run_core  # the spawned process imports this module to run it
    # asyncio's own event loop, not uvloop where it is installed (uvicorn's "auto" takes it): a
    # uvloop transport's write is compiled code that sys.setprofile does not see, so no window
    # would close at its write. The project's functions on the path are the same either way.
    sys.modules["uvloop"] = None  # type: ignore[assignment]  # makes `import uvloop` raise ImportError
    recorder = HttpRecorder()
    arm_on_signal(recorder, "http")
    # uvicorn re-raises the SIGTERM it stopped on once it has shut down: exit through `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        launcher.main(argv)
    finally:
        sys.setprofile(None)
        recorder.dump(Path(os.environ[OUT_VARIABLE]) / "http.json")
