"""The engine core alone, in this process, with the device's work taken out: its host time per
row-step with N requests always running (bench/bench_host.py --core-only runs it per checkout).

    python -m bench.host_core --running 256 [--steps 400] [--overlap] [--profile 25]
    python -m bench.host_core --running 256 --mix all [--each]     # features beside the plain batch

The core is the product's EngineCore on a tiny model (one 64-wide layer, a vocabulary of
--vocabulary tokens: GPT-2's first ones and EOS), with bench/host_standin.py's stand-ins for the
forwards and the draw (`vocabulary=True`: random [rows, V] logits, so every feature runs; no
device sleep here: nothing paces the steps but the host). Requests of --new-tokens to 3x that
many new tokens, greedy, prompts of 5 to 44 tokens with varied first tokens, are replaced as they
end, so every step admits and finishes some (the churn of a loaded server: admission, packing
moves, prefix-cache lookups). A row-step is one sequence stepped once (a beam, a sequence
verifying a draft, a prompt chunk that completes). Printed as one JSON line: CPU time
(process_time) per row-step, per step, rows per step, and (over as many steps again, untimed) the
share of the steps that read their sampled rows in slot order, with no gathers
(StepRows.in_slot_order; null in a checkout without it). No HTTP, no IPC: bench_host.py's server
measures those. `--profile N`: also cProfile's N most expensive functions by their own time.

`--mix SPEC` (bench/host_mix.py: `all`, `grammar,beam`, `grammar=1/16,beam=1/64,...`): the mixed
workload (a share of the requests using each feature) beside the plain one in the same process,
each on its own core, their timed steps interleaved in --rounds chunks (so the machine's drift
falls on both), overlap on (as on CUDA). `--each`: first every feature alone at its share, each
beside a plain core of its own (two cores alive at a time, so the heap the garbage collector
walks is about a server's). Printed: a table (feature, share, host µs per row-step, the plain
core's beside it, the ratio of the two, the share of steps run with overlap on, rows per step,
what the feature's requests did; the plain row sums every plain core), then one JSON line. What the requests did is
read from the outputs of the warm-up steps (untimed): grammar requests' tokens accepted by their
grammar and steered by its mask, beam hypotheses returned, drafts that stood, alternatives on every
token, stops at the stop id, forwards with adapter rows; a feature whose requests show nothing
is marked NOT USED and the command exits 1.

The vocabulary-wide operations the device would run (masks applied, top-k, a beam's candidates,
the logits' concatenation) cost host CPU here, in proportion to --vocabulary (512: a [256, 512]
top-k is ~0.3 ms); llguidance's masks over 512 tokens cost less than over GPT-2's 50,257.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

os.environ["STANDIN_DEVICE_MS"] = "0"  # read by the stand-in at import

import torch

# Run by bench_host.py, this file, this checkout's stand-in and mix are copied to a folder of their
# own and run in each checkout compared (the same stand-in for all); the checkout's code is what
# they import. Run as `python -m bench.host_core`, they are this checkout's.
try:
    import gpt2_host_standin as standin
    import gpt2_host_mix as host_mix
except ModuleNotFoundError:
    import bench.host_standin as standin
    import bench.host_mix as host_mix
try:
    import service.engine.step_sampler as engine_sampler
except ModuleNotFoundError:  # a checkout from before the sampling stage left core.py
    import service.engine.core as engine_sampler
from model.config import GPT2Config
from service.engine.core import EngineConfig, EngineCore
from service.engine.types import GenerationRequest, SamplingParams

DEFAULT_VOCABULARY = 512


class Workload:
    """N requests always running on one core, each replaced as it ends; with a mix, a share of
    them using each feature (host_mix.py)."""

    def __init__(self, core: EngineCore, running: int, new_tokens: int, mix: dict | None = None,
                 grammar: str | None = None, record: bool = False, count_overlap: bool = False) -> None:
        """`record`: keep what the feature's requests do (`evidence`) from the start;
        `count_overlap`: count the steps run with overlap on (read from the core's internals)."""
        self.core, self.submitted, self.new_tokens = core, 0, new_tokens
        self.vocabulary = core.model.config.vocab_size
        self.assigner = host_mix.Assigner(mix) if mix else None
        self.grammar = grammar
        self.evidence = host_mix.Evidence() if record else None  # recording while set
        self.count_overlap = count_overlap
        self.submit(running)

    def submit(self, count: int) -> None:
        requests = []
        for _ in range(count):
            k = self.submitted = self.submitted + 1
            feature = self.assigner.next() if self.assigner is not None else None
            requests.append(self.request(k, feature))
        self.core.submit(requests)

    def request(self, k: int, feature: str | None) -> GenerationRequest:
        prompt = [1 + (k * 31 + j) % (self.vocabulary - 2) for j in range(5 + k % 40)]  # never EOS
        options: dict = {"max_new_tokens": self.new_tokens + (k * 37) % (2 * self.new_tokens), "ignore_eos": True}
        if self.core.config.speculative is not None:  # only the mix's n-gram requests draft
            options["speculate"] = feature == "ngram"
        extra, stop_id = {}, None  # (only what a feature needs: a checkout --against may lack the rest)
        if feature == "grammar":
            options |= {"grammar": self.grammar, "ignore_eos": False}
        elif feature == "beam":
            options["num_beams"] = host_mix.BEAMS
        elif feature == "ngram":  # the prompt ends in the stand-in's period: drafts from the first step
            prompt += [self.free_id(c) for c in range(len(prompt), len(prompt) + standin.PERIOD + 3)]
        elif feature == "top_logprobs":
            options["top_logprobs"] = host_mix.ALTERNATIVES
        elif feature == "stop_ids":  # drawn 2 to 8 tokens in, before max_new_tokens (the period's ids are distinct)
            stop_id = self.free_id(len(prompt) + 1 + k % (min(standin.PERIOD, self.new_tokens - 1) - 1))
            options["stop_token_ids"] = (stop_id,)
        elif feature == "lora":
            extra["adapter"] = host_mix.ADAPTER
        params = SamplingParams(**options)
        if feature is not None and self.evidence is not None:
            self.evidence.requests[f"r{k}"] = host_mix.Tracked(feature, len(prompt), params.max_new_tokens, stop_id)
        return GenerationRequest(f"r{k}", prompt, params, time.monotonic(), **extra)

    def free_id(self, counter: int) -> int:
        """The stand-in's draw at `counter` where no mask changes it."""
        return int(standin.standin_ids(torch.tensor([counter]))[0])

    def run(self, steps: int) -> tuple[int, int, int]:
        """(rows stepped, steps that ran, of which with the core's overlap on when counted)"""
        rows = overlapped = 0
        core, evidence, count_overlap = self.core, self.evidence, self.count_overlap
        for _ in range(steps):
            out = core.step()
            if count_overlap:
                overlapped += overlap_on(core)
            rows += out.stats.batch_size
            if evidence is not None:
                evidence.record(out)
            if ended := len(out.done) + len(out.failed):
                self.submit(ended)
        return rows, steps, overlapped

    def slot_order_share(self, steps: int) -> float | None:
        """The share of launched steps whose sampled rows were read in slot order."""
        orders: list[bool | None] = []
        core = self.core  # the sampler is the model runner's since the engine's split; the core's before
        sampler = core.runner.sampler if hasattr(core, "runner") else core.sampler
        launch = sampler.launch

        def recording(logits, rows, *rest, **options):
            orders.append(getattr(rows, "in_slot_order", None))
            return launch(logits, rows, *rest, **options)

        sampler.launch = recording
        try:
            self.run(steps)
        finally:
            sampler.launch = launch
        return None if not orders or None in orders else sum(orders) / len(orders)


def overlap_on(core: EngineCore) -> bool:
    """Whether the step just run left its tokens in flight, to be read after the next one launches
    (an older checkout's core keeps it as `_launched`)."""
    return core.running_ahead if hasattr(core, "running_ahead") else core._launched is not None


def build_core(running: int, overlap: bool, vocabulary: int = DEFAULT_VOCABULARY, features: frozenset = frozenset(),
               folder: Path | None = None) -> tuple[EngineCore, standin.VocabularyForwards]:
    """A core on the tiny model with the vocabulary stand-in installed, configured as a server
    would be for `features`: n-gram speculation on for `ngram` (every draft verified), the adapter
    loaded for `lora`, a grammar engine over the small tokenizer always."""
    from bench.common import write_random_model  # noqa: PLC0415 (the checkout's own)
    from weights.checkpoint import load_model  # noqa: PLC0415

    engine_sampler.choose_tokens = standin.standin_choose_tokens
    folder = folder or Path(tempfile.mkdtemp())
    model_dir = folder / "model"
    if not model_dir.exists():
        write_random_model(model_dir, GPT2Config(vocab_size=vocabulary, n_positions=256, n_embd=64, n_layer=1, n_head=1))
    options: dict = {}
    if "ngram" in features:
        from service.engine.ngram_drafter import NgramSettings  # noqa: PLC0415

        options["speculative"] = NgramSettings(weight_pass_rows=math.inf)
    if "lora" in features:
        options["adapters"] = ((host_mix.ADAPTER, str(host_mix.write_adapter(model_dir, folder / "adapters"))),)
    config = EngineConfig(max_slots=running, max_waiting=4 * running, overlap=overlap, **options)
    core = EngineCore(load_model(model_dir), vocabulary - 1, config, grammars=small_grammars(model_dir, vocabulary))
    return core, standin.install(core, vocabulary=True)


def small_grammars(model_dir: Path, vocabulary: int):
    """The core's grammar engine over GPT-2's tokenizer cut to `vocabulary` (host_mix.py)."""
    try:
        from service.engine.grammar import Grammars  # noqa: PLC0415
    except ModuleNotFoundError:  # a checkout from before constrained decoding
        return None
    text = host_mix.small_tokenizer_json((model_dir / "tokenizer.json").read_text(), vocabulary)
    return Grammars(lambda: text, vocabulary, vocabulary - 1)


def measure_plain(args: argparse.Namespace) -> None:
    core, _ = build_core(args.running, args.overlap, args.vocabulary)
    workload = Workload(core, args.running, args.new_tokens)
    workload.run(args.warmup_steps)
    started = time.process_time()
    rows, steps, _ = workload.run(args.steps)
    cpu = time.process_time() - started
    print(json.dumps({"running": args.running, "overlap": args.overlap, "us_per_row_step": cpu / max(rows, 1) * 1e6,
                      "ms_per_step": cpu / steps * 1e3, "rows_per_step": rows / steps,
                      "slot_order_share": workload.slot_order_share(args.steps)}), flush=True)
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(workload.run, args.steps)
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)


def measure_mix(args: argparse.Namespace, mix: dict) -> bool:
    """Each feature alone (--each) and the mix, each beside a plain workload of its own measured in
    the same interleaved rounds; prints the table and the JSON line. False when a feature's
    requests showed nothing of it, or a request failed."""
    folder = Path(tempfile.mkdtemp())
    variants: dict[str, dict] = {name: {name: share} for name, share in mix.items()} if args.each else {}
    if not args.each or len(mix) > 1:
        variants["all" if mix == host_mix.FEATURES else "mix"] = mix
    grammar = host_mix.person_grammar() if "grammar" in mix else None
    plain = Timing()
    results = []
    for name, shares in variants.items():
        timings = {"plain": Timing(), name: Timing()}
        pair = {"plain": build_core(args.running, True, args.vocabulary, folder=folder),
                name: build_core(args.running, True, args.vocabulary, frozenset(shares), folder)}
        workloads = {key: Workload(core, args.running, args.new_tokens, shares if key == name else None, grammar,
                                   record=key == name, count_overlap=True) for key, (core, _) in pair.items()}
        for workload in workloads.values():
            workload.run(args.warmup_steps)
        for round_ in range(args.rounds):
            chunk = args.steps // args.rounds + (round_ < args.steps % args.rounds)
            for key in (list(workloads) if round_ % 2 == 0 else list(reversed(workloads))):
                timings[key].add(workloads[key], chunk)
        plain.merge(timings["plain"])
        workload = workloads[name]
        if args.profile:  # the feature's core, after its timed steps: its own functions by own time
            profile = cProfile.Profile()
            profile.runcall(workload.run, args.steps)
            print(f"--- {name}", file=sys.stderr)
            pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)
        evidence = workload.evidence.summary(workload.free_id, grammar_check(workload.core, grammar), pair[name][1].lora_forwards)
        results.append(timings[name].result(name, shares) | {
            "ratio": timings[name].us_per_row_step / timings["plain"].us_per_row_step,
            "plain_us_per_row_step": timings["plain"].us_per_row_step,
            "evidence": {f: evidence[f] for f in shares}, "failed": len(workload.evidence.failed)})
        del pair, workloads, workload
        gc.collect()  # the next pair's heap holds no earlier core
    results.insert(0, plain.result("plain", {}) | {"ratio": 1.0, "evidence": {}, "failed": 0})
    for result in results:
        result["goal_met"] = host_mix.goal_met(result["ratio"], result["overlap_share"])
    print_table(results, args)
    print(json.dumps({"running": args.running, "overlap": True, "vocabulary": args.vocabulary, "rows": results}), flush=True)
    return all(f["used"] for r in results for f in r["evidence"].values()) and not any(r["failed"] for r in results)


class Timing:
    """A workload's timed steps: CPU seconds, rows, steps, steps with overlap on."""

    def __init__(self) -> None:
        self.cpu, self.rows, self.steps, self.overlapped = 0.0, 0, 0, 0

    def add(self, workload: Workload, steps: int) -> None:
        """Time `steps` steps of `workload`, its recording of evidence paused meanwhile."""
        workload.evidence, recorded = None, workload.evidence
        started = time.process_time()
        rows, steps, overlapped = workload.run(steps)
        self.cpu += time.process_time() - started
        self.rows, self.steps, self.overlapped = self.rows + rows, self.steps + steps, self.overlapped + overlapped
        workload.evidence = recorded

    def merge(self, other: "Timing") -> None:
        self.cpu, self.rows = self.cpu + other.cpu, self.rows + other.rows
        self.steps, self.overlapped = self.steps + other.steps, self.overlapped + other.overlapped

    @property
    def us_per_row_step(self) -> float:
        return self.cpu / max(self.rows, 1) * 1e6

    def result(self, feature: str, shares: dict) -> dict:
        return {"feature": feature, "shares": {f: str(s) for f, s in shares.items()}, "us_per_row_step": self.us_per_row_step,
                "ms_per_step": self.cpu / max(self.steps, 1) * 1e3, "rows_per_step": self.rows / max(self.steps, 1),
                "overlap_share": self.overlapped / max(self.steps, 1)}


def grammar_check(core: EngineCore, grammar: str | None):
    """Whether a fresh matcher of the mix's grammar accepts a request's tokens."""
    if grammar is None:
        return lambda tokens: True
    return lambda tokens: core.grammars.matcher(grammar).validate_tokens(tokens) == len(tokens)


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    print(f"core alone, {args.running} running, overlap on, {args.steps} timed steps each in {args.rounds} interleaved "
          f"rounds beside a plain core's, vocabulary {args.vocabulary}; goal: at most {host_mix.GOAL_RATIO}x plain with "
          f"overlap on at every step")
    print(f"{'feature':<13s} {'share':>6s} {'µs/row-step':>12s} {'plain beside':>13s} {'x plain':>8s} {'overlap on':>11s}"
          f" {'rows/step':>10s} {'goal':>5s}  what its requests did")
    for result in results:
        shares = result["shares"]
        share = next(iter(shares.values())) if len(shares) == 1 else ("-" if not shares else "mix")
        did = "; ".join(f"{f}: {host_mix.evidence_text(f, facts)}" for f, facts in result["evidence"].items())
        goal = "" if result["feature"] == "plain" else ("yes" if result["goal_met"] else "no")
        beside = f"{result['plain_us_per_row_step']:13.2f}" if "plain_us_per_row_step" in result else f"{'-':>13s}"
        print(f"{result['feature']:<13s} {share:>6s} {result['us_per_row_step']:12.2f} {beside} {result['ratio']:7.2f}x"
              f" {result['overlap_share']:10.0%} {result['rows_per_step']:10.1f} {goal:>5s}  {did}"
              + (f"  ({result['failed']} requests FAILED)" if result["failed"] else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup-steps", type=int, default=300, help="reach the churn's steady state first")
    parser.add_argument("--new-tokens", type=int, default=64, help="requests want this to 3x this many tokens")
    parser.add_argument("--vocabulary", type=int, default=DEFAULT_VOCABULARY, help="the tiny model's (at least 258)")
    parser.add_argument("--overlap", action="store_true", help="the core's overlap on (as on CUDA); always with --mix")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--mix", default=None, metavar="SPEC", help="all | grammar,beam | grammar=1/16,beam=1/64,...")
    parser.add_argument("--each", action="store_true", help="--mix: also every feature of the mix alone")
    parser.add_argument("--rounds", type=int, default=4, help="--mix: the timed steps in this many interleaved chunks")
    args = parser.parse_args(argv)
    if args.vocabulary < 258 or args.new_tokens < 3 or args.rounds < 1 or args.steps < args.rounds:
        parser.error("--vocabulary is at least 258 (256 bytes, a merge, EOS), --new-tokens at least 3, "
                     "--rounds at least 1 and at most --steps")
    try:
        mix = host_mix.parse_mix(args.mix) if args.mix is not None else None
    except ValueError as exc:
        parser.error(str(exc))
    if mix is not None and args.running < 2 * host_mix.BEAMS:
        parser.error(f"--mix runs at least {2 * host_mix.BEAMS} requests (a beam search holds {host_mix.BEAMS} slots)")
    torch.set_num_threads(1)
    if mix is None:
        measure_plain(args)
        return 0
    return 0 if measure_mix(args, mix) else 1


if __name__ == "__main__":
    sys.exit(main())
