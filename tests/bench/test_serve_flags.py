"""bench_serve's servers take its options as `python -m service` flags (bench/serve_clients.py
`server_flags`): what the server's own parser then builds is what the benchmark asked for."""

from __future__ import annotations

import pytest

from bench.bench_serve import parse_args
from bench.serve_clients import server_flags
from service.app import core_config
from service.launch import parse_settings


@pytest.mark.parametrize(("option", "cached"), [([], True), (["--no-prefix-caching"], False)])
def test_the_prefix_cache_option_reaches_the_servers_engine(option, cached, tmp_path):
    # Every round serves the same prompts: with the cache on, later rounds reuse their blocks.
    args = parse_args(["--model-dir", str(tmp_path), "--clients", "16", *option])
    flags = server_flags(args, 16, prefix_caching=args.prefix_caching)
    assert ("--no-prefix-caching" in flags) is not cached
    assert core_config(parse_settings(flags), 64, 0).engine.prefix_caching is cached
