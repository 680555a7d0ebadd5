"""LoRA adapters as clients get them: one server with N adapters, streaming clients spread over the
adapters against the same number of clients on the base model, in the same run.

    .venv/bin/python -m bench.bench_lora                       # 16 clients, 4 adapters of rank 16, CPU fp32
    .venv/bin/python -m bench.bench_lora --adapters weights/lora-poems weights/lora-comedies
    .venv/bin/python -m bench.bench_lora --smoke                # seconds, measures nothing

One `python -m service` with `--lora a0=DIR ... ` (each adapter on every product: c_attn, both
c_proj, c_fc; random A and B unless --adapters names folders), then alternating rounds: --clients
streams on the base model (TGI /generate_stream, greedy, ignore_eos, --new-tokens each), and
--clients streams where client i names adapter i mod N (`adapter_id`). Printed: tokens/s of each
(best round), their ratio (the goal: at least 0.9), time to first token; and the memory a
resident adapter takes in the engine (its own A and B, from model/lora.py) against the base's weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from bench.serve_clients import ClientStats, percentile, prompt_texts, stream_ids
from bench.common import ServiceProcess, add_server_arguments, add_smoke_argument, describe_machine, service_flags
from model.lora import LoraSet
from model.lora_format import adapter_config, site_shapes, write_adapter
from weights.checkpoint import load_config, load_model

TARGETS = ["c_attn", "c_proj", "c_fc"]


def random_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """`count` peft folders for the model, every product adapted, A and B random (seeded)."""
    config = load_config(model_dir)
    shapes = {f"h.{layer}.{module}": shape for layer in range(config.n_layer) for module, shape in site_shapes(config).items()}
    folders = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        sites = {site: (torch.randn(rank, fan_in, generator=generator) * 0.02, torch.randn(fan_out, rank, generator=generator) * 0.02)
                 for site, (fan_in, fan_out) in shapes.items()}
        folders.append(write_adapter(out / f"a{index}", sites, adapter_config(rank, 2.0 * rank, TARGETS)))
    return folders


async def drive(url: str, texts: list[str], adapters: list[str | None], new_tokens: int) -> ClientStats:
    """One stream per entry of `adapters` (None: the base model), all at once."""
    stats = ClientStats()
    limits = httpx.Limits(max_connections=len(adapters) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        async def client(index: int, adapter: str | None) -> None:
            parameters = {"max_new_tokens": new_tokens, "ignore_eos": True}
            if adapter is not None:
                parameters["adapter_id"] = adapter
            await stream_ids(http, url, {"inputs": texts[index % len(texts)], "parameters": parameters}, stats)

        start = time.perf_counter()
        await asyncio.gather(*(client(i, a) for i, a in enumerate(adapters)))
        stats.seconds = time.perf_counter() - start
    return stats


def resident_bytes(model_dir: Path, folder: Path) -> tuple[int, int]:
    """(one adapter's resident bytes, the base model's parameter bytes)."""
    model = load_model(model_dir)
    adapters = LoraSet(model)
    adapters.load("one", folder)
    return adapters.nbytes("one"), sum(p.numel() * p.element_size() for p in model.parameters())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser, Path("weights/gpt2"), ("spread",))
    add_smoke_argument(parser)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--count", type=int, default=4, help="random adapters to make (without --adapters)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=Path, nargs="+", help="peft folders to serve instead of random ones")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.clients, args.count, args.rank, args.new_tokens, args.rounds = 4, 2, 4, 4, 1
    print(f"{describe_machine()}; {args.model_dir} on {args.device} {args.dtype}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folders = args.adapters or random_adapters(args.model_dir, Path(tmp), args.count, args.rank)
        names = [f"a{i}" for i in range(len(folders))]
        flags = service_flags(args, args.clients, args.new_tokens)
        for name, folder in zip(names, folders):
            flags += ["--lora", f"{name}={folder}"]
        texts = prompt_texts(args.clients, 8)
        spread = [names[i % len(names)] for i in range(args.clients)]
        best: dict[str, ClientStats] = {}
        with ServiceProcess(flags) as server:
            server.wait_ready()
            asyncio.run(drive(server.url, texts, [None, *names], 2))  # first-request costs are not throughput
            for _ in range(args.rounds):  # alternating, so a change in load shows as a ratio
                for label, adapters in (("base", [None] * args.clients), ("adapters", spread)):
                    stats = asyncio.run(drive(server.url, texts, adapters, args.new_tokens))
                    if label not in best or stats.tokens / stats.seconds > best[label].tokens / best[label].seconds:
                        best[label] = stats
        own, base = resident_bytes(args.model_dir, folders[0])
    rate = {label: s.tokens / s.seconds for label, s in best.items()}
    ratio = rate["adapters"] / rate["base"]
    print(f"{args.clients} clients, {args.new_tokens} new tokens each, {len(folders)} adapters")
    print(f"{'clients on':>20} {'tok/s':>9} {'TTFT p50 ms':>12} {'inter-token p50 ms':>19}")
    for label, stats in best.items():
        print(f"{label:>20} {rate[label]:9.1f} {percentile(stats.ttft, .5) * 1e3:12.1f} {percentile(stats.itl, .5) * 1e3:19.1f}")
    print(f"adapters / base: {ratio:.2f} (goal >= 0.9: {'met' if ratio >= 0.9 else 'NOT met'})")
    print(f"one resident adapter: {own / 1e6:.2f} MB (its A and B), the base's weights {base / 1e6:.1f} MB")
    if args.json:
        args.json.write_text(json.dumps({"tokens_per_s": rate, "ratio": ratio, "adapter_bytes": own, "base_bytes": base}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
