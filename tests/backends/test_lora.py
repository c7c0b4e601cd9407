"""LoRA modules named at startup, as both generation backends read them, and the bookkeeping
of adapters loaded and unloaded at run time (paths kept inside ``--lora_adapter_dir``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from huggingfaceserver.backends.lora import (
    LoraModule,
    lora_modules,
    parse_lora_modules,
    served_adapters,
)
from huggingfaceserver.cli import ServerConfig, parse_args
from huggingfaceserver.errors import BadRequest, Conflict, NotFound, StartupError


def config_for(model_dir: Path, *flags: str) -> ServerConfig:
    return parse_args(["--model_dir", str(model_dir), "--model_name", "llm", *flags])


def test_lora_modules_in_both_forms():
    values = ["sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat"}', "a=b=c"]
    assert parse_lora_modules(values) == [
        LoraModule("sql", "/adapters/sql"),
        LoraModule("chat", "/adapters/chat"),
        LoraModule("a", "b=c"),
    ]


@pytest.mark.parametrize(
    "value", ["sql", "=/adapters/sql", "sql=", '{"name": "sql"}', '{"name": "sql", ', "[1, 2]"]
)
def test_malformed_lora_modules_are_startup_errors(value):
    with pytest.raises(StartupError, match="--lora-modules"):
        parse_lora_modules([value])


def test_lora_modules_are_read_with_enable_lora(tmp_path):
    config = config_for(tmp_path, "--enable-lora", "--lora-modules", f"sql={tmp_path}")
    assert lora_modules(config) == [LoraModule("sql", str(tmp_path))]
    assert lora_modules(config_for(tmp_path)) == []


def test_lora_modules_need_enable_lora(tmp_path):
    with pytest.raises(StartupError, match="--enable-lora"):
        lora_modules(config_for(tmp_path, "--lora-modules", f"sql={tmp_path}"))


def test_a_missing_lora_adapter_is_a_startup_error(tmp_path):
    missing = tmp_path / "nowhere"
    config = config_for(tmp_path, "--enable-lora", "--lora-modules", f"sql={missing}")
    with pytest.raises(StartupError, match="sql.*does not exist"):
        lora_modules(config)


@pytest.mark.parametrize(
    ("names", "error"), [(["a", "a"], "names an adapter twice: a"), (["llm"], "llm: the served")]
)
def test_adapter_names_are_unique(tmp_path, names, error):
    modules = [f"{name}={tmp_path}" for name in names]
    config = config_for(tmp_path, "--enable-lora", "--lora-modules", *modules)
    with pytest.raises(StartupError, match=error):
        lora_modules(config)


# --- adapters at run time -------------------------------------------------------------------


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    """``--lora_adapter_dir`` with one adapter folder, ``sql``, and a folder outside it."""
    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    return tmp_path / "adapters"


def runtime_config(adapter_dir: Path, *flags: str) -> ServerConfig:
    return config_for(
        adapter_dir,
        "--enable-lora",
        "--enable_runtime_lora",
        "--lora_adapter_dir",
        str(adapter_dir),
        *flags,
    )


def test_runtime_loading_is_off_by_default(tmp_path) -> None:
    adapters = served_adapters(config_for(tmp_path, "--lora_adapter_dir", str(tmp_path)))
    assert not adapters.runtime
    with pytest.raises(NotFound, match="--enable_runtime_lora"):
        adapters.begin_load("sql", str(tmp_path))
    with pytest.raises(NotFound, match="--enable_runtime_lora"):
        adapters.begin_unload("sql")


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--enable_runtime_lora", "--lora_adapter_dir", "."], "needs --enable-lora"),
        (["--enable-lora", "--enable_runtime_lora"], "needs --lora_adapter_dir"),
        (["--enable-lora", "--enable_runtime_lora", "--lora_adapter_dir", "/no/such"], "not a"),
    ],
)
def test_runtime_loading_needs_its_flags(tmp_path, flags, error) -> None:
    with pytest.raises(StartupError, match=error):
        served_adapters(config_for(tmp_path, *flags))


def test_a_path_inside_the_folder_is_loaded(adapter_dir) -> None:
    adapters = served_adapters(runtime_config(adapter_dir))
    for path in (str(adapter_dir / "sql"), "sql", "./sql/../sql"):
        module = adapters.begin_load("sql", path)
        assert module == LoraModule("sql", str((adapter_dir / "sql").resolve()))
        adapters.end_load(module, loaded=False)
    assert "sql" not in adapters
    adapters.end_load(adapters.begin_load("sql", "sql"), loaded=True)
    assert list(adapters) == ["sql"]


def test_a_path_outside_the_folder_is_refused(adapter_dir) -> None:
    (adapter_dir / "link").symlink_to(adapter_dir.parent / "elsewhere")
    adapters = served_adapters(runtime_config(adapter_dir))
    for path in (str(adapter_dir.parent / "elsewhere"), "../elsewhere", "link", "/etc"):
        with pytest.raises(BadRequest, match="outside --lora_adapter_dir"):
            adapters.begin_load("x", path)
    with pytest.raises(BadRequest, match="no adapter folder"):
        adapters.begin_load("x", "missing")
    assert not adapters.loading


def test_a_name_in_use_is_refused(adapter_dir) -> None:
    adapters = served_adapters(
        runtime_config(adapter_dir, "--lora-modules", f"chat={adapter_dir / 'sql'}")
    )
    adapters.begin_load("sql", "sql")  # still loading
    for name in ("chat", "sql", "llm"):
        with pytest.raises(BadRequest, match=f"'{name}' has already been loaded"):
            adapters.begin_load(name, "sql")


def test_an_adapter_in_use_is_not_unloaded(adapter_dir) -> None:
    adapters = served_adapters(
        runtime_config(adapter_dir, "--lora-modules", f"sql={adapter_dir / 'sql'}")
    )
    with pytest.raises(NotFound, match="'chat' cannot be found"):
        adapters.begin_unload("chat")
    with adapters.use("sql"), adapters.use(None):
        with pytest.raises(Conflict, match="in use by 1 requests") as refused:
            adapters.begin_unload("sql")
        assert refused.value.status_code == 409
    assert adapters.begin_unload("sql").name == "sql"
    assert "sql" not in adapters
    with pytest.raises(BadRequest, match="unknown LoRA adapter 'sql'"), adapters.use("sql"):
        pass
