"""`python -m service`'s flags (pydantic-settings' CLI source): one per setting, spelled as
`--max-batch-size`, booleans as `--x` / `--no-x`, over GPT2_* variables; bad values exit 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.launch import parse_settings
from service.settings import Settings


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def exit_of(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as stopped:
        parse_settings(list(argv))
    out, err = capsys.readouterr()
    return stopped.value.code, out, err


def test_help_lists_every_setting_as_its_flag(capsys):
    code, out, _ = exit_of(capsys, "--help")
    assert code == 0
    for name, field in Settings.model_fields.items():
        spelled = flag(name) + (", --no-" + name.replace("_", "-") if field.annotation is bool else "")
        assert re.search(rf"^  {re.escape(spelled)}\b", out, re.MULTILINE), name


@pytest.mark.parametrize("name", [n for n, f in Settings.model_fields.items() if f.annotation is bool])
def test_booleans_are_flags_both_ways(name):
    assert getattr(parse_settings([flag(name)]), name) is True
    assert getattr(parse_settings(["--no-" + name.replace("_", "-")]), name) is False


def test_values_of_every_kind_are_read():
    settings = parse_settings(["--model-dir", "/models/x", "--port", "9001", "--threads", "2", "--dtype", "bfloat16",
                               "--drain-seconds", "2.5", "--api-key", "secret", "--allowed-hosts", "a.test,b.test",
                               "--model-name=with=equals"])
    assert settings.model_dir == Path("/models/x") and settings.port == 9001 and settings.threads == 2
    assert settings.dtype == "bfloat16" and settings.drain_seconds == 2.5
    assert settings.api_key.get_secret_value() == "secret" and settings.allowed_hosts == "a.test,b.test"
    assert settings.model_name == "with=equals"
    assert parse_settings([]) == Settings()


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--port", "0"], "port"),
        (["--port", "eighty"], "port"),
        (["--dtype", "int8"], "dtype"),
        (["--max-batch-size", "1.5"], "max_batch_size"),
        (["--speculative-ngram-min", "5", "--speculative-ngram-max", "2"], "speculative_ngram_min"),
        (["--no-such-flag", "1"], "--no-such-flag"),
        (["--threads"], "--threads"),
    ],
)
def test_bad_values_exit_2_naming_the_setting(capsys, argv, named):
    code, _, err = exit_of(capsys, *argv)
    assert code == 2 and named in err and "Traceback" not in err, err


def test_flags_override_environment_variables(monkeypatch):
    monkeypatch.setenv("GPT2_PORT", "9000")
    monkeypatch.setenv("GPT2_PREFIX_CACHING", "false")
    assert parse_settings([]).port == 9000 and parse_settings([]).prefix_caching is False
    settings = parse_settings(["--port", "9001", "--prefix-caching"])
    assert settings.port == 9001 and settings.prefix_caching is True
