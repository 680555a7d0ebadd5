"""bench/gpu_check.py's report as markdown: one table per part, every served figure beside the anchor."""

from __future__ import annotations


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" ---: " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def pair(values: list[float], fmt: str = ".1f") -> str:
    return " / ".join(format(v, fmt) for v in values)


def anchor_rates(parts: dict) -> dict[int, float]:
    anchor = parts.get("anchor", {})
    return {row["batch"]: row["tokens_per_s"] for row in anchor.get("result", {}).get("rows", [])}


def ratio(rate: float, anchor: float | None) -> str:
    return f"{rate / anchor:.2f}" if anchor else "-"


def lane(result: dict) -> str:
    text = (f"{result['passed']} passed, {result['failed']} failed, {result['errors']} errors, "
            f"{result['skipped']} skipped (pytest exit {result['exit_code']})")
    return text + "".join(f"\n- `{failure}`" for failure in result["failures"])


def anchor(result: dict) -> str:
    """The anchor's rows (gather attention), and beside them the paged kernel's on the same steps."""
    paged = {r["batch"]: r["tokens_per_s"] for r in result.get("paged_rows", [])}
    text = table(["batch", "tok/s", "ms per step", "keys read", "CUDA graph", "paged tok/s", "paged / gather"],
                 [[str(r["batch"]), f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_step']:.3f}", str(r["kv_length"]),
                   "yes" if r["graph"] else "no (eager)", f"{paged[r['batch']]:,.0f}" if r["batch"] in paged else "-",
                   ratio(paged[r["batch"]], r["tokens_per_s"]) if r["batch"] in paged else "-"] for r in result["rows"]])
    return text + (f"\n\nPaged attention: {result['paged_error']}" if "paged_error" in result else "")


def serve(result: dict, anchors: dict[int, float]) -> str:
    def clients(r: dict) -> str:
        return f"{r['clients']} ({r['client_processes']} processes)" if "client_processes" in r else str(r["clients"])

    rows = [[clients(r), f"{r['tokens_per_s']:,.0f}", f"{anchors.get(r['clients'], 0):,.0f}",
             ratio(r["tokens_per_s"], anchors.get(r["clients"])), pair(r["ttft_ms"], ".0f"), pair(r["itl_ms"]),
             f"{r['http_cpu_ms_per_token']:.3f}", f"{r['core_cpu_ms_per_token']:.3f}",
             f"{r['clients_cpu_cores']:.2f}" if "clients_cpu_cores" in r else "-"] for r in result["rows"]]
    header = ["clients", "served tok/s", "anchor tok/s", "served / anchor", "TTFT p50 / p99 ms", "ITL p50 / p99 ms",
              "HTTP CPU ms/token", "core CPU ms/token", "clients' CPU, cores"]
    interval = result.get("stream_interval", 1)
    writes = f" `--stream-interval {interval}`: a client's ITL is between events, {interval} per write." if interval != 1 else ""
    if "max_prefill_tokens" in result:
        writes += f" `--max-prefill-tokens {result['max_prefill_tokens']}`."
    return f"Server ready {result['startup_s']:.1f} s after launch.{writes}\n\n" + table(header, rows)


def api_servers(result: dict, anchors: dict[int, float]) -> str:
    rows = []
    for r in result["rows"]:
        gpu = r["gpu_processes"]
        gpu_text = "nvidia-smi unavailable" if gpu is None else f"{len(gpu)}: " + ", ".join(f"{g['mib']} MiB" for g in gpu)
        rows.append([str(r["api_servers"]), f"{r['startup_s']:.1f}", f"{r['tokens_per_s']:,.0f}",
                     ratio(r["tokens_per_s"], anchors.get(result["clients"])), pair(r["itl_ms"]),
                     f"{r['http_idle_cpu_percent']:.1f}", "-" if gpu is None else str(r["http_processes_on_gpu"]), gpu_text])
    header = ["HTTP processes", "ready after s", "tok/s", "served / anchor", "ITL p50 / p99 ms", "idle CPU % per HTTP process",
              "HTTP processes on the GPU", "GPU processes (nvidia-smi)"]
    text = f"{result['clients']} clients.\n\n" + table(header, rows)
    first, *others = result["rows"]
    for other in others:
        text += (f"\n\n--api-servers {other['api_servers']}: ready in {other['startup_s'] / first['startup_s']:.2f}x"
                 f" a lone server's time, {other['tokens_per_s'] / first['tokens_per_s']:.2f}x its tok/s.")
    return text


def grammar_mix(result: dict) -> str:
    rows = [[r["load"], str(r["round"]), str(r["tokens"]), f"{r['tokens_per_s']:,.0f}", pair(r["ttft_ms"], ".0f"), pair(r["itl_ms"]),
             f"{r['clients_cpu_cores']:.2f}"] for r in result["rows"]]
    header = ["load", "round", "tokens", "tok/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "clients' CPU, cores"]
    return (f"{result['clients']} clients, {result['share']} constrained in the mixed load. Mixed / free tok/s (mean of"
            f" the rounds): **{result['mixed_over_free']:.2f}** (goal: at least 0.9).\n\n" + table(header, rows))


def script(result: dict) -> str:
    return f"`{result['command']}`\n\n```\n{result['output'].strip()}\n```"


def quantize(result: dict) -> str:
    return table(["mode", "outcome", "detail"], [[r["mode"], r["outcome"], r["detail"].replace("|", "\\|")] for r in result["rows"]])


def markdown(report: dict) -> str:
    parts = {row["part"]: row for row in report["parts"]}
    anchors = anchor_rates(parts)
    out = [f"# GPU check, {report['date']}", "", report["machine"], "",
           f"{report['seconds']:.0f} s in all.", "",
           table(["part", "status", "seconds", "limit s", "what"],
                 [[r["part"], r["status"], f"{r['seconds']:.0f}", f"{r['limit_s']:.0f}", r["what"]] for r in report["parts"]])]
    render = {"lane": lane, "anchor": anchor, "serve": lambda r: serve(r, anchors), "stream-interval": lambda r: serve(r, anchors),
              "prefill-chunks": lambda r: serve(r, anchors),
              "serve-paged": lambda r: r["skipped"] if "skipped" in r else serve(r, anchors),
              "api-servers": lambda r: api_servers(r, anchors), "spectrum": script, "prefix": script,
              "speculative": script, "overlap": script, "xl-streams": script, "quantize": quantize, "grammar-mix": grammar_mix}
    for name, row in parts.items():
        out += ["", f"## {name}", ""]
        if row["status"] == "ok":
            out.append(render[name](row["result"]))
        else:
            out.append(f"**{row['status']}** after {row['seconds']:.0f} s (limit {row['limit_s']:.0f} s); the log's end:\n\n"
                       f"```\n{row['log_tail'].strip()}\n```")
    return "\n".join(out) + "\n"
