"""The model's facts (model_facts.py), each computed once: the context length its config
declares (every attribute form, a composite model's text config), the weights it loads (each
format, one set of several), the dtype they are stored in; and the cases that the versions
they replace (the transformers generator's, vLLM sizing's and the encoders' context length;
the layout's and vLLM sizing's weight size) handled give the same answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import (
    AutoConfig,
    BertConfig,
    CLIPConfig,
    GPT2Config,
    LlamaConfig,
    LlavaConfig,
    PretrainedConfig,
    T5Config,
)

from huggingfaceserver.model_facts import (
    CONTEXT_LENGTH_ATTRIBUTES,
    AttentionShape,
    ModelFacts,
    attention_shape,
    context_length,
    head_size,
    stored_dtype,
    weight_bytes,
)

# --- context length -------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONTEXT_LENGTH_ATTRIBUTES)
def test_each_attribute_form_is_a_context_length(name):
    assert context_length(PretrainedConfig(**{name: 300})) == 300


def test_the_smallest_declared_limit_binds():
    config = PretrainedConfig(max_position_embeddings=4096, seq_length=2048, n_positions=8192)
    assert context_length(config) == 2048


@pytest.mark.parametrize("value", [0, -1, None, "4096", 1.5])
def test_what_is_not_a_positive_integer_is_no_limit(value):
    assert context_length(PretrainedConfig(max_position_embeddings=value)) is None
    assert context_length(PretrainedConfig(max_position_embeddings=value, seq_len=64)) == 64


def test_a_relative_position_model_declares_none():
    assert context_length(T5Config()) is None
    assert context_length(PretrainedConfig()) is None


def test_a_composite_model_s_context_is_its_text_config_s():
    text = LlamaConfig(max_position_embeddings=1024)
    assert context_length(LlavaConfig(text_config=text.to_dict())) == 1024
    clip = CLIPConfig(text_config={"max_position_embeddings": 77})
    assert clip.get_text_config().max_position_embeddings == 77
    assert context_length(clip) == 77


def test_positions_before_the_first_token_are_not_context():
    """RoBERTa-like models number positions from the padding id on: 514 embeddings, 512
    tokens (MPNet, XLM-R alike); BERT's 512 are all tokens'."""
    assert context_length(AutoConfig.for_model("roberta", max_position_embeddings=514)) == 512
    assert context_length(AutoConfig.for_model("xlm-roberta", max_position_embeddings=514)) == 512
    assert context_length(AutoConfig.for_model("mpnet", max_position_embeddings=514)) == 512
    assert context_length(AutoConfig.for_model("mpnet")) == 510  # its config's default: 512
    mpnet_padded_at_0 = AutoConfig.for_model("mpnet", max_position_embeddings=514, pad_token_id=0)
    assert context_length(mpnet_padded_at_0) == 512  # its positions count from 1 regardless
    padded_at_0 = AutoConfig.for_model("roberta", max_position_embeddings=130, pad_token_id=0)
    assert context_length(padded_at_0) == 129
    assert context_length(BertConfig(max_position_embeddings=512)) == 512


GENERATOR_NAMES_BEFORE = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
)
"""The transformers generator's POSITION_LIMIT_ATTRIBUTES before model_facts."""
VLLM_SIZING_NAMES_BEFORE = (*GENERATOR_NAMES_BEFORE, "seq_len")
"""vLLM sizing's CONTEXT_KEYS before model_facts: seq_len besides."""


def smallest_before(names: tuple[str, ...], config: PretrainedConfig) -> int | None:
    """The smallest positive limit of ``names`` on the text config, as both old readings did."""
    text = config.get_text_config()
    known = [v for n in names if isinstance(v := getattr(text, n, None), int) and v > 0]
    return min(known) if known else None


def generator_before(config: PretrainedConfig) -> int | None:
    return smallest_before(GENERATOR_NAMES_BEFORE, config)


def vllm_sizing_before(config: PretrainedConfig) -> int | None:
    return smallest_before(VLLM_SIZING_NAMES_BEFORE, config)


def encoders_before(config: PretrainedConfig) -> int | None:
    """The encoders' reading before model_facts (the top level's max_position_embeddings)."""
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if limit else None


CONFIGS = {
    "bert": BertConfig(max_position_embeddings=512),
    "gpt2": GPT2Config(n_positions=256),
    "llama": LlamaConfig(max_position_embeddings=4096),
    "t5": T5Config(),
    "llava": LlavaConfig(text_config=LlamaConfig(max_position_embeddings=1024).to_dict()),
    "several": PretrainedConfig(max_position_embeddings=4096, seq_length=2048),
    "seq_len": PretrainedConfig(seq_len=300),
    "model_max_length": PretrainedConfig(model_max_length=100),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
def test_what_the_former_readings_found_is_found_the_same(config):
    """The generator's and vLLM sizing's answers, where they had one, are the answer now (the
    attribute lists are their union, with vLLM's model_max_length; both took the smallest);
    so is the encoders' where the config declares one limit only."""
    for before in (generator_before, vllm_sizing_before):
        if before(config) is not None:
            assert context_length(config) == before(config), before.__name__
    if encoders_before(config) is not None and config is not CONFIGS["several"]:
        assert context_length(config) == encoders_before(config)


def test_where_the_former_readings_differed():
    """The encoders read only the top level's max_position_embeddings: a composite model's
    text config now counts there too, and of several limits the smallest, as the generator
    and vLLM sizing took it; the generator did not read seq_len, vLLM sizing did; none read
    model_max_length, which vLLM reads."""
    assert encoders_before(CONFIGS["llava"]) is None and context_length(CONFIGS["llava"]) == 1024
    assert encoders_before(CONFIGS["several"]) == 4096
    assert context_length(CONFIGS["several"]) == generator_before(CONFIGS["several"]) == 2048
    assert generator_before(CONFIGS["seq_len"]) is None
    assert vllm_sizing_before(CONFIGS["seq_len"]) == context_length(CONFIGS["seq_len"]) == 300
    assert context_length(CONFIGS["model_max_length"]) == 100


# --- weight size ----------------------------------------------------------------------------


def files(folder: Path, sizes: dict[str, int]) -> Path:
    for name, size in sizes.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"\0" * size)
    return folder


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ({}, 0),
        ({"config.json": 50, "tokenizer.json": 70}, 0),
        ({"model.safetensors": 100}, 100),
        ({"model-00001-of-00002.safetensors": 30, "model-00002-of-00002.safetensors": 20}, 50),
        ({"pytorch_model.bin": 700}, 700),
        ({"model.pt": 40}, 40),
        ({"model.pth": 40, "extra.bin": 2}, 42),
        ({"model.safetensors": 100, "pytorch_model.bin": 700}, 100),  # one set: safetensors
        ({"model.safetensors": 100, "model.pt": 700}, 100),
        ({"onnx/model.onnx": 900, "model.safetensors": 100}, 100),
        (  # a Trainer checkpoint: its optimizer's and scheduler's state are no weights
            {"pytorch_model.bin": 700, "optimizer.pt": 1400, "scheduler.pt": 1},
            700,
        ),
        ({"pytorch_model.bin": 700, "training_args.bin": 5, "rng_state.pth": 14}, 700),
    ],
)
def test_the_weights_loaded_are_counted_once(tmp_path, sizes, expected):
    assert weight_bytes(files(tmp_path, sizes)) == expected


def index(folder: Path, name: str, shards: list[str]) -> None:
    weight_map = {f"layer.{i}": shard for i, shard in enumerate(shards)}
    (folder / name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_sharded_checkpoint_counts_the_shards_its_index_names(tmp_path):
    """A folder (as Mistral's) with a consolidated copy beside the shards loads the shards."""
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    files(tmp_path, {shards[0]: 30, shards[1]: 20, "consolidated.safetensors": 50})
    index(tmp_path, "model.safetensors.index.json", [shards[0], shards[1], shards[0]])
    assert weight_bytes(tmp_path) == 50


def test_an_index_whose_shards_are_not_there_is_ignored(tmp_path):
    files(tmp_path, {"model.safetensors": 100})
    index(tmp_path, "model.safetensors.index.json", ["model-00001-of-00009.safetensors"])
    (tmp_path / "pytorch_model.bin.index.json").write_text("not json")
    assert weight_bytes(tmp_path) == 100


def test_a_pickle_index_names_the_bin_shards(tmp_path):
    files(tmp_path, {"pytorch_model-00001-of-00001.bin": 60, "training_args.bin": 5})
    index(tmp_path, "pytorch_model.bin.index.json", ["pytorch_model-00001-of-00001.bin"])
    assert weight_bytes(tmp_path) == 60


def layout_before(folder: Path) -> int:
    """topology.layout.engine_bytes's weights before model_facts."""
    for suffix in (".safetensors", ".bin"):
        sizes = [path.stat().st_size for path in folder.glob(f"*{suffix}") if path.is_file()]
        if sizes:
            return sum(sizes)
    return 0


def vllm_sizing_weights_before(folder: Path) -> int:
    """backends.vllm.cache_sizing.weight_bytes before model_facts."""
    for suffixes in ((".safetensors",), (".bin", ".pt", ".pth")):
        found = [p for p in folder.iterdir() if p.name.endswith(suffixes) and p.is_file()]
        if found:
            return sum(p.stat().st_size for p in found)
    return 0


@pytest.mark.parametrize(
    "sizes",
    [
        {},
        {"model.safetensors": 100},
        {"a.safetensors": 30, "b.safetensors": 20, "config.json": 9},
        {"pytorch_model.bin": 700},
        {"pytorch_model.bin": 700, "model.safetensors": 100},
        {"model.pt": 40},
    ],
)
def test_what_the_former_weight_sizes_found_is_found_the_same(tmp_path, sizes):
    """Both former readings took safetensors first; the layout knew only .bin besides, vLLM
    sizing .pt and .pth too (counted now for both)."""
    folder = files(tmp_path, sizes)
    assert weight_bytes(folder) == vllm_sizing_weights_before(folder)
    if not any(name.endswith((".pt", ".pth")) for name in sizes):
        assert weight_bytes(folder) == layout_before(folder)


# --- dtype and the facts together -----------------------------------------------------------


def test_the_stored_dtype_by_torch_s_name(tmp_path):
    assert stored_dtype(LlamaConfig(dtype="bfloat16")) == "bfloat16"
    assert stored_dtype(LlamaConfig()) is None
    for key in ("dtype", "torch_dtype"):  # torch_dtype: config.json before transformers 4.56
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", key: "float16"}))
        assert stored_dtype(AutoConfig.from_pretrained(tmp_path)) == "float16"


def test_the_facts_of_a_model_folder(tmp_path):
    LlamaConfig(max_position_embeddings=512, dtype="bfloat16").save_pretrained(tmp_path)
    files(tmp_path, {"model.safetensors": 64})
    config = AutoConfig.from_pretrained(tmp_path)
    assert ModelFacts.of(config, tmp_path) == ModelFacts(512, 64, "bfloat16")


def test_the_attention_shape_of_a_grouped_query_llama():
    """TinyLlama-1.1B's: 22 layers of 4 KV heads of 64, 22,528 bytes per token in bf16."""
    config = LlamaConfig(
        hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4
    )
    shape = attention_shape(config.get_text_config())
    assert shape == AttentionShape(layers=22, kv_heads=4, head_size=64)
    assert shape.kv_bytes_per_token(2) == 22_528


def test_the_attention_shape_under_gpt2_s_names():
    config = GPT2Config(n_embd=64, n_layer=3, n_head=4)
    assert attention_shape(config) == AttentionShape(layers=3, kv_heads=4, head_size=16)
    assert head_size(config) == 16


def test_a_config_without_heads_has_no_attention_shape():
    config = PretrainedConfig()
    assert attention_shape(config) is None and head_size(config) is None
