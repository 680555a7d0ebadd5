"""The engine core's IPC, measured: ZeroMQ + msgspec (what service/http/client.py uses) against
multiprocessing's Pipe with pickle, for one step's CoreOutput of 1, 32 and 256 tokens.

    .venv/bin/python -m bench.bench_ipc [--rounds 2000]

A child process echoes every message back (decoding and re-encoding it, as the two sides do);
printed is the median round trip per message and the bytes on the wire.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import statistics
import tempfile
import time

import zmq

from service.engine.protocol import CoreOutput, encoder, from_core
from service.engine.types import CoreStep, StepStats, StepTokens


def step_message(tokens: int) -> CoreOutput:
    rows = StepTokens([f"gen-{i:032x}" for i in range(tokens)], [0] * tokens, [1000 + i for i in range(tokens)],
                      [-1.25] * tokens)
    return CoreOutput(CoreStep(rows, [], [], [], StepStats(tokens, 0, tokens, tokens, 0, tokens, 256, 0.01)))


def zmq_echo(address_in: str, address_out: str) -> None:
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.connect(address_in)
    push.connect(address_out)
    while True:
        data = pull.recv()
        if data == b"stop":
            return
        push.send(encoder.encode(from_core.decode(data)))


def pipe_echo(connection) -> None:
    while True:
        data = connection.recv_bytes()
        if data == b"stop":
            return
        connection.send_bytes(pickle.dumps(pickle.loads(data)))


def round_trips(send, receive, rounds: int) -> float:
    """Median seconds of send-then-receive, after a tenth of the rounds as warm-up."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        send()
        receive()
        times.append(time.perf_counter() - start)
    return statistics.median(times[rounds // 10 :])


def time_zmq(message: CoreOutput, rounds: int) -> tuple[float, int]:
    folder = tempfile.mkdtemp()
    context = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    push.bind(f"ipc://{folder}/in")
    pull.bind(f"ipc://{folder}/out")
    pull.setsockopt(zmq.RCVTIMEO, 30_000)  # an echo that died raises zmq.Again rather than waiting forever
    child = multiprocessing.get_context("spawn").Process(target=zmq_echo, args=(f"ipc://{folder}/in", f"ipc://{folder}/out"))
    child.start()
    seconds = round_trips(lambda: push.send(encoder.encode(message)), lambda: from_core.decode(pull.recv()), rounds)
    push.send(b"stop")
    child.join()
    return seconds, len(encoder.encode(message))


def time_pipe(message: CoreOutput, rounds: int) -> tuple[float, int]:
    parent, child_end = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=pipe_echo, args=(child_end,))
    child.start()
    child_end.close()  # the child's is then the only one: if it dies, recv_bytes raises EOFError
    seconds = round_trips(lambda: parent.send_bytes(pickle.dumps(message)), lambda: pickle.loads(parent.recv_bytes()),
                          rounds)
    parent.send_bytes(b"stop")
    child.join()
    return seconds, len(pickle.dumps(message))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2000, help="round trips per message and transport")
    # Not bench.common's: the echo children re-import this module, and it would bring torch.
    parser.add_argument("--smoke", action="store_true", help="20 round trips each: the test suite's smoke run")
    args = parser.parse_args()
    rounds = 20 if args.smoke else args.rounds
    print(f"{'tokens':>6s} {'zmq+msgspec µs':>15s} {'bytes':>7s} {'Pipe+pickle µs':>15s} {'bytes':>7s}")
    for tokens in (1, 32, 256):
        message = step_message(tokens)
        zmq_s, zmq_bytes = time_zmq(message, rounds)
        pipe_s, pipe_bytes = time_pipe(message, rounds)
        print(f"{tokens:6d} {zmq_s * 1e6:15.1f} {zmq_bytes:7d} {pipe_s * 1e6:15.1f} {pipe_bytes:7d}")


if __name__ == "__main__":
    main()
