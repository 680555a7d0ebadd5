"""The one server lifecycle every served benchmark shares (bench/common.py ServiceProcess): a
server that will not start is reported with its own last log lines and is stopped, whichever
benchmark's subclass started it."""

from __future__ import annotations

from argparse import Namespace

import pytest

from bench.bench_prefix import PrefixServer, serving

pytestmark = pytest.mark.slow  # starts `python -m service`


class Refused:
    """A configuration the server's parser does not know, as an older checkout's would not."""

    def flags(self) -> list[str]:
        return ["--no-such-flag"]


def test_a_refused_flag_is_named_in_one_line_and_the_server_is_stopped(tiny_model_dir, capsys):
    args = Namespace(model_dir=tiny_model_dir, device="cpu", dtype="float32", threads=1)
    server = PrefixServer(args, slots=2, max_new_tokens=4, config=Refused())
    with pytest.raises(SystemExit, match=r"does not take --no-such-flag: .*unrecognized arguments: --no-such-flag"):
        with serving(server, "refused"):
            server.wait_ready()
    assert server.process.returncode == 2  # argparse's exit, read from the server's log by wait_ready
    assert server.log.closed
    assert "unrecognized arguments" in capsys.readouterr().err  # the log's tail, shown before stopping
    assert "--max-new-tokens 20" in " ".join(server.command)  # raised to the server's default_max_new_tokens
