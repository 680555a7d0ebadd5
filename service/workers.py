"""--api-servers N: N HTTP processes on one address and port, in front of one engine core.

    python -m service --api-servers 2 ...      # this module's supervise(), in the first process

The first process becomes a supervisor: it lays out a run directory (service/http/core_link.py),
spawns the engine core with one socket pair per HTTP process (service/engine/process.py routes
each step's outputs to the process that owns the request) and the one analysis process
(service/analysis/process.py: the float weights /analyze reads, the comparison model, the weight
spectra), and starts N HTTP processes, each `python -m service.workers RUN_DIR INDEX <the same
flags>`. These hold no weights: each reads the config and tokenizer (so /info, /health and the
tokenizer routes answer from any of them), sends analyses to the shared analysis process, and
binds its own listening socket with SO_REUSEPORT: the kernel spreads new connections over the
processes listening.
So the device holds two copies of the weights (the core's, the analysis process's) whatever N.
A bad checkpoint stops the whole server in one line: the analysis process, loading it, sends the
loader's message to the supervisor (the HTTP processes read config and tokenizer alone).

Admission is global (a shared in-flight count, core_link.SharedInFlight) and metrics are one
view (prometheus_client's multiprocess mode, service/http/metrics.py).
Lifecycle: SIGTERM here is passed to every HTTP process (SIGINT from a terminal reaches them all
already); each drains as a lone server does and tells the core to drain; the core exits when the
last request is done. An HTTP process stopped alone (SIGTERM to it) drains itself but not the core;
one killed by a signal (a crash, the OOM killer) too is restarted, and the core cancels what its
predecessor had asked for; one that exits with an error stops the whole server with its exit
code (a start-up failure would only repeat). A dead core fails every process's requests at once
(each watches the core's pid) and /health answers 503 everywhere; a dead analysis process makes
every process answer /analyze 503. If the supervisor itself dies (even by SIGKILL), the core and
the analysis process exit (their parent is gone) and every HTTP process gets SIGTERM.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from service.analysis.process import run_analysis
from service.analysis.protocol import analysis_address
from service.analysis.startup import process_config
from service.engine.process import run_core
from service.http.core_link import CoreLink, RunDir
from service.launch import run, serving_settings
from service.common.metrics import MULTIPROC_ENV
from service.settings import Settings
from weights.checkpoint import CheckpointError

log = logging.getLogger("gpt2.supervisor")
POLL_S = 0.2
PR_SET_PDEATHSIG = 1  # linux/prctl.h
CORE_EXIT_GRACE_S = 15.0  # after the last HTTP process: the core's last messages and exit
ANALYSIS_VERDICT_S = 120.0  # an HTTP process failed at start-up: wait this long for the analysis process's word


class Supervisor:
    def __init__(self, settings: Settings, argv: list[str]) -> None:
        self.settings = settings
        self.argv = argv
        self.run_dir = RunDir(Path(tempfile.mkdtemp(prefix="gpt2-serve-")), settings.api_server_count)
        self.run_dir.create()
        self.env = {**os.environ, MULTIPROC_ENV: str(self.run_dir.metrics_dir)}
        self.workers: list[subprocess.Popen] = []
        self.core: multiprocessing.process.BaseProcess | None = None
        self.analysis: multiprocessing.process.BaseProcess | None = None
        self.analysis_status: multiprocessing.connection.Connection | None = None  # until it has loaded
        self.stopping = False
        self.exit_code = 0

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        # Ctrl-C reaches the whole process group: each HTTP process has it already (a second
        # signal would make uvicorn skip its drain).
        signal.signal(signal.SIGINT, lambda *_: self._stop(forward=False))
        try:
            self.core = self._start_core()
            self.analysis = self._start_analysis()
            self.workers = [self._start_worker(i) for i in range(self.run_dir.api_servers)]
            if self.stopping:  # a signal came while they were being started
                self._stop()
            log.info("%d HTTP processes on %s:%d, engine core pid %d", len(self.workers), self.settings.host,
                     self.settings.port, self.core.pid)
            while not (self.stopping and all(w.poll() is not None for w in self.workers)):
                self._watch()
                time.sleep(POLL_S)
        finally:
            self._end_core()
            self._end_analysis()
            shutil.rmtree(self.run_dir.path, ignore_errors=True)
        return self.exit_code

    def _start_core(self) -> multiprocessing.process.BaseProcess:
        from service.app import core_config
        from weights.checkpoint import load_config
        from weights.tokenizer import GPT2Tokenizer

        settings, count = self.settings, self.run_dir.api_servers
        context_length = settings.context_length(load_config(settings.model_dir).n_positions)
        config = replace(
            core_config(settings, context_length, GPT2Tokenizer.from_dir(settings.model_dir).eos_token_id),
            input_addresses=tuple(self.run_dir.input_address(i) for i in range(count)),
            output_addresses=tuple(self.run_dir.output_address(i) for i in range(count)),
        )
        core = multiprocessing.get_context("spawn").Process(target=run_core, args=(config,), name="gpt2-engine-core")
        core.start()
        return core

    def _start_analysis(self) -> multiprocessing.process.BaseProcess:
        """Started beside the core. It says through a pipe when it has loaded and checked the
        weights, or why it cannot (a bad checkpoint): read by _check_analysis while the HTTP
        processes start, which wait for its readiness before serving."""
        context = multiprocessing.get_context("spawn")
        self.analysis_status, send = context.Pipe(duplex=False)
        config = process_config(self.settings, analysis_address(self.run_dir.path))
        analysis = context.Process(target=run_analysis, args=(config, send), name="gpt2-analysis")
        analysis.start()
        send.close()
        return analysis

    def _check_analysis(self, wait: float = 0.0) -> None:
        """A bad checkpoint stops the server in one line (CheckpointError); no HTTP process has
        served by then (each waits for the analysis process's Ready), so they are killed."""
        status = self.analysis_status
        if status is None or not (status.poll(wait) or not self.analysis.is_alive()):
            return
        try:
            failure = status.recv()
        except EOFError:
            failure = f"the analysis process exited (code {self.analysis.exitcode}) before loading the model"
        status.close()
        self.analysis_status = None
        if failure is not None:
            for worker in self.workers:
                worker.kill()
                worker.wait()
            self.workers = []  # so the core is not waited for: nobody will drain it
            raise CheckpointError(failure)

    def _start_worker(self, index: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "service.workers", str(self.run_dir.path), str(index), *self.argv]
        return subprocess.Popen(command, env=self.env, preexec_fn=_die_with(os.getpid()))

    def _watch(self) -> None:
        self._check_analysis()  # first: an HTTP process that failed for its reason exits soon after
        for index, worker in enumerate(self.workers):
            code = worker.poll()
            if code is None or self.stopping:
                continue
            if code < 0:
                log.error("HTTP process %d (pid %d) was killed by signal %d: restarting it", index, worker.pid, -code)
                self.workers[index] = self._start_worker(index)
            else:
                # The engine core, loading the same checkpoint, may have failed first: if the
                # analysis process is still loading, its message is the one to give.
                self._check_analysis(wait=ANALYSIS_VERDICT_S)
                log.error("HTTP process %d exited with code %d: stopping the server", index, code)
                self.exit_code = code or 1
                self._stop()

    def _stop(self, *_, forward: bool = True) -> None:
        """Every HTTP process drains as a lone server does on SIGTERM, and (seeing the flag) the core."""
        self.stopping = True
        self.run_dir.stopping_flag.touch()
        for worker in self.workers if forward else []:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)

    def _end_core(self) -> None:
        if self.core is None:
            return
        # With no HTTP process started (a start-up failure), nobody will tell it to drain.
        self.core.join(CORE_EXIT_GRACE_S if self.workers else 0)
        if self.core.is_alive():
            # No HTTP process is left to drain it (they crashed, or start-up failed).
            self.core.kill()
            self.core.join()


    def _end_analysis(self) -> None:
        # It ignores SIGTERM and holds nothing to flush: its answers' readers are gone.
        if self.analysis is not None and self.analysis.is_alive():
            self.analysis.kill()
        if self.analysis is not None:
            self.analysis.join()


def _die_with(parent: int):
    """For an HTTP process, before it runs: SIGTERM (a drain) when the supervisor dies, even by
    SIGKILL, so none is left listening on the port without its core. Linux's PR_SET_PDEATHSIG."""

    def arrange() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it died before the request took effect
            os._exit(1)

    return arrange


def supervise(settings: Settings, argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(levelname)s %(message)s")
    try:
        return Supervisor(settings, argv).run()
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        # As a lone server says it: one line, no traceback (the core's settings are checked here).
        sys.exit(f"cannot start: {exc}")


def worker_main(args: list[str]) -> None:
    run_path, index, *argv = args
    settings = serving_settings(argv)
    # The parent is still the supervisor here: had it died since this process was forked, its
    # death signal (SIGTERM, not yet handled by uvicorn) would have ended this process already.
    link = CoreLink(RunDir(Path(run_path), settings.api_server_count), int(index), supervisor_pid=os.getppid())
    run(settings, link)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
