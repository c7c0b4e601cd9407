"""The command line (CONTRACT.md section 1): ``parse_args`` is a pure function of argv."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from huggingfaceserver.backends import vllm_installed
from huggingfaceserver.cli import (
    API_KEY_ENV,
    CACHE_ENV,
    OPENAI_PREFIX_ENV,
    KServeFlags,
    ServerConfig,
    build_parser,
    flag_fields,
    parse_args,
)
from huggingfaceserver.tasks import Task

REPO = Path(__file__).resolve().parent.parent

CONTRACT_DEFAULTS = {
    "model_name": "model",
    "model_dir": "/mnt/models",
    "model_id": None,
    "model_revision": None,
    "tokenizer_revision": None,
    "dtype": "auto",
    "task": None,
    "backend": "auto",
    "max_length": None,
    "disable_lower_case": False,
    "disable_special_tokens": False,
    "trust_remote_code": False,
    "tensor_input_names": None,
    "return_token_type_ids": False,
    "return_probabilities": False,
    "return_raw_logits": False,
    "return_offsets_mapping": False,
    "return_labels": False,
    "disable_log_requests": False,
}
"""The defaults CONTRACT.md section 1 lists: what deployments rely on."""

KSERVE_DEFAULTS = {
    "http_port": 8080,
    "grpc_port": 8081,
    "enable_grpc": True,
    "workers": 1,
    "predictor_protocol": "v1",
    "predictor_host": None,
}

# field -> (the value given on the command line, what the config holds); None: a switch
OWN_FLAGS = {
    "model_name": ("bert", "bert"),
    "model_dir": ("/models/bert", "/models/bert"),
    "model_id": ("org/name", "org/name"),
    "model_revision": ("v1", "v1"),
    "tokenizer_revision": ("v2", "v2"),
    "dtype": ("bfloat16", "bfloat16"),
    "task": ("fill_mask", Task.fill_mask),
    "backend": ("huggingface", "huggingface"),
    "quantize": ("int8", "int8"),
    "max_length": ("64", 64),
    "disable_lower_case": (None, True),
    "disable_special_tokens": (None, True),
    "trust_remote_code": (None, True),
    "tensor_input_names": ("input_ids", ("input_ids",)),
    "return_token_type_ids": (None, True),
    "return_probabilities": (None, True),
    "return_raw_logits": (None, True),
    "return_offsets_mapping": (None, True),
    "return_labels": (None, True),
    "disable_log_requests": (None, True),
    "max_log_len": ("100", 100),
    "chat_template": ("{{ messages }}", "{{ messages }}"),
    "max_batch_tokens": ("4096", 4096),
    "max_batch_size": ("8", 8),
    "batch_wait_ms": ("5", 5.0),
    "prefill_chunk_tokens": ("64", 64),
    "enforce_eager": (None, True),
    "torch_compile": (None, True),
    "enable_runtime_lora": (None, True),
    "lora_adapter_dir": ("/adapters", "/adapters"),
    "api_workers": ("3", 3),
    "log_format": ("json", "json"),
    "enable_model_repository": (None, True),
    "max_concurrent_requests": ("64", 64),
    "max_request_bytes": ("1024", 1024),
    "max_inputs_per_request": ("8", 8),
    "no_truncation": (None, True),
    "default_prompt_name": ("query", "query"),
    "default_prompt": ("query: ", "query: "),
    "trust_request_chat_template": (None, True),
    "enable_auto_tool_choice": (None, True),
    "tool_call_parser": ("hermes", "hermes"),
    "reasoning_parser": ("qwen3", "qwen3"),
    "request_timeout_seconds": ("2.5", 2.5),
    "max_concurrent_predictor_calls": ("4", 4),
    "request_read_timeout_seconds": ("5", 5.0),
    "shutdown_grace_seconds": ("10", 10.0),
    "api_key": ("s3cret", "s3cret"),
    "allowed_origins": (
        "https://a.example, https://b.example",
        ("https://a.example", "https://b.example"),
    ),
}


def config_flags() -> list[dataclasses.Field]:
    """The config fields that are flags of ours (``--model_name`` is KServe's)."""
    return [f for f in dataclasses.fields(ServerConfig) if "help" in f.metadata]


def value_type(annotation: object) -> object:
    """``int`` for ``int | None``; ``tuple[str, ...]`` for itself."""
    if typing.get_origin(annotation) is types.UnionType:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation


def compact(text: str) -> str:
    """Text without its whitespace, wherever ``--help`` wrapped it."""
    return "".join(text.split())


def spellings_of(field: str) -> list[str]:
    return list(dict.fromkeys([f"--{field}", "--" + field.replace("_", "-")]))


def run_main(*args: str) -> subprocess.CompletedProcess:
    """``python -m huggingfaceserver ARGS`` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "huggingfaceserver", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def usage_error(capsys: pytest.CaptureFixture[str]) -> str:
    """The ``huggingfaceserver: error: ...`` line argparse writes after the usage text."""
    line = last_line(capsys.readouterr().err)
    assert line.startswith("huggingfaceserver: error: ")
    return line


def test_defaults_match_the_contract():
    config = parse_args([])
    assert {name: getattr(config, name) for name in CONTRACT_DEFAULTS} == CONTRACT_DEFAULTS
    assert config.engine_flags == {}


def test_parser_defaults_types_and_choices_are_the_config_fields():
    parser = argparse.ArgumentParser()
    actions = ServerConfig.add_cli_args(parser)
    hints = typing.get_type_hints(ServerConfig)
    assert set(actions) == {f.name for f in config_flags()}
    for f in config_flags():
        action, meta = actions[f.name], f.metadata
        spellings = [s for name in (f.name, *meta["aliases"]) for s in spellings_of(name)]
        assert action.option_strings == spellings, f.name
        assert action.dest == f.name
        assert action.default == parser.get_default(f.name) == f.default, f.name
        assert action.choices == meta.get("choices"), f.name
        assert action.help == meta["help"], f.name
        if hints[f.name] is bool:  # a switch
            assert (action.nargs, action.const) == (0, True), f.name
        else:
            assert action.type is meta.get("type", value_type(hints[f.name])), f.name


def test_parsed_values_have_the_config_fields_types():
    defaults = parse_args([])
    for f in dataclasses.fields(ServerConfig):
        if f.metadata:
            assert getattr(defaults, f.name) == f.default, f.name
    for name, (given, _) in OWN_FLAGS.items():
        argv = [f"--{name}"] if given is None else [f"--{name}", given]
        value = getattr(parse_args(argv + COMPANIONS.get(name, [])), name)
        expected = value_type(typing.get_type_hints(ServerConfig)[name])
        assert isinstance(value, typing.get_origin(expected) or expected), name


@pytest.mark.parametrize(
    "field", [f for f in config_flags() if "choices" in f.metadata], ids=lambda f: f.name
)
def test_choice_flags_take_each_choice_and_nothing_else(field, capsys):
    for choice in field.metadata["choices"]:
        assert getattr(parse_args([f"--{field.name}", choice]), field.name) == choice
    with pytest.raises(SystemExit) as exit_info:
        parse_args([f"--{field.name}", "no-such-choice"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'no-such-choice'" in usage_error(capsys)


def test_help_lists_every_field_with_its_help_and_default():
    result = run_main("--help")
    assert result.returncode == 0, result.stderr
    options = result.stdout.split("\noptions:\n", 1)[1]
    entries = {
        entry.split()[0].rstrip(","): compact(entry)
        for entry in re.split(r"\n(?=  -)", "\n" + options)
        if entry.strip()
    }
    for f in config_flags():
        entry = entries[f"--{f.name}"]
        assert compact(f.metadata["help"]) in entry, f.name
        assert compact(f"(default: {f.default})") in entry, f.name
        for alias in f.metadata["aliases"]:
            assert f"--{alias}" in entry, f.name
    assert compact(f"(default: {ServerConfig.model_name})") in entries["--model_name"]


def test_kserve_flags_keep_their_kserve_defaults():
    server = parse_args([]).server
    assert {name: getattr(server, name) for name in KSERVE_DEFAULTS} == KSERVE_DEFAULTS


def test_every_config_field_has_a_flag_in_the_table_below():
    assert set(OWN_FLAGS) == set(flag_fields())


COMPANIONS = {"enable_auto_tool_choice": ["--tool-call-parser", "hermes"]}
"""Flags a flag needs beside it."""


@pytest.mark.parametrize("field", sorted(OWN_FLAGS))
def test_own_flags_accept_both_spellings_and_the_equals_form(field):
    given, expected = OWN_FLAGS[field]
    for flag in spellings_of(field):
        forms = [[flag]] if given is None else [[flag, given], [f"{flag}={given}"]]
        for argv in forms:
            argv += COMPANIONS.get(field, [])
            assert getattr(parse_args(argv), field) == expected, argv


def test_an_unknown_reasoning_parser_lists_the_supported_ones(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--reasoning-parser", "openai_gptoss"])  # harmony: not plain markers
    error = capsys.readouterr().err
    assert exited.value.code == 2 and "invalid choice: 'openai_gptoss'" in error
    assert all(name in error for name in ("deepseek_r1", "qwen3"))


def test_auto_tool_choice_needs_a_known_parser(capsys):
    for argv, says in [
        (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
        (["--tool-call-parser", "pythonic-ish"], "invalid choice"),
    ]:
        with pytest.raises(SystemExit) as exited:
            parse_args(argv)
        assert exited.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "name", "expected"),
    [
        (["--http_port", "9000"], "http_port", 9000),
        (["--http-port", "9000"], "http_port", 9000),
        (["--http-port=9000"], "http_port", 9000),
        (["--grpc-port", "9001"], "grpc_port", 9001),
        (["--event-loop", "asyncio"], "event_loop", "asyncio"),
        (["--event_loop", "asyncio"], "event_loop", "asyncio"),
        (["--event_loop=uvloop"], "event_loop", "uvloop"),
        (["--max_threads", "2"], "max_threads", 2),
        (["--max-threads", "2"], "max_threads", 2),
        (["--timeout_keep_alive", "3"], "timeout_keep_alive", 3),
        (["--enable-grpc", "false"], "enable_grpc", False),
        (["--enable_docs_url", "true"], "enable_docs_url", True),
        (["--predictor-host", "bert:8080"], "predictor_host", "bert:8080"),
        (["--predictor_protocol", "grpc-v2"], "predictor_protocol", "grpc-v2"),
        (["--predictor-protocol=v2"], "predictor_protocol", "v2"),
        (["--enable-predictor-health-check"], "enable_predictor_health_check", True),
    ],
)
def test_kserve_flags_accept_both_spellings(argv, name, expected):
    assert getattr(parse_args(argv).server, name) == expected


@pytest.mark.parametrize(
    "flag", ["--max_length", "--max-length", "--max_model_len", "--max-model-len"]
)
def test_max_model_len_is_an_alias_of_max_length(flag):
    assert parse_args([flag, "256"]).max_length == 256
    assert parse_args([f"{flag}=256"]).max_length == 256


@pytest.mark.parametrize("value", ["fill-mask", "fill_mask", "Fill-Mask"])
def test_task_flag_parses_to_the_task(value):
    assert parse_args(["--task", value]).task is Task.fill_mask


def test_unknown_task_exits_2_naming_the_value(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--task", "summarize_everything"])
    assert exit_info.value.code == 2
    error = usage_error(capsys)
    assert "summarize_everything" in error
    assert "fill_mask" in error


def test_probabilities_and_raw_logits_are_exclusive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--return_probabilities", "--return-raw-logits"])
    assert exit_info.value.code == 2
    error = usage_error(capsys)
    assert "--return_probabilities" in error
    assert "--return_raw_logits" in error


def test_torch_compile_and_enforce_eager_are_exclusive(capsys):
    """One compiles the decode steps, the other runs them eagerly."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--enforce-eager", "--torch_compile"])
    assert exit_info.value.code == 2
    error = usage_error(capsys)
    assert "--torch_compile" in error and "--enforce_eager" in error


def test_unknown_flag_exits_2_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model_dir", "/models/bert", "--no_such_flag", "3"])
    assert exit_info.value.code == 2
    assert re.search(r"unrecognized arguments: --no[-_]such[-_]flag$", usage_error(capsys))


def test_unknown_flag_is_named_as_the_user_typed_it(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--no_such_flag", "3"])
    assert "--no_such_flag" in usage_error(capsys)


def test_abbreviated_flags_are_not_guessed(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model_d", "/models/bert"])
    assert exit_info.value.code == 2
    assert re.search(r"unrecognized arguments: --model[-_]d$", usage_error(capsys))


@pytest.mark.parametrize("argv", [["stray"], ["stray", "--model_dir", "/models/bert"]])
def test_stray_positional_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert "stray" in usage_error(capsys)


def test_vllm_engine_flags_are_kept_with_their_values():
    config = parse_args(
        [
            "--max-num-seqs",
            "8",
            "--model_dir",
            "/models/llama",
            "--enforce-eager",
            "--gpu_memory_utilization",
            "0.5",
            "--speculative-config",
            '{"x":1}',
            "--seed=-1",
        ]
    )
    assert config.model_dir == "/models/llama"
    assert config.enforce_eager  # ours, passed on to vLLM (test_engine_args)
    assert config.engine_flags == {
        "max-num-seqs": ["8"],
        "gpu-memory-utilization": ["0.5"],
        "speculative-config": ['{"x":1}'],
        "seed": ["-1"],
    }


def test_engine_flags_are_those_the_caller_names(capsys):
    assert parse_args(["--my-flag", "1"], frozenset({"my-flag"})).engine_flags == {"my-flag": ["1"]}
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--max-num-seqs", "8"], frozenset())
    assert exit_info.value.code == 2
    assert "--max-num-seqs" in usage_error(capsys)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], None),
        (["--async-scheduling"], True),
        (["--no_async_scheduling"], False),
    ],
)
def test_async_scheduling_is_vllms_switch(argv, expected):
    """vLLM's switch, kept as an engine flag and read by the transformers backend too."""
    assert parse_args(["--model_dir", "/models/llama", *argv]).async_scheduling is expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--async-scheduling", "false"], "--async-scheduling takes no value"),
        (["--no-async-scheduling=1"], "--no-async-scheduling takes no value"),
        (
            ["--async-scheduling", "--no-async-scheduling"],
            "--async-scheduling and --no-async-scheduling: give one",
        ),
    ],
)
def test_async_scheduling_with_a_value_or_its_negation_exits_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model_dir", "/models/llama", *argv])
    assert exit_info.value.code == 2
    assert message in usage_error(capsys)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], None),
        (["--kv-cache-memory-bytes", "2G"], 2 << 30),
        (["--kv_cache_memory_bytes=2.5g"], 2_500_000_000),
        (["--kv-cache-memory-bytes", "1048576"], 1 << 20),
    ],
)
def test_kv_cache_memory_bytes_is_vllms_size(argv, expected):
    """vLLM's flag, in vLLM's units (upper case binary, lower case decimal), kept as an engine
    flag and read by the transformers backend too."""
    config = parse_args(["--model_dir", "/models/llama", *argv])
    assert config.kv_cache_memory_bytes == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("lots", "'lots' is not a size"),
        ("1.5G", "no decimals with a binary suffix"),
        ("0", "must be more than 0 bytes"),
    ],
)
def test_a_kv_cache_memory_bytes_that_is_no_size_exits_2(value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model_dir", "/models/llama", "--kv-cache-memory-bytes", value])
    assert exit_info.value.code == 2
    assert message in usage_error(capsys)


def test_tensor_input_names_is_a_tuple():
    config = parse_args(["--tensor_input_names", "input_ids, attention_mask,"])
    assert config.tensor_input_names == ("input_ids", "attention_mask")


@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_length_must_be_positive(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--max_length", value])
    assert exit_info.value.code == 2
    assert "--max_length must be a positive integer" in usage_error(capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["--dtype", "fp8"],
        ["--backend", "tensorrt"],
        ["--max_length", "lots"],
        ["--api_workers", "0"],
        ["--api_workers", "many"],
    ],
)
def test_invalid_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert argv[1] in usage_error(capsys)


def test_help_lists_our_flags_and_kserve_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model_dir", "--max_model_len", "--return_labels", "--http_port"):
        assert flag in out


def test_importing_the_package_reads_no_argv():
    code = (
        "import sys; sys.argv = ['x', '--bogus']; "
        "import huggingfaceserver.cli, huggingfaceserver.__main__; print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_parse_args_ignores_the_process_argv():
    code = (
        "import sys; sys.argv = ['x', '--http_port', 'not-a-port']; "
        "from huggingfaceserver.cli import parse_args; "
        "print(parse_args(['--model_dir', '/models/bert']).server.http_port)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "8080"


def test_main_exits_2_on_an_unknown_flag():
    result = run_main("--bogus_flag")
    assert result.returncode == 2
    assert re.search(r"--bogus[-_]flag", result.stderr)
    assert "Traceback" not in result.stderr


def test_main_exits_1_with_one_line_for_a_missing_model_dir():
    result = run_main("--model_dir", "/nonexistent/path")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    line = last_line(result.stderr)
    assert line.startswith("huggingfaceserver: error: ")
    assert "/nonexistent/path" in line


@pytest.mark.skipif(vllm_installed(), reason="vLLM is installed here (test_choice covers it)")
def test_main_says_how_to_install_vllm(tiny_models):
    result = run_main("--model_dir", str(tiny_models["bert_fill_mask"]), "--backend", "vllm")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    line = last_line(result.stderr)
    assert line.startswith("huggingfaceserver: error: ")
    assert "vLLM is not installed" in line
    assert "pip install" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["--max_batch_size", "0"],
        ["--max_batch_tokens", "-1"],
        ["--batch_wait_ms", "-2"],
        ["--prefill_chunk_tokens", "0"],
    ],
)
def test_batching_limits_must_be_sensible(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model_dir", "/models/bert", *argv])
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(("value", "expected"), [("auto", None), ("1", 1), ("8", 8)])
def test_api_workers_is_auto_or_a_count(value, expected):
    assert parse_args(["--api_workers", value]).api_workers == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["--max_concurrent_requests", "0"],
        ["--max_request_bytes", "-1"],
        ["--max_inputs_per_request", "0"],
        ["--request_timeout_seconds", "0"],
        ["--request_timeout_seconds", "nan"],
        ["--request_read_timeout_seconds", "0"],
        ["--max_concurrent_predictor_calls", "0"],
        ["--shutdown_grace_seconds", "-5"],
        ["--api_key", " "],
    ],
)
def test_production_limits_must_be_sensible(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("*", ("*",)),
        ('["https://a.example", "https://b.example"]', ("https://a.example", "https://b.example")),
        ("https://a.example,", ("https://a.example",)),
    ],
)
def test_allowed_origins_take_a_comma_list_or_json(value, expected):
    assert parse_args(["--allowed_origins", value]).allowed_origins == expected


def test_allowed_origins_refuse_a_broken_json_list(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--allowed_origins", '["https://a.example"'])
    assert "--allowed_origins" in capsys.readouterr().err


# --- a pure function of argv and the environment ------------------------------------------

ENVIRON = {
    "HOME": "/home/someone",
    API_KEY_ENV: " from-env ",
    OPENAI_PREFIX_ENV: "kserve/openai/",
    CACHE_ENV: "/volume/cache",
    "KSERVE_TLS_CERT_FILE": "/tls/cert.pem",
    "KSERVE_TLS_KEY_FILE": "/tls/key.pem",
}
"""An environment that sets every variable the server reads."""


def test_the_same_argv_and_environment_give_equal_configs(monkeypatch):
    argv = ["--model_dir", "/models/bert", "--http-port", "9000", "--max-num-seqs", "8"]
    first = parse_args(argv, environ=dict(ENVIRON))
    for name in ENVIRON:  # the process's own environment is not read
        monkeypatch.setenv(name, "/elsewhere")
    assert parse_args(list(argv), environ=dict(ENVIRON)) == first
    assert parse_args(argv, environ={"HOME": "/home/someone"}) != first


def test_the_environment_lands_in_the_config():
    config = parse_args([], environ=ENVIRON)
    assert config.api_key == "from-env"
    assert config.openai_route_prefix == "/kserve/openai"
    assert config.cache_dir == Path("/volume/cache")
    assert (config.server.ssl_certfile, config.server.ssl_keyfile) == (
        "/tls/cert.pem",
        "/tls/key.pem",
    )
    bare = parse_args([], environ={"HOME": "/home/someone"})
    assert bare.api_key is None
    assert bare.openai_route_prefix == "/openai"
    assert bare.cache_dir == Path("/home/someone/.cache/huggingfaceserver")
    assert (bare.server.ssl_certfile, bare.server.ssl_keyfile) == (None, None)


def test_flags_win_over_the_environment():
    config = parse_args(["--api_key", "from-flag", "--ssl_certfile", "/mine.pem"], environ=ENVIRON)
    assert (config.api_key, config.server.ssl_certfile) == ("from-flag", "/mine.pem")


@pytest.mark.parametrize(
    ("value", "prefix"),
    [("", ""), ("/", ""), ("openai", "/openai"), (" /v2/openai/ ", "/v2/openai")],
)
def test_the_openai_route_prefix_is_normalised(value, prefix):
    assert parse_args([], environ={OPENAI_PREFIX_ENV: value}).openai_route_prefix == prefix


@pytest.mark.parametrize(
    ("environ", "folder"),
    [
        ({CACHE_ENV: "/c", "XDG_CACHE_HOME": "/x", "HOME": "/h"}, "/c"),
        ({"XDG_CACHE_HOME": "/x", "HOME": "/h"}, "/x/huggingfaceserver"),
        ({"HOME": "/h"}, "/h/.cache/huggingfaceserver"),
    ],
)
def test_the_cache_directory_comes_from_the_environment(environ, folder):
    assert parse_args([], environ=environ).cache_dir == Path(folder)


@pytest.mark.parametrize("value", ["", "   "])
def test_a_blank_api_key_variable_is_no_key(value):
    assert parse_args([], environ={API_KEY_ENV: value}).api_key is None


def test_kserve_flags_hold_every_flag_of_kserves_parser():
    parsed = set(vars(build_parser({}).parse_args([])))
    assert parsed - set(flag_fields()) == {f.name for f in dataclasses.fields(KServeFlags)}
    assert parse_args([], environ={}).server == KServeFlags()


# --- flag combinations refused in parsing (status 1, one line, as any startup error) -------

REFUSED = [
    (
        ["--workers", "2"],
        "--workers > 1 is not supported: one process holds the model; use --api_workers N "
        "for N front processes before one engine process",
    ),
    (
        ["--api_workers", "2", "--backend", "vllm"],
        "--api_workers > 1 is not supported with the vLLM backend (vLLM already runs its "
        "engine in a process of its own): use --api_workers 1, or --backend huggingface",
    ),
    (
        ["--api-workers=4", "--enable_model_repository"],
        "--enable_model_repository needs the single-process layout: the engine process owns "
        "the model; run with --api_workers 1",
    ),
]


@pytest.mark.parametrize(("argv", "error"), REFUSED, ids=["workers", "vllm", "repository"])
def test_combinations_the_server_cannot_run_exit_1_before_loading(argv, error, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model_dir", "/nonexistent", *argv], environ={})
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == f"huggingfaceserver: error: {error}\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["--workers", "1"],
        ["--api_workers", "1", "--backend", "vllm"],
        ["--api_workers", "auto", "--backend", "vllm"],
        ["--api_workers", "2", "--backend", "auto"],
        ["--api_workers", "1", "--enable_model_repository"],
        ["--api_workers", "auto", "--enable_model_repository"],
    ],
)
def test_what_only_the_model_or_the_machine_decides_is_left_to_them(argv):
    """``auto`` chooses by the model and the machine: checked where those are known."""
    parse_args(argv, environ={})


def test_a_bad_value_is_a_usage_error_before_any_combination(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--workers", "2", "--max_length", "0"], environ={})
    assert exit_info.value.code == 2
    assert "--max_length must be a positive integer" in usage_error(capsys)
