"""A server whose device work is taken out: the real `python -m service` with the model's forward
and the sampler's draw replaced by stand-ins of negligible cost (bench/bench_host.py runs it).

    python -m bench.host_standin SERVICE_FLAGS...

What is replaced, in the engine core process only:
- the model's forwards (`GPT2.forward`, `GPT2.forward_packed`) and its LM head: they return zeros
  one column wide ([B, 1] logits: no vocabulary-wide tensor is made, gathered or copied);
- `choose_tokens` (model/sampling.py, as the core calls it): a token id made from each row's
  counter (varied ids, never EOS: the HTTP side detokenizes real text), log-probability 0, after
  a sleep of $STANDIN_DEVICE_MS (default 2 ms, about an H200's step at 256 rows): the device's
  time, which takes no host CPU but paces the steps as a device would, so streams overlap and
  the batch fills (without it a request's tokens are done before the next client has sent one).
What is not: everything else the core and the HTTP processes do per step (scheduling, the
index tensors and per-slot parameter tables, the device→host copy of a step's [B, 2] result,
postprocessing, IPC, detokenization, SSE). So its time is the host's share of a served step.
Left out with the device work: the kernels' launches (on a GPU each is a few µs of host time,
which CUDA graphs fold into one), any wait for the device, and every cost proportional to the
vocabulary (the logits gather, top-k alternatives, penalties' [B, V] masks).

`install(core, vocabulary=True)` (bench/host_core.py's mixed load) keeps what the features need
instead: the forwards return rows of one cached random [rows, V] tensor (a view per step: no
compute, no copy), so alternatives, grammar masks and beams' candidates see real [B, V] logits;
the draw's ids repeat with a period of PERIOD positions (so n-gram drafts find their loop and
stand), are never the vocabulary's last id (its EOS), and where a row's grammar forbids the id
(its logit is -inf) the row takes its best allowed token; a LoRA forward groups its rows by
adapter and builds the groups (`LoraRows.by_adapter`, `over_width`: the host's part of it). Meant for a model of a small
vocabulary (host_core.py's: V = 512, with GPT-2's first 511 tokens), since every vocabulary-wide
operation the device would run costs host CPU here.

With $STANDIN_GC_LOG set to a path, each process (HTTP, engine core) times its garbage
collections and writes them to PATH.http.json, PATH.gpt2-engine-core.json as it exits.

With $STANDIN_PROFILE set to a path, the engine core's loop and the HTTP process run under
cProfile timed by the process's CPU clock (waits for the device or the sockets count nothing)
and write their stats to PATH.core and PATH.http as they exit (`python -m pstats PATH.core`).

The stand-in is installed when this file is imported as the main module, which multiprocessing's
spawn also does in every child (as `__mp_main__`): that is how it reaches the engine core. It
needs only `service`, `model` and `torch`, so bench_host.py copies it next to another checkout
and runs that checkout's server through it (the before of a before-and-after).
"""

from __future__ import annotations

import os
import sys
import time

import torch

try:
    import service.engine.step_sampler as engine_sampler
except ModuleNotFoundError:  # a checkout from before the sampling stage left core.py (--against)
    import service.engine.core as engine_sampler
import service.engine.process as engine_process
from model.config import GPT2Config
from model.gpt2 import ForwardOutput

# Spreads consecutive counters over the vocabulary (ids below 50,000: plain BPE tokens, no EOS).
TOKEN_STRIDE = 7919
TOKEN_RANGE = 50_000
DEVICE_SECONDS = float(os.environ.get("STANDIN_DEVICE_MS", "2")) / 1e3
# The model served (one 64-wide layer, GPT-2's vocabulary and tokenizer): with the stand-ins its
# size changes nothing but the memory the KV cache takes.
TINY = GPT2Config(vocab_size=50257, n_positions=256, n_embd=64, n_layer=1, n_head=1)


def standin_forward(input_ids: torch.Tensor, *args, **kwargs) -> ForwardOutput:
    return ForwardOutput(logits=torch.zeros(input_ids.shape[0], input_ids.shape[1], 1))  # [B, T, 1]


def standin_forward_packed(input_ids: torch.Tensor, *args, **kwargs) -> ForwardOutput:
    return ForwardOutput(logits=None, head_input=torch.zeros(input_ids.shape[0], 1))  # [N, 1]


# With `install(core, vocabulary=True)`: the vocabulary's size (its last id is EOS), the period of
# the drawn ids, and the cached random logits the forwards hand out rows of.
VOCABULARY: int | None = None
PERIOD = 8
_LOGITS = torch.empty(0, 0)


def random_logits(rows: int, vocabulary: int) -> torch.Tensor:
    """The first `rows` rows of the cached random [rows, V] tensor (a view), grown when short."""
    global _LOGITS
    if _LOGITS.shape[0] < rows or _LOGITS.shape[1] != vocabulary:
        generator = torch.Generator().manual_seed(0)
        _LOGITS = torch.randn(max(rows, 2 * _LOGITS.shape[0], 1024), vocabulary, generator=generator)
    return _LOGITS[:rows]


def standin_ids(counter: torch.Tensor) -> torch.Tensor:
    """The stand-in's draw at each counter (the sequence's length at the draw), before any mask."""
    if VOCABULARY is None:
        return (counter * TOKEN_STRIDE) % TOKEN_RANGE
    return ((counter % PERIOD) * TOKEN_STRIDE) % (VOCABULARY - 1)


def standin_choose_tokens(logits: torch.Tensor, params, counter: torch.Tensor, seen=None):
    if DEVICE_SECONDS:  # sleep(0) still yields the CPU: under load, wall time the core never used
        time.sleep(DEVICE_SECONDS)
    tokens = standin_ids(counter)  # [B]
    if VOCABULARY is not None and logits.shape[0]:
        banned = torch.isneginf(logits.gather(1, tokens[:, None])[:, 0])  # a grammar forbids the id
        if banned.any():
            rows = banned.nonzero()[:, 0]
            tokens[rows] = logits[rows].argmax(dim=1)
    return tokens, torch.zeros(tokens.shape[0])


class VocabularyForwards:
    """The forwards of `install(core, vocabulary=True)`: random logits rows, and the count of
    forwards that carried adapter rows (`lora_forwards`: a LoRA mix can check its rows reached them)."""

    def __init__(self, vocabulary: int) -> None:
        self.vocabulary = vocabulary
        self.lora_forwards = 0

    def forward(self, input_ids: torch.Tensor, *args, lora=None, **kwargs) -> ForwardOutput:
        batch, width = input_ids.shape
        if lora is not None:  # the model's host part: its rows grouped by adapter once, then the groups
            self.lora_forwards += 1
            grouped = lora.by_adapter()
            lora = lora if grouped is None else grouped[2]
            lora.over_width(width, input_ids.device)
        return ForwardOutput(logits=random_logits(batch * width, self.vocabulary).view(batch, width, -1))  # [B, T, V]

    def forward_packed(self, input_ids: torch.Tensor, packing, cache, rows, kv_length, output_hidden_states=False,
                       one_query_per_call=False, lora=None) -> ForwardOutput:
        if lora is not None:  # as the model counts a packed row's tokens on a GPU
            self.lora_forwards += 1
            lora.over_tokens(torch.bincount(packing.index // packing.width, minlength=packing.batch).tolist(), input_ids.device)
        return ForwardOutput(logits=None, head_input=random_logits(input_ids.shape[0], self.vocabulary))  # [N, V]


def install(core, vocabulary: bool = False) -> VocabularyForwards | None:
    """`vocabulary`: logits as wide as the model's vocabulary (see the module's docstring)."""
    global VOCABULARY
    core.model.lm_head = lambda x: x  # forward_from's head over what forward_packed returned
    core.cache.homes = False  # a GPU's cache: reads gather, rows have no homes (model/kv_cache.py)
    if not vocabulary:
        core.model.forward = standin_forward
        core.model.forward_packed = standin_forward_packed
        return None
    VOCABULARY = core.model.config.vocab_size
    if core.eos_token_id != VOCABULARY - 1:
        raise ValueError(f"the stand-in draws ids below {VOCABULARY - 1}, taken as EOS; the core's is {core.eos_token_id}")
    forwards = VocabularyForwards(VOCABULARY)
    core.model.forward, core.model.forward_packed = forwards.forward, forwards.forward_packed
    return forwards


def _profiled(run, suffix: str):
    def run_profiled(*args, **kwargs):
        import cProfile

        profile = cProfile.Profile(time.process_time)
        try:
            return profile.runcall(run, *args, **kwargs)
        finally:
            profile.dump_stats(os.environ["STANDIN_PROFILE"] + suffix)
    return run_profiled


def _build_core_with_standin(config):
    core = _build_core(config)
    install(core)
    return core


def record_gc_pauses(path_prefix: str) -> None:
    """Time this process's garbage collections; at exit write PATH_PREFIX.<process>.json: per
    generation the count, total and longest seconds, and each oldest-generation pause (seconds
    since this was called, milliseconds, and the objects it left tracked: a count that keeps
    growing while serving is a leak)."""
    import atexit
    import gc
    import json
    import multiprocessing

    began, started = time.perf_counter(), [0.0]
    record = {"count": [0, 0, 0], "seconds": [0.0, 0.0, 0.0], "longest": [0.0, 0.0, 0.0], "full": []}

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        seconds, generation = time.perf_counter() - started[0], info["generation"]
        record["count"][generation] += 1
        record["seconds"][generation] += seconds
        record["longest"][generation] = max(record["longest"][generation], seconds)
        if generation == 2:
            record["full"].append((round(started[0] - began, 2), round(seconds * 1e3, 1), len(gc.get_objects())))

    def write() -> None:
        name = multiprocessing.current_process().name
        with open(f"{path_prefix}.{'http' if name == 'MainProcess' else name}.json", "w") as out:
            json.dump(record, out)

    gc.callbacks.append(timed)
    atexit.register(write)


if __name__ in ("__main__", "__mp_main__"):
    if os.environ.get("STANDIN_GC_LOG"):
        record_gc_pauses(os.environ["STANDIN_GC_LOG"])
    engine_sampler.choose_tokens = standin_choose_tokens
    _build_core = engine_process.build_core
    engine_process.build_core = _build_core_with_standin
    if os.environ.get("STANDIN_PROFILE"):
        engine_process.CoreLoop.run = _profiled(engine_process.CoreLoop.run, ".core")

if __name__ == "__main__":
    from service.__main__ import main

    if os.environ.get("STANDIN_PROFILE") or os.environ.get("STANDIN_GC_LOG"):
        import signal

        # uvicorn re-raises the SIGTERM it stopped on once it is done: exit, not die, so the
        # profile and the GC log are written.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        if os.environ.get("STANDIN_PROFILE"):
            main = _profiled(main, ".http")
    main()
