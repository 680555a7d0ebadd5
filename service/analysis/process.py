"""The analysis process: the one place beside the engine core that holds the model's weights
(float, as loaded: never the core's quantized copy), the comparison model and their weight
spectra, and answers /analyze/* for every HTTP process.

Spawned by a lone server's app (service/app.py) or by the supervisor of --api-servers N
(service/workers.py), so the weights are on the device twice whatever N is, and HTTP processes
load none. Not in the engine core: an analysis takes from milliseconds to seconds, and the core's
step loop would stall every stream for it. Here it competes for the device (and, on a CPU, for
the cores, at a lower priority) but never holds a decode step back.

The main thread owns the sockets: it reads calls from the ROUTER socket, hands each to one of
`max_concurrent` worker threads (more are refused at once, 429), and sends their answers, which
come back over an in-process socket (ZeroMQ sockets are not thread-safe). Like the core, it
ignores SIGINT and SIGTERM (its parent owns the shutdown) and exits when its parent is gone.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import zmq

from model.analysis import cached_weight_spectra
from model.config import DTYPES
from model.lora import AppliedAdapter
from model.introspect import attention_maps, logit_lens
from service.analysis.adapters import AnalysedAdapters, UnknownAdapter
from service.engine.gc_heap import freeze_startup_heap
from service.analysis.figure import SVG_MEDIA_TYPE, FigureUnavailable, heatmaps_svg, render_svg
from service.analysis.protocol import (
    Attention, Done, Failed, Hello, Lens, ListAdapters, LoadAdapter, Ready, Refused, Reply, Request, Spectrum,
    UnloadAdapter, encoder, requests,
)
from service.analysis.report import Subject, check_request, combined, encode, load_subject, reports

log = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # how often an idle process looks for its parent's end
RESULTS = "inproc://analysis-results"
PR_SET_NAME = 15  # linux/prctl.h
PROCESS_NAME = b"gpt2-analysis"  # what ps and top show (and how tests tell it from the core)
# On a shared CPU an analysis would take cores from decode steps; the scheduler gives them to
# the engine core first (a GPU's own scheduling is not affected).
NICE = 10
JSON = "application/json"


@dataclass(frozen=True)
class AnalysisProcessConfig:
    address: str  # bound here; every HTTP process connects to it
    model_dir: Path
    model_name: str
    device: str
    dtype: str  # a key of model.config.DTYPES
    threads: int | None
    max_concurrent: int  # analyses at once, for the whole server
    max_tokens: int | None  # per analysed text (/analyze/spectrum)
    compare_model_dir: Path | None = None
    compare_model_name: str | None = None
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA (name, peft folder) pairs to load at start


def run_analysis(config: AnalysisProcessConfig, status=None) -> None:
    """multiprocessing target. `status` (a Connection, for the supervisor): None once the weights
    are loaded and checked, or the one-line reason they cannot be."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s analysis %(levelname)s %(message)s")
    ctypes.CDLL(None).prctl(PR_SET_NAME, PROCESS_NAME)
    parent = os.getppid()
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(config.address)
    results = context.socket(zmq.PULL)
    results.bind(RESULTS)
    subjects, adapters, failure = [], None, None
    try:
        subjects = load_subjects(config)
        adapters = AnalysedAdapters(subjects[0].model, config.adapters)
    except Exception as exc:  # a bad checkpoint among them: every call is answered with why
        failure = str(exc) if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: {exc}"
        log.error("cannot load the analysis models: %s", failure)
    if status is not None:
        status.send(failure)
        status.close()
    analyst = Analyst(config, subjects, adapters) if failure is None else None
    freeze_startup_heap("analysis")
    lower_priority()  # after loading: the server's start-up waits for that
    if analyst is not None:
        threading.Thread(target=analyst.warm, name="weight-spectra", daemon=True).start()
    AnalysisLoop(router, results, parent, analyst, failure, config.max_concurrent).run()
    # A running analysis is not waited for: nobody is left to read its answer.
    os._exit(0)


def lower_priority() -> None:
    """Nice every thread of this process (Linux's nice is per thread: torch's worker threads,
    started while loading, would keep theirs); threads started later inherit it."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), NICE)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def load_subjects(config: AnalysisProcessConfig) -> list[Subject]:
    if config.threads:
        torch.set_num_threads(config.threads)
    dtype = DTYPES[config.dtype]
    subjects = [load_subject(config.model_dir, config.device, dtype, config.model_name)]
    if config.compare_model_dir is not None:
        subjects.append(load_subject(config.compare_model_dir, config.device, dtype, config.compare_model_name))
    return subjects


class Invalid(ValueError):
    """What the HTTP side could not check from the configs alone (tokens, per model): a 422."""


class Analyst:
    """The loaded models and what each call computes: the body of the HTTP answer."""

    def __init__(self, config: AnalysisProcessConfig, subjects: list[Subject], adapters: AnalysedAdapters) -> None:
        self.config = config
        self.subjects = subjects
        self.main = subjects[0]
        self.adapters = adapters

    def warm(self) -> None:
        """The weight spectra, computed while the server starts serving generation: the server's
        readiness waits for the models' loading, not for these. A spectrum request that comes
        first waits for them (model.analysis keeps them under a lock); inspections do not."""
        started = time.perf_counter()
        for subject in self.subjects:
            cached_weight_spectra(subject.model)
        log.info("weight spectra computed in %.1f s", time.perf_counter() - started)

    def answer(self, call) -> Done | Refused:
        started = time.perf_counter()
        handler = {Spectrum: self.spectrum, Attention: self.attention, Lens: self.lens}[type(call)]
        try:
            with self.adapters.using(call.adapter) as adapter:
                body, media_type, *fast_counts = handler(call, adapter)
        except (Invalid, FigureUnavailable) as exc:
            return Refused("validation", str(exc))
        except UnknownAdapter as exc:
            return Refused("not_found", str(exc))
        body = body.encode() if isinstance(body, str) else body
        return Done(body, media_type, time.perf_counter() - started, *fast_counts)

    def manage_adapters(self, call: LoadAdapter | UnloadAdapter | ListAdapters) -> Done | Refused:
        """Run at once on the main thread: reading a folder takes milliseconds, and a change of
        adapters must not wait behind (or be refused by) running analyses."""
        try:
            if isinstance(call, LoadAdapter):
                self.adapters.load(call.name, call.folder)
            elif isinstance(call, UnloadAdapter):
                self.adapters.unload(call.name)
        except UnknownAdapter as exc:
            return Refused("not_found", str(exc))
        except ValueError as exc:
            return Refused("validation", str(exc))
        return Done(_json({"adapters": self.adapters.names}), JSON, 0.0)

    def spectrum(self, call: Spectrum, adapter: AppliedAdapter | None):
        # With an adapter, the first subject is the fine-tuned model; the comparison is its base
        # (the same weights, no adapter) or the comparison model.
        main = self.main if adapter is None else replace(self.main, adapter=adapter)
        subjects = [main]
        if call.compare_base:
            subjects.append(self.main)
        elif call.compare:
            subjects.append(self.subjects[1])
        try:
            token_ids = encode(subjects, call.texts, call.token_ids)
            what = "text" if call.texts is not None else "token_ids"
            check_request(subjects, token_ids, call.layers, self.config.max_tokens, what)
        except ValueError as exc:
            raise Invalid(str(exc)) from None
        measured = reports(subjects, token_ids, call.method, call.layers)
        fast = [report["fast_method"] for report in measured if report["fast_method"] is not None]
        counts = sum(f["iterated"] for f in fast), sum(f["fallbacks"] for f in fast)
        if call.format == "svg":
            return render_svg(measured), SVG_MEDIA_TYPE, *counts
        # Serialised here, once, not by a generic encoder walking every float.
        return json.dumps(combined(measured), allow_nan=False, separators=(",", ":")), JSON, *counts

    def attention(self, call: Attention, adapter: AppliedAdapter | None):
        maps = attention_maps(self.main.model, call.token_ids, call.layers, adapter)  # [layers, H, T, T]
        tokens = self._tokens(call.token_ids)
        if call.format == "svg":
            return heatmaps_svg(maps, call.layers, tokens), SVG_MEDIA_TYPE
        return _json({
            "model": self.main.name, "adapter": call.adapter, "token_ids": call.token_ids, "tokens": tokens,
            # attention[layer][head][query][key]
            "layers": [{"layer": layer, "attention": maps[i].tolist()} for i, layer in enumerate(call.layers)],
        }), JSON

    def lens(self, call: Lens, adapter: AppliedAdapter | None):
        ids = call.token_ids
        top = logit_lens(self.main.model, ids, call.top_k, adapter)
        decode = self.main.tokenizer.decode
        layers = []
        for depth in range(top.ids.shape[0]):
            positions = [
                [{"id": int(t), "text": decode([int(t)]), "logprob": float(lp)}
                 for t, lp in zip(top.ids[depth, position], top.logprobs[depth, position])]
                for position in range(len(ids))
            ]
            # 0: the embeddings; i: after block i (the last is the model's output).
            layers.append({"layer": depth, "top": positions})
        return _json({"model": self.main.name, "adapter": call.adapter, "token_ids": ids, "tokens": self._tokens(ids), "layers": layers}), JSON

    def _tokens(self, ids: list[int]) -> list[str]:
        return [self.main.tokenizer.decode([t]) for t in ids]


def _json(content: dict) -> bytes:
    """The bytes Starlette's JSONResponse renders, so answers are as they were in-process."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


class AnalysisLoop:
    def __init__(self, router: zmq.Socket, results: zmq.Socket, parent_pid: int, analyst: Analyst | None,
                 failure: str | None, max_concurrent: int) -> None:
        self.router = router
        self.results = results
        self.parent_pid = parent_pid
        self.analyst = analyst
        self.failure = failure
        self.max_concurrent = max_concurrent
        self.busy = 0
        self.workers = ThreadPoolExecutor(max_concurrent, thread_name_prefix="analysis")
        self.local = threading.local()
        self.poller = zmq.Poller()
        self.poller.register(router, zmq.POLLIN)
        self.poller.register(results, zmq.POLLIN)

    def run(self) -> None:
        while os.getppid() == self.parent_pid:
            for sock, _ in self.poller.poll(IDLE_POLL_MS):
                if sock is self.results:
                    self.router.send_multipart(self.results.recv_multipart())
                    self.busy -= 1
                else:
                    identity, payload = self.router.recv_multipart()
                    self._take(identity, payload)
        log.info("the process that started the analysis is gone: exiting")

    def _take(self, identity: bytes, payload: bytes) -> None:
        try:
            request = requests.decode(payload)
        except Exception:
            log.exception("an undecodable call was dropped")
            return
        call = request.call
        if self.failure is not None:
            self._send(identity, request.id, Failed(self.failure))
        elif isinstance(call, Hello):
            self._send(identity, request.id, Ready(os.getpid()))
        elif isinstance(call, (LoadAdapter, UnloadAdapter, ListAdapters)):
            self._send(identity, request.id, self.analyst.manage_adapters(call))
        elif self.busy >= self.max_concurrent:
            # Several HTTP processes each admit their own share: the limit is the server's, here.
            busy = f"{self.max_concurrent} analyses are already running; retry later"
            self._send(identity, request.id, Refused("overloaded", busy))
        else:
            self.busy += 1
            self.workers.submit(self._work, identity, request)

    def _send(self, identity: bytes, request_id: int, answer) -> None:
        self.router.send_multipart([identity, encoder.encode(Reply(request_id, answer))])

    def _work(self, identity: bytes, request: Request) -> None:
        try:
            answer = self.analyst.answer(request.call)
        except Exception as exc:
            log.exception("analysis failed")
            answer = Failed(f"the analysis failed: {type(exc).__name__}: {exc}")
        push = getattr(self.local, "push", None)
        if push is None:
            push = self.local.push = self.results.context.socket(zmq.PUSH)
            push.connect(RESULTS)
        push.send_multipart([identity, encoder.encode(Reply(request.id, answer))])
