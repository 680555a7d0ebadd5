"""The client side of bench_prefix's four workloads: the prompts they send (exact token counts from
seeded draws of single-token words, sized to the model's context), the HTTP requests each one makes
and what it measures, the comparison of two servers' multiple-choice scores, and each workload's
table rows with its goal. Servers, printing and the command line are bench/bench_prefix.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from bench.serve_clients import ClientStats, drive_clients, percentile, stream_one
from weights.tokenizer import GPT2Tokenizer

REFERENCE_CONTEXT = 1024  # the sizes below are for GPT-2's context
LOGPROB_TOLERANCE = 1e-4

# Common English words; those that are not one GPT-2 token with their leading space are dropped
# at start-up (usable_words), so a prompt of n words is n tokens.
WORDS = """
the of and to in is was for on that with as by at from his her it an are were be this which have
had not but they their one all been has more when who will would there can some out about into
only other new than then time after first also over two may years its most where many such made
before through back well could these them any same between under last being while long life
house world year under great school still state city water small part place home end high hand
old night day point group war order fact week name side head line case story money music book
river light power field game paper court party month table road earth voice reason heart girl
king army horse price stone garden market window summer winter morning letter island forest
country church doctor family friend father mother people problem question answer number color
""".split()


# --- prompts ------------------------------------------------------------------------------------
def usable_words(tokenizer: GPT2Tokenizer) -> list[str]:
    words = sorted({w for w in WORDS if len(tokenizer.encode(" " + w)) == 1})
    if len(words) < 50:
        raise SystemExit(f"only {len(words)} of the word list are single tokens for this tokenizer")
    return words


class Prompts:
    """Texts of an exact token count, from seeded draws of single-token words."""

    def __init__(self, tokenizer: GPT2Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.words = usable_words(tokenizer)

    def words_for(self, count: int, seed: str) -> list[str]:
        draw = random.Random(seed)
        return [draw.choice(self.words) for _ in range(count)]

    def text(self, tokens: int, seed: str) -> str:
        text = "".join(" " + w for w in self.words_for(tokens, seed))
        length = len(self.tokenizer.encode(text))
        if length != tokens:  # the words were chosen so this cannot happen; never time wrong sizes
            raise RuntimeError(f"a prompt meant to be {tokens} tokens is {length}")
        return text

    def ids(self, tokens: int, seed: str) -> list[int]:
        return self.tokenizer.encode(self.text(tokens, seed))


@dataclass
class Sizes:
    """Every workload's sizes, scaled to the model's context and cut to fit it."""

    n_positions: int
    mc_context: tuple[int, int]
    mc_continuation: tuple[int, int]
    repeat_tokens: int
    long_tokens: int
    long_new_tokens: int
    arrival_prompt: tuple[int, int]
    arrival_new_tokens: int
    fresh_tokens: tuple[int, int]
    fresh_new_tokens: int

    @classmethod
    def build(cls, args: argparse.Namespace, n_positions: int) -> "Sizes":
        scale = n_positions / REFERENCE_CONTEXT

        def scaled(n: int) -> int:
            return max(1, round(n * scale))

        cont = (args.mc_continuation[0], args.mc_continuation[1])
        # max_tokens=0 still runs one token (the prompt's scores come from a prefill that picks
        # one), so a scored prompt may use the context but for one position.
        mc_hi = min(scaled(args.mc_context[1]), n_positions - 1 - cont[1])
        mc_lo = min(scaled(args.mc_context[0]), mc_hi)
        arrival_new = min(args.arrival_new_tokens, n_positions - 16)
        long_new = min(args.long_new_tokens, n_positions // 4)
        fresh_new = min(args.fresh_new_tokens, n_positions // 4)
        fresh_hi = min(scaled(args.fresh_tokens[1]), n_positions - fresh_new)
        sizes = cls(
            n_positions=n_positions,
            mc_context=(mc_lo, mc_hi),
            mc_continuation=cont,
            repeat_tokens=min(scaled(args.repeat_tokens), n_positions - 1),
            long_tokens=min(scaled(args.long_tokens), n_positions - long_new),
            long_new_tokens=long_new,
            arrival_prompt=(8, 16),
            arrival_new_tokens=arrival_new,
            fresh_tokens=(min(scaled(args.fresh_tokens[0]), fresh_hi), fresh_hi),
            fresh_new_tokens=fresh_new,
        )
        if mc_lo < 1 or cont[0] < 1 or cont[0] > cont[1]:
            raise SystemExit(f"mc-scoring does not fit a {n_positions}-token context: {sizes}")
        if args.arrival_after >= arrival_new:
            raise SystemExit("--arrival-after must be below --arrival-new-tokens")
        return sizes

    @property
    def max_new_tokens(self) -> int:
        return max(self.long_new_tokens, self.arrival_new_tokens, self.fresh_new_tokens, 20)


async def check(response: httpx.Response) -> None:
    """Raise with the server's own message (a 422 names the field it refused)."""
    if response.status_code != 200:
        await response.aread()
        raise RuntimeError(f"{response.request.method} {response.request.url.path}: {response.status_code} {response.text[:1000]}")


# --- mc-scoring ---------------------------------------------------------------------------------
@dataclass
class Question:
    context: list[int]
    continuations: list[list[int]]


def mc_questions(prompts: Prompts, sizes: Sizes, count: int, choices: int) -> list[Question]:
    questions = []
    for q in range(count):
        draw = random.Random(f"mc-length-{q}")
        context = prompts.ids(draw.randint(*sizes.mc_context), f"mc-context-{q}")
        continuations = [prompts.ids(draw.randint(*sizes.mc_continuation), f"mc-choice-{q}-{c}") for c in range(choices)]
        questions.append(Question(context, continuations))
    return questions


async def score(http: httpx.AsyncClient, url: str, model: str, ids: list[int]) -> dict:
    """One lm-eval loglikelihood request: every prompt token's logprob and top alternative."""
    body = {"model": model, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    response = await http.post(f"{url}/v1/completions", json=body)
    await check(response)
    logprobs = response.json()["choices"][0]["logprobs"]
    if len(logprobs["token_logprobs"]) != len(ids):
        raise RuntimeError(f"{len(ids)} prompt tokens scored as {len(logprobs['token_logprobs'])}")
    return {"token_logprobs": logprobs["token_logprobs"], "top_logprobs": logprobs["top_logprobs"]}


async def mc_scoring(url: str, model: str, questions: list[Question], clients: int) -> dict:
    answers: dict[tuple[int, int], dict] = {}
    latency: dict[tuple[int, int], float] = {}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for q in range(len(questions)):
        queue.put_nowait(q)
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:

        async def client() -> None:
            while not queue.empty():
                q = queue.get_nowait()
                question = questions[q]
                for c, continuation in enumerate(question.continuations):  # one after another
                    sent = time.perf_counter()
                    answers[q, c] = await score(http, url, model, question.context + continuation)
                    latency[q, c] = time.perf_counter() - sent

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        seconds = time.perf_counter() - start
    requests = len(answers)
    loglikelihoods = [[sum(lp or 0.0 for lp in continuation_scores(question, answers[q, c])[0])
                       for c in range(len(question.continuations))] for q, question in enumerate(questions)]
    # The first choice of a question finds nothing cached; the others may find its context.
    first = [t for (q, c), t in latency.items() if c == 0]
    later = [t for (q, c), t in latency.items() if c > 0]
    return {"seconds": seconds, "requests": requests, "requests_per_s": requests / seconds,
            "first_choice_latency_p50_s": percentile(first, 0.5), "later_choice_latency_p50_s": percentile(later, 0.5),
            "loglikelihoods": loglikelihoods, "answers": answers}


def continuation_scores(question: Question, answer: dict) -> tuple[list, list[bool]]:
    """The continuation's logprobs, and per token whether it was the most likely (lm-eval's is_greedy)."""
    start = len(question.context)
    logprobs = answer["token_logprobs"][start:]
    tops = answer["top_logprobs"][start:]
    greedy = [lp is not None and top is not None and lp >= max(top.values()) for lp, top in zip(logprobs, tops)]
    return logprobs, greedy


def chosen(question: Question, answers: dict, q: int) -> int:
    """The choice with the highest continuation loglikelihood, as lm-eval's acc picks it."""
    sums = [sum(lp or 0.0 for lp in continuation_scores(question, answers[q, c])[0])
            for c in range(len(question.continuations))]
    return max(range(len(sums)), key=sums.__getitem__)


def mc_compare(questions: list[Question], a: dict, b: dict) -> dict:
    """A's scores against B's: continuation and whole-prompt max |difference|, missing logprobs
    (None past the first position, on either side), is_greedy flags and the chosen answers."""
    cont_diff = prompt_diff = 0.0
    missing = greedy_mismatch = answer_mismatch = 0
    for q, question in enumerate(questions):
        answer_mismatch += chosen(question, a["answers"], q) != chosen(question, b["answers"], q)
        for c in range(len(question.continuations)):
            answer_a, answer_b = a["answers"][q, c], b["answers"][q, c]
            (la, ga), (lb, gb) = continuation_scores(question, answer_a), continuation_scores(question, answer_b)
            cont_diff = max([cont_diff] + [abs(x - y) for x, y in zip(la, lb) if x is not None and y is not None])
            greedy_mismatch += ga != gb
            # Position 0 has no logprob (nothing comes before it); every other one must have one.
            for x, y in zip(answer_a["token_logprobs"][1:], answer_b["token_logprobs"][1:]):
                if x is None or y is None:
                    missing += 1
                else:
                    prompt_diff = max(prompt_diff, abs(x - y))
    return {"continuation_max_abs_diff": cont_diff, "prompt_max_abs_diff": prompt_diff, "missing_logprobs": missing,
            "greedy_flag_mismatches": greedy_mismatch, "answer_mismatches": answer_mismatch}


# --- repeated-prompt ----------------------------------------------------------------------------
async def repeated_prompt(url: str, text: str, warm: int) -> dict:
    ttft = []
    async with httpx.AsyncClient(timeout=600) as http:
        for _ in range(1 + warm):
            stats = ClientStats()
            await stream_one(http, url, text, 1, stats)
            ttft.append(stats.ttft[0])
    return {"cold_ttft_s": ttft[0], "warm_ttft_s": ttft[1:], "warm_ttft_median_s": statistics.median(ttft[1:])}


# --- long-arrival -------------------------------------------------------------------------------
async def token_times(http: httpx.AsyncClient, url: str, text: str, new_tokens: int):
    """POST /generate_stream (greedy, ignore_eos); yields each token event's arrival time."""
    body = {"inputs": text, "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}
    async with http.stream("POST", f"{url}/generate_stream", json=body) as response:
        await check(response)
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter()
            event = json.loads(line[5:])
            if "token" not in event:
                raise RuntimeError(f"unexpected event: {event}")
            yield now


async def long_arrival(url: str, short_texts: list[str], long_text: str, sizes: Sizes, after: int) -> dict:
    times: list[list[float]] = [[] for _ in short_texts]
    ready = asyncio.Event()
    limits = httpx.Limits(max_connections=len(short_texts) + 4, max_keepalive_connections=len(short_texts) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:

        async def stream(i: int) -> None:
            async for now in token_times(http, url, short_texts[i], sizes.arrival_new_tokens):
                times[i].append(now)
                if not ready.is_set() and all(len(t) >= after for t in times):
                    ready.set()

        async def long_prompt() -> tuple[float, float]:
            await asyncio.wait_for(ready.wait(), 600)
            sent, first = time.perf_counter(), None
            async for now in token_times(http, url, long_text, sizes.long_new_tokens):
                first = first or now
            return sent, first

        *_, (sent, first) = await asyncio.gather(*(stream(i) for i in range(len(short_texts))), long_prompt())

    gaps_all, gaps_window = [], []
    for stamps in times:
        for before, now in zip(stamps, stamps[1:]):
            gaps_all.append(now - before)
            if now > sent and before < first:  # the gap overlaps [sent, first]
                gaps_window.append(now - before)
    uncovered = sum(stamps[-1] < first for stamps in times)
    # One stream's token times around the window, relative to the send: where a stall sits.
    timeline = [round(t - sent, 4) for t in times[0] if t > sent - 0.25 and t < first + 0.25]
    return {
        "long_ttft_s": first - sent,
        "arrival_itl_p50_s": percentile(gaps_window, 0.5),
        "arrival_itl_p99_s": percentile(gaps_window, 0.99),
        "arrival_itl_max_s": max(gaps_window, default=float("nan")),
        "arrival_gaps": len(gaps_window),
        "run_itl_p50_s": percentile(gaps_all, 0.5),
        "run_itl_p99_s": percentile(gaps_all, 0.99),
        # Streams that ended before the long prompt's first token: the window saw fewer streams.
        "streams_done_before_first_token": uncovered,
        "stream0_token_times_from_send_s": timeline,
    }


# --- fresh-prompts ------------------------------------------------------------------------------
def fresh_prompts(url: str, texts: list[str], clients: int, per_client: int, new_tokens: int) -> dict:
    stats = asyncio.run(drive_clients(url, texts, clients, per_client, new_tokens))
    return {"tokens": stats.tokens, "seconds": stats.seconds, "tok_per_s": stats.tokens / stats.seconds,
            "ttft_p50_s": percentile(stats.ttft, 0.5), "itl_p50_s": percentile(stats.itl, 0.5),
            "itl_p99_s": percentile(stats.itl, 0.99)}


# --- all four -----------------------------------------------------------------------------------
def workload_inputs(prompts: Prompts, sizes: Sizes, args: argparse.Namespace) -> dict:
    """Every workload's prompts: the same on every server."""
    return {
        "questions": mc_questions(prompts, sizes, args.mc_questions, args.mc_choices),
        "repeat": prompts.text(sizes.repeat_tokens, "repeat"),
        "streams": [prompts.text(random.Random(f"arrival-length-{i}").randint(*sizes.arrival_prompt), f"arrival-{i}")
                    for i in range(args.arrival_streams)],
        "long": prompts.text(sizes.long_tokens, "long"),
        "fresh": [prompts.text(random.Random(f"fresh-length-{i}").randint(*sizes.fresh_tokens), f"fresh-{i}")
                  for i in range(args.fresh_clients * args.fresh_requests)],
    }


def run_workload(workload: str, url: str, model: str, inputs: dict, sizes: Sizes, args: argparse.Namespace) -> dict:
    """One workload against the server at url, on workload_inputs' prompts; what it measured."""
    if workload == "mc-scoring":
        return asyncio.run(mc_scoring(url, model, inputs["questions"], args.mc_clients))
    if workload == "repeated-prompt":
        return asyncio.run(repeated_prompt(url, inputs["repeat"], args.repeat_warm))
    if workload == "long-arrival":
        return asyncio.run(long_arrival(url, inputs["streams"], inputs["long"], sizes, args.arrival_after))
    if workload == "fresh-prompts":
        return fresh_prompts(url, inputs["fresh"], args.fresh_clients, args.fresh_requests, sizes.fresh_new_tokens)
    raise ValueError(workload)


# --- goals --------------------------------------------------------------------------------------
@dataclass
class Row:
    workload: str
    metric: str
    a: float | None
    b: float | None = None
    goal: str = ""
    met: bool | None = None
    ratio: float | None = field(default=None)

    def __post_init__(self) -> None:
        if self.ratio is None and self.a is not None and self.b:
            self.ratio = self.a / self.b

def rows_for(workload: str, a: dict, b: dict, extra: dict) -> list[Row]:
    ms = 1e3
    if workload == "mc-scoring":
        speed_up = a["requests_per_s"] / b["requests_per_s"]
        diff = extra["continuation_max_abs_diff"]
        exact = diff <= LOGPROB_TOLERANCE and extra["missing_logprobs"] == 0
        return [
            Row(workload, "wall seconds", a["seconds"], b["seconds"]),
            Row(workload, "requests/s", a["requests_per_s"], b["requests_per_s"], "A/B >= 3", speed_up >= 3),
            Row(workload, "1st choice latency ms (p50)", a["first_choice_latency_p50_s"] * ms,
                b["first_choice_latency_p50_s"] * ms),
            Row(workload, "2nd+ choice latency ms (p50)", a["later_choice_latency_p50_s"] * ms,
                b["later_choice_latency_p50_s"] * ms),
            Row(workload, "continuation logprob max |A-B|", diff, None, f"<= {LOGPROB_TOLERANCE:g}, none missing", exact),
            Row(workload, "prompt logprob max |A-B|", extra["prompt_max_abs_diff"], None),
            Row(workload, "logprobs missing (A or B)", extra["missing_logprobs"], None),
            Row(workload, "is_greedy flags differing", extra["greedy_flag_mismatches"], None),
            Row(workload, "chosen answers differing", extra["answer_mismatches"], None),
        ]
    if workload == "repeated-prompt":
        warm_a = a["warm_ttft_median_s"] / a["cold_ttft_s"]
        warm_b = b["warm_ttft_median_s"] / b["cold_ttft_s"]
        return [
            Row(workload, "cold TTFT ms", a["cold_ttft_s"] * ms, b["cold_ttft_s"] * ms),
            Row(workload, "warm TTFT ms (median)", a["warm_ttft_median_s"] * ms, b["warm_ttft_median_s"] * ms),
            Row(workload, "warm / cold TTFT", warm_a, warm_b, "A <= 0.10", warm_a <= 0.10),
        ]
    if workload == "long-arrival":
        spread = a["arrival_itl_p99_s"] / a["arrival_itl_p50_s"]
        return [
            Row(workload, "long prompt TTFT ms", a["long_ttft_s"] * ms, b["long_ttft_s"] * ms),
            Row(workload, "arrival ITL p50 ms", a["arrival_itl_p50_s"] * ms, b["arrival_itl_p50_s"] * ms),
            Row(workload, "arrival ITL p99 ms", a["arrival_itl_p99_s"] * ms, b["arrival_itl_p99_s"] * ms),
            Row(workload, "arrival ITL p99 / p50", spread, b["arrival_itl_p99_s"] / b["arrival_itl_p50_s"],
                "A <= 2", spread <= 2),
            Row(workload, "arrival ITL max ms (stall)", a["arrival_itl_max_s"] * ms, b["arrival_itl_max_s"] * ms),
            Row(workload, "run ITL p50 ms", a["run_itl_p50_s"] * ms, b["run_itl_p50_s"] * ms),
            Row(workload, "run ITL p99 ms", a["run_itl_p99_s"] * ms, b["run_itl_p99_s"] * ms),
        ]
    if workload == "fresh-prompts":
        ratio = a["tok_per_s"] / b["tok_per_s"]
        return [
            Row(workload, "tok/s", a["tok_per_s"], b["tok_per_s"], "A/B >= 0.95", ratio >= 0.95),
            Row(workload, "TTFT p50 ms", a["ttft_p50_s"] * ms, b["ttft_p50_s"] * ms),
            Row(workload, "ITL p50 ms", a["itl_p50_s"] * ms, b["itl_p50_s"] * ms),
        ]
    raise ValueError(workload)
