"""Where the model is and what it is: folders, Hub ids offline, task, dtype and max length."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer

from huggingfaceserver.backends.tokenizing import resolve_max_length
from huggingfaceserver.cli import parse_args
from huggingfaceserver.errors import StartupError
from huggingfaceserver.loading import (
    load_pretrained,
    load_source,
    load_tokenizer,
    locate_model,
    read_chat_template,
    resolve_dtype,
    tokenizer_class_name,
    tokenizer_class_named,
)
from huggingfaceserver.tasks import Task
from tiny_models import BUILDERS

MAIN_COMMIT = "a" * 40
V1_COMMIT = "b" * 40


def locate(*argv: str) -> tuple[Path, Path]:
    return locate_model(parse_args(list(argv)))


def startup_error(*argv: str) -> str:
    with pytest.raises(StartupError) as error:
        load_source(parse_args(list(argv)))
    message = str(error.value)
    assert "\n" not in message
    return message


# --- local folders ---------------------------------------------------------------------------


def test_model_dir_is_used_for_model_and_tokenizer(tiny_models):
    path = tiny_models["bert_fill_mask"]
    assert locate("--model_dir", str(path)) == (path, path)


def test_missing_folder_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    assert str(missing) in startup_error("--model_dir", str(missing))


def test_a_file_is_not_a_model_folder(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    message = startup_error("--model_dir", str(file))
    assert str(file) in message
    assert "not a folder" in message


def test_folder_without_config_json_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    message = startup_error("--model_dir", str(tmp_path))
    assert str(tmp_path) in message
    assert "config.json" in message


def test_unreadable_folder_is_named(tmp_path, tiny_models):
    folder = tmp_path / "locked"
    shutil.copytree(tiny_models["bert_fill_mask"], folder)
    folder.chmod(0)
    try:
        if os.access(folder, os.R_OK | os.X_OK):
            pytest.skip("this user (root?) reads folders whatever their mode")
        message = startup_error("--model_dir", str(folder))
        assert str(folder) in message
        assert "not readable" in message
    finally:
        folder.chmod(0o755)


def test_unparsable_config_json_is_a_startup_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert str(tmp_path) in startup_error("--model_dir", str(tmp_path))


def test_model_id_wins_over_model_dir(tiny_models):
    path = tiny_models["gpt2"]
    assert locate("--model_dir", "/nonexistent/path", "--model_id", str(path)) == (path, path)


def test_model_id_that_is_a_folder_is_used_as_is(tiny_models):
    path = tiny_models["t5"]
    assert locate("--model_id", str(path)) == (path, path)


# --- Hub ids, from an offline cache ----------------------------------------------------------


@pytest.fixture
def hub_cache(tmp_path, tiny_models, monkeypatch) -> Path:
    """An offline Hugging Face cache holding ``org/name``: main is BERT fill-mask, v1 is GPT-2.

    huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE into ``constants`` at import, so
    the environment alone is too late: the constants are patched as well.
    """
    cache = tmp_path / "hub"
    repo = cache / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN_COMMIT)
    (repo / "refs" / "v1").write_text(V1_COMMIT)
    shutil.copytree(tiny_models["bert_fill_mask"], repo / "snapshots" / MAIN_COMMIT)
    shutil.copytree(tiny_models["gpt2"], repo / "snapshots" / V1_COMMIT)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots"


def test_hub_id_loads_the_main_snapshot(hub_cache):
    source = load_source(parse_args(["--model_id", "org/name"]))
    assert source.path == hub_cache / MAIN_COMMIT
    assert source.tokenizer_path == hub_cache / MAIN_COMMIT
    assert source.task is Task.fill_mask


@pytest.mark.parametrize("revision", ["v1", V1_COMMIT])
def test_model_revision_picks_the_snapshot(hub_cache, revision):
    source = load_source(parse_args(["--model_id", "org/name", "--model_revision", revision]))
    assert source.path == hub_cache / V1_COMMIT
    assert source.tokenizer_path == hub_cache / V1_COMMIT
    assert source.task is Task.text_generation


def test_tokenizer_revision_moves_only_the_tokenizer(hub_cache):
    config = parse_args(["--model_id", "org/name", "--tokenizer_revision", "v1"])
    source = load_source(config)
    assert source.path == hub_cache / MAIN_COMMIT
    assert source.config.architectures == ["BertForMaskedLM"]
    assert source.tokenizer_path == hub_cache / V1_COMMIT
    assert load_tokenizer(source, config).eos_token == "<|endoftext|>"


def test_tokenizer_revision_main_with_model_revision_v1(hub_cache):
    path, tokenizer_path = locate(
        "--model_id", "org/name", "--model_revision", "v1", "--tokenizer_revision", "main"
    )
    assert (path, tokenizer_path) == (hub_cache / V1_COMMIT, hub_cache / MAIN_COMMIT)


def test_hub_id_absent_from_the_cache_is_named(hub_cache):
    assert "'org/absent'" in startup_error("--model_id", "org/absent")


@pytest.mark.parametrize("flag", ["--model_revision", "--tokenizer_revision"])
def test_revision_absent_from_the_cache_is_named(hub_cache, flag):
    message = startup_error("--model_id", "org/name", flag, "v2")
    assert "'org/name'" in message
    assert "v2" in message


# --- task ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "task"),
    [
        ("bert_fill_mask", Task.fill_mask),
        ("bert_token_classification", Task.token_classification),
        ("bert_sequence_classification", Task.sequence_classification),
        ("distilbert_sequence_classification", Task.sequence_classification),
        ("bert_embedding", Task.text_embedding),
        ("gpt2", Task.text_generation),
        ("t5", Task.text2text_generation),
    ],
)
def test_task_comes_from_the_config(tiny_models, name, task):
    source = load_source(parse_args(["--model_dir", str(tiny_models[name])]))
    assert source.task is task
    assert source.sentence is None


@pytest.mark.parametrize(("name", "context"), [("gpt2", 128), ("llama", 128), ("t5", None)])
def test_the_model_facts_are_read_once_from_its_config_and_folder(tiny_models, name, context):
    source = load_source(parse_args(["--model_dir", str(tiny_models[name])]))
    facts = source.facts
    assert facts is source.facts  # computed once
    weights = sum(path.stat().st_size for path in source.path.glob("*.safetensors"))
    assert (facts.context_length, facts.weight_bytes) == (context, weights) and weights > 0
    assert facts.dtype == "float32"


def test_task_flag_overrides_the_config(tiny_models):
    config = parse_args(["--model_dir", str(tiny_models["bert_embedding"]), "--task", "fill-mask"])
    assert load_source(config).task is Task.fill_mask


def test_minilm_is_a_sentence_transformers_embedding_model(minilm_path):
    source = load_source(parse_args(["--model_dir", str(minilm_path)]))
    assert source.task is Task.text_embedding
    assert source.sentence is not None
    assert source.sentence.model_type == "SentenceTransformer"
    assert source.sentence.max_seq_length == 256  # its tokenizer says 512


def test_sentence_transformers_files_win_over_the_architecture(tmp_path, tiny_models):
    folder = tmp_path / "st_fill_mask"
    shutil.copytree(tiny_models["bert_fill_mask"], folder)
    shutil.copy(tiny_models["st_cls"] / "modules.json", folder / "modules.json")
    source = load_source(parse_args(["--model_dir", str(folder)]))
    assert source.config.architectures == ["BertForMaskedLM"]
    assert source.task is Task.text_embedding


def test_a_sentence_transformers_module_it_does_not_run_is_named(sentence_models):
    message = startup_error("--model_dir", str(sentence_models["router", "unsupported"]))
    assert "sentence_transformers.base.modules.router.Router is not served" in message


def test_malformed_modules_json_is_a_startup_error(tmp_path, tiny_models):
    folder = tmp_path / "bad_modules"
    shutil.copytree(tiny_models["bert_embedding"], folder)
    (folder / "modules.json").write_text(json.dumps({"idx": 0}))
    assert "modules.json" in startup_error("--model_dir", str(folder))


# --- dtype -----------------------------------------------------------------------------------


@pytest.mark.parametrize("task", list(Task))
def test_auto_dtype_is_float32_on_cpu(task):
    assert resolve_dtype("auto", task, on_gpu=False) is torch.float32


@pytest.mark.parametrize("task", list(Task))
def test_auto_dtype_on_gpu_is_half_for_generation_only(task):
    expected = torch.float16 if task.is_generative else torch.float32
    assert resolve_dtype("auto", task, on_gpu=True) is expected


@pytest.mark.parametrize(
    ("stored", "bf16", "expected"),
    [
        ("bfloat16", True, torch.bfloat16),  # as vLLM's auto: a bf16 model stays in bf16
        ("bfloat16", False, torch.float16),  # a GPU before compute capability 8.0
        ("float32", True, torch.float16),
        ("float16", True, torch.float16),
        (None, True, torch.float16),
    ],
)
def test_auto_dtype_on_gpu_keeps_a_bf16_checkpoint_where_the_gpu_can(stored, bf16, expected):
    assert resolve_dtype("auto", Task.text_generation, True, stored, bf16) is expected
    assert resolve_dtype("auto", Task.fill_mask, True, stored, bf16) is torch.float32
    assert resolve_dtype("auto", Task.text_generation, False, stored, bf16) is torch.float32
    assert resolve_dtype("float16", Task.text_generation, True, stored, bf16) is torch.float16


@pytest.mark.parametrize(
    ("flag", "dtype"),
    [
        ("float16", torch.float16),
        ("half", torch.float16),
        ("float32", torch.float32),
        ("float", torch.float32),
        ("bfloat16", torch.bfloat16),
    ],
)
@pytest.mark.parametrize("on_gpu", [True, False])
def test_explicit_dtype_names(flag, dtype, on_gpu):
    assert resolve_dtype(flag, Task.fill_mask, on_gpu) is dtype
    assert resolve_dtype(flag, Task.text_generation, on_gpu) is dtype


# --- max length ------------------------------------------------------------------------------


@pytest.fixture
def bert(tiny_models):
    """The tiny BERT's config (128 positions) and a tokenizer that sets no limit of its own."""
    path = tiny_models["bert_fill_mask"]
    tokenizer = AutoTokenizer.from_pretrained(path, model_max_length=int(1e30))
    return tokenizer, AutoConfig.from_pretrained(path)


def test_max_length_defaults_to_the_position_limit(bert):
    tokenizer, config = bert
    assert resolve_max_length(None, tokenizer, config) == config.max_position_embeddings == 128


def test_max_length_defaults_to_the_smaller_of_config_and_tokenizer(bert):
    tokenizer, config = bert
    tokenizer.model_max_length = 100
    assert resolve_max_length(None, tokenizer, config) == 100
    config.max_position_embeddings = 64
    assert resolve_max_length(None, tokenizer, config) == 64


def test_minilm_max_length_is_512(minilm_path):
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    config = AutoConfig.from_pretrained(minilm_path)
    assert resolve_max_length(None, tokenizer, config) == 512


def test_t5_takes_its_limit_from_the_tokenizer(tiny_models):
    path = tiny_models["t5"]
    tokenizer, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    assert getattr(config, "max_position_embeddings", None) is None
    assert resolve_max_length(None, tokenizer, config) == tokenizer.model_max_length == 128


def test_smaller_max_length_is_kept(bert):
    tokenizer, config = bert
    assert resolve_max_length(16, tokenizer, config) == 16


def test_larger_max_length_names_both_numbers(bert):
    tokenizer, config = bert
    with pytest.raises(StartupError) as error:
        resolve_max_length(4096, tokenizer, config)
    message = str(error.value)
    assert "4096" in message
    assert "128" in message


def test_no_known_limit_asks_for_max_length(tiny_models):
    path = tiny_models["t5"]  # T5 has relative positions: no max_position_embeddings
    tokenizer = AutoTokenizer.from_pretrained(path, model_max_length=int(1e30))
    config = AutoConfig.from_pretrained(path)
    assert resolve_max_length(300, tokenizer, config) == 300
    with pytest.raises(StartupError) as error:
        resolve_max_length(None, tokenizer, config)
    assert "--max_length" in str(error.value)


# --- what a front process loads: the tokenizer by the engine's class, no config --------------

TEXTS = ["héllo wörld, 123!", "  spaces   and\ttabs ", "日本語 and emoji 🤗", "a", "<s> [CLS] </s>"]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_the_tokenizer_by_class_name_is_autotokenizers(tiny_models, name):
    """Loaded by the class AutoTokenizer chose (as a front does, with the class name the engine
    sends), the tokenizer encodes, pairs, decodes and templates exactly as AutoTokenizer's."""
    config = parse_args(["--model_dir", str(tiny_models[name])])
    source = load_source(config, read_config=False)
    auto = AutoTokenizer.from_pretrained(source.tokenizer_path)
    class_name = tokenizer_class_name(auto)
    assert class_name is not None, type(auto)
    named = load_tokenizer(source, config, class_name)
    assert type(named) is type(auto)
    assert named(TEXTS) == auto(TEXTS)
    assert named(TEXTS[0], TEXTS[2], truncation=True, max_length=8) == auto(
        TEXTS[0], TEXTS[2], truncation=True, max_length=8
    )
    ids = auto(" ".join(TEXTS))["input_ids"]
    for skip in (False, True):
        assert named.decode(ids, skip_special_tokens=skip) == auto.decode(
            ids, skip_special_tokens=skip
        )
    assert named.all_special_tokens == auto.all_special_tokens
    assert named.model_max_length == auto.model_max_length
    assert named.chat_template == auto.chat_template
    assert len(named) == len(auto)


def test_a_class_transformers_does_not_export_falls_back_to_autotokenizer(tiny_models):
    config = parse_args(["--model_dir", str(tiny_models["gpt2"])])
    source = load_source(config, read_config=False)
    assert tokenizer_class_named("NoSuchTokenizer") is None
    assert tokenizer_class_named("os") is None  # not a class
    tokenizer = load_tokenizer(source, config, "NoSuchTokenizer")
    assert type(tokenizer) is type(AutoTokenizer.from_pretrained(source.tokenizer_path))


def test_the_config_is_read_only_when_asked(tmp_path, tiny_models):
    """Task and architectures come from config.json as JSON; transformers' config (which
    imports torch) is read on first use, and its problems are then startup errors."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["bert_sequence_classification"], folder)
    data = json.loads((folder / "config.json").read_text())
    data["model_type"] = "no-such-model-type"
    (folder / "config.json").write_text(json.dumps(data))
    config = parse_args(["--model_dir", str(folder)])
    source = load_source(config, read_config=False)
    assert source.architectures == data["architectures"]
    assert source.task is Task.sequence_classification
    with pytest.raises(StartupError, match="cannot read the model config"):
        source.config  # noqa: B018
    with pytest.raises(StartupError, match="cannot read the model config"):
        load_source(config)


def test_architectures_that_are_not_names_are_a_startup_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": "BertModel"}))
    with pytest.raises(StartupError, match="architectures is not a list of names"):
        load_source(parse_args(["--model_dir", str(tmp_path)]), read_config=False)


# --- folders as users save them ----------------------------------------------------------------


def test_a_folder_without_its_tokenizer_is_a_startup_error(tiny_models, tmp_path):
    """model.save_pretrained without tokenizer.save_pretrained: transformers 5 would make a
    placeholder vocabulary of five tokens, every word unknown; a one-line error instead."""
    folder = tmp_path / "model-only"
    shutil.copytree(tiny_models["bert_fill_mask"], folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    config = parse_args(["--model_dir", str(folder)])
    with pytest.raises(StartupError, match="no tokenizer in .*tokenizer.save_pretrained") as error:
        load_tokenizer(load_source(config), config)
    assert "\n" not in str(error.value)


def test_weights_that_fail_in_any_way_are_a_one_line_startup_error(tiny_models, tmp_path):
    """A truncated safetensors file (an interrupted download) raises safetensors' own error,
    not an OSError: a one-line error naming it, not a traceback."""
    folder = tmp_path / "truncated"
    shutil.copytree(tiny_models["bert_fill_mask"], folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    config = parse_args(["--model_dir", str(folder)])
    source = load_source(config)
    with pytest.raises(StartupError, match="cannot load the model in") as error:
        load_pretrained(AutoModelForMaskedLM, source, config, torch.float32)
    assert "\n" not in str(error.value)


def test_a_chat_template_flag_without_jinja_is_a_file_that_must_exist(tmp_path):
    """As vLLM reads --chat-template: a value with no Jinja characters names a file, whatever
    its suffix (a file name taken for the template made every prompt that name)."""
    named = tmp_path / "template.jinja2"
    named.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(named)) == "{{ messages[0]['content'] }}"
    with pytest.raises(StartupError, match="cannot read the chat template file tmpl.jnja"):
        read_chat_template("tmpl.jnja")
    assert read_chat_template("{{ bos_token }}") == "{{ bos_token }}"
