"""Tiny, random, deterministic Hugging Face models built offline for the tests.

Each ``build_*(out_dir)`` makes its tokenizer from the small :data:`CORPUS`
with the ``tokenizers`` library, seeds torch before constructing the model and
saves both with ``save_pretrained`` (safetensors), so the folders load with the
``Auto*`` classes like checkpoints from the Hub.  Building twice gives
byte-identical files; :func:`build_all` builds everything in well under a second.

On ``from_pretrained``, transformers 5's ``BertTokenizer``, ``GPT2Tokenizer``
and ``T5Tokenizer`` rebuild normalizer, pre-tokenizer and decoder themselves
(from ``tokenizer_config.json``, e.g. ``do_lower_case``) and take only vocab,
merges and post-processor from ``tokenizer.json``; the pipelines here match
what those classes build.
"""

import json
import math
import re
import string
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    BertTokenizer,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    GPT2Tokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
    T5Tokenizer,
)

SEED = 0
MAX_LENGTH = 128
BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
GPT2_EOS = "<|endoftext|>"
T5_SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]
LLAMA_BOS, LLAMA_EOS = "<s>", "</s>"
# "<|role|>\ncontent\n" per message, then "<|assistant|>\n" as the generation prompt
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ALPHABET = string.ascii_letters + string.digits + string.punctuation

CORPUS = [
    "The capital of France is Paris.",
    "Paris is the capital and the largest city of France.",
    "Berlin is the capital of Germany, and Rome is the capital of Italy.",
    "John lives in New York with his wife Mary.",
    "My name is Sarah and I live in London.",
    "The man is eating food at the table.",
    "A man is eating a piece of bread.",
    "The woman is eating bread and cheese for breakfast.",
    "A child is playing with a red ball in the park.",
    "The cat sat on the mat, and the dog slept by the door.",
    "I love this movie! It was wonderful and the acting was great.",
    "This film was terrible; I hated every minute of it.",
    "The food was okay, nothing special.",
    "What a fantastic day: the sun is shining and the sky is blue.",
    "The weather in New York is cold in January and hot in July.",
    "There are 12 months in a year and 7 days in a week.",
    "The train leaves at 10:30 and arrives at 14:45.",
    "In 2023, about 2.1 million people lived in Paris.",
    "She paid $25 for 3 books and 4 pens.",
    "He scored 99 points out of 100 on the test.",
    "Where does John work? He works at a bank in New York.",
    "Who wrote this book? It was written by a famous French author.",
    "Translate English to German: the house is wonderful.",
    "Summarize: the quick brown fox jumps over the lazy dog.",
    "The quick brown fox jumps over the lazy dog again and again.",
    "Machine learning models can classify text, answer questions and translate.",
    "The server returns a prediction for each request it receives.",
    "Please send me an email at the end of the day.",
    "We walked along the river and watched the boats go by.",
    "The students are reading books in the library.",
    "Apples, oranges and bananas are sold at the market.",
    "Can you tell me the way to the train station, please?",
    "The meeting was moved from Monday to Friday morning.",
    "Doctors say that eating fresh fruit and vegetables is good for you.",
    "The museum in Paris is open every day except Tuesday.",
    "Alice and Bob are friends; they often travel to Spain together.",
    "The river flows north through the city and into the sea.",
    "It is raining, so take an umbrella with you.",
    "Our team won the game by 3 goals to 1.",
    "The old man was eating soup while the young man drank coffee.",
    "New ideas often come from simple questions.",
    "Hello world! How are you today?",
]


def _by_frequency(counts):
    """Return the items of ``counts`` by decreasing count, then alphabetically."""
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))


def train_wordpiece_tokenizer(
    out_dir: str | Path, lowercase: bool = True, **tokenizer_kwargs
) -> BertTokenizer:
    """Build a BERT WordPiece tokenizer from :data:`CORPUS`, save it to ``out_dir`` and return it.

    The vocab is the special tokens, every character (plain and ``##``) and
    every corpus word, so unseen words split into characters.  It is counted,
    not trained: ``WordPieceTrainer`` numbers the ``##`` characters in hash-map
    order, so its merges (ties) and vocab change from run to run.

    ``tokenizer_kwargs`` (e.g. ``model_input_names``) go to ``BertTokenizer``
    and into ``tokenizer_config.json``, as does ``do_lower_case``; loading with
    ``AutoTokenizer.from_pretrained(out_dir, do_lower_case=False)`` overrides it.
    """
    normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words = Counter(
        word
        for text in CORPUS
        for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))
    )
    chars = sorted(set(normalizer.normalize_str(ALPHABET + "".join(CORPUS))) - {" "})
    tokens = BERT_SPECIAL_TOKENS + chars + ["##" + c for c in chars]
    tokens += [word for word, _ in _by_frequency(words) if len(word) > 1]

    tokenizer = Tokenizer(
        models.WordPiece({token: i for i, token in enumerate(tokens)}, unk_token="[UNK]")
    )
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[(token, tokens.index(token)) for token in ("[CLS]", "[SEP]")],
    )
    hf_tokenizer = BertTokenizer(
        tokenizer_object=tokenizer,
        do_lower_case=lowercase,
        model_max_length=MAX_LENGTH,
        **tokenizer_kwargs,
    )
    hf_tokenizer.save_pretrained(out_dir)
    return hf_tokenizer


def _train_bytelevel_bpe(special_tokens: list[str]) -> Tokenizer:
    """A byte-level BPE ``Tokenizer`` trained on :data:`CORPUS`; the special tokens come first.

    ``BpeTrainer`` is deterministic here: without a subword prefix every id
    comes from the sorted byte alphabet or from a merge.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def train_bytelevel_bpe_tokenizer(out_dir: str | Path) -> GPT2Tokenizer:
    """A GPT-2 byte-level BPE tokenizer trained on :data:`CORPUS`, saved to ``out_dir``."""
    tokenizer = _train_bytelevel_bpe([GPT2_EOS])
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    hf_tokenizer = GPT2Tokenizer(tokenizer_object=tokenizer, model_max_length=MAX_LENGTH)
    hf_tokenizer.save_pretrained(out_dir)
    return hf_tokenizer


def train_llama_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerFast:
    """A Llama-3-style byte-level BPE tokenizer (``<s>`` 0, ``</s>`` 1) with a chat template.

    Encoding adds ``<s>`` in front, and so does the chat template (as Llama's do): chat
    prompts are meant to be tokenized with ``add_special_tokens=False``.
    """
    tokenizer = _train_bytelevel_bpe([LLAMA_BOS, LLAMA_EOS])
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{LLAMA_BOS} $A",
                pair=f"{LLAMA_BOS} $A {LLAMA_BOS} $B",
                special_tokens=[(LLAMA_BOS, 0)],
            ),
        ]
    )
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=LLAMA_BOS,
        eos_token=LLAMA_EOS,
        model_max_length=MAX_LENGTH,
    )
    hf_tokenizer.chat_template = LLAMA_CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(out_dir)
    return hf_tokenizer


def train_t5_tokenizer(out_dir: str | Path) -> T5Tokenizer:
    """Build a T5 Unigram tokenizer (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2), save and return it.

    The pieces are ``"▁" + word`` for the corpus words and every single
    character, scored by add-one smoothed log frequency.  (``UnigramTrainer``
    is not deterministic: its scores vary from run to run.)
    """
    counts = Counter({char: 0 for char in ALPHABET + "▁"})
    for text in CORPUS:
        counts.update("▁" + word for word in re.findall(r"\w+", text))
        counts.update(text.replace(" ", "▁"))
    total = sum(counts.values()) + len(counts)
    vocab = [(token, 0.0) for token in T5_SPECIAL_TOKENS]
    vocab += [(piece, math.log((count + 1) / total)) for piece, count in _by_frequency(counts)]
    hf_tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=MAX_LENGTH)
    hf_tokenizer.save_pretrained(out_dir)
    return hf_tokenizer


def _bert_config(tokenizer, **kwargs):
    """Return a BERT config sized for ``tokenizer``: tiny, unless ``kwargs`` say otherwise."""
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 37}  # fmt: skip
    return BertConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_LENGTH,
        pad_token_id=tokenizer.pad_token_id,
        **{**sizes, **kwargs},
    )


def _save_model(model_class, config, out_dir: str | Path) -> Path:
    """Seed torch, build ``model_class(config)`` and save it to ``out_dir``."""
    torch.manual_seed(SEED)
    model_class(config).eval().save_pretrained(out_dir)
    return Path(out_dir)


def _labels(names):
    """``id2label`` / ``label2id`` config kwargs for the label ``names``."""
    return {
        "id2label": dict(enumerate(names)),
        "label2id": {name: i for i, name in enumerate(names)},
    }


def build_bert_fill_mask(out_dir: str | Path, **sizes: Any) -> Path:
    """BertForMaskedLM for the fill-mask task (``sizes``: BertConfig's, over the tiny ones)."""
    tokenizer = train_wordpiece_tokenizer(out_dir)
    return _save_model(BertForMaskedLM, _bert_config(tokenizer, **sizes), out_dir)


def build_bert_token_classification(out_dir: str | Path) -> Path:
    """BertForTokenClassification with NER labels (O, B-PER, I-PER, B-LOC, I-LOC)."""
    tokenizer = train_wordpiece_tokenizer(out_dir)
    config = _bert_config(tokenizer, **_labels(["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]))
    return _save_model(BertForTokenClassification, config, out_dir)


def build_bert_sequence_classification(out_dir: str | Path) -> Path:
    """BertForSequenceClassification with labels negative / neutral / positive."""
    tokenizer = train_wordpiece_tokenizer(out_dir)
    config = _bert_config(tokenizer, **_labels(["negative", "neutral", "positive"]))
    return _save_model(BertForSequenceClassification, config, out_dir)


def build_distilbert_sequence_classification(out_dir: str | Path) -> Path:
    """DistilBertForSequenceClassification (NEGATIVE / POSITIVE); no token_type_ids."""
    tokenizer = train_wordpiece_tokenizer(
        out_dir, model_input_names=["input_ids", "attention_mask"]
    )
    config = DistilBertConfig(
        vocab_size=len(tokenizer),
        dim=32,
        n_layers=2,
        n_heads=2,
        hidden_dim=37,
        max_position_embeddings=MAX_LENGTH,
        pad_token_id=tokenizer.pad_token_id,
        **_labels(["NEGATIVE", "POSITIVE"]),
    )
    return _save_model(DistilBertForSequenceClassification, config, out_dir)


def build_bert_embedding(out_dir: str | Path) -> Path:
    """Bare BertModel without sentence-transformers files."""
    tokenizer = train_wordpiece_tokenizer(out_dir)
    return _save_model(BertModel, _bert_config(tokenizer), out_dir)


def _write_json(path, data):
    """Write ``data`` as indented JSON (like sentence-transformers), creating parent folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def build_sentence_transformers(
    out_dir: str | Path, pooling: str = "cls", normalize: bool = True
) -> Path:
    """Bare BertModel plus sentence-transformers files for Transformer, Pooling[, Normalize].

    ``pooling`` is one of ``"cls"``, ``"mean"`` or ``"lasttoken"``.
    """
    if pooling not in ("cls", "mean", "lasttoken"):
        raise ValueError(f"unsupported pooling: {pooling!r}")
    out_dir = build_bert_embedding(out_dir)
    modules = [("Transformer", ""), ("Pooling", "1_Pooling")]
    if normalize:
        modules.append(("Normalize", "2_Normalize"))
        (out_dir / "2_Normalize").mkdir(exist_ok=True)  # sentence-transformers leaves it empty
    _write_json(
        out_dir / "modules.json",
        [
            {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{name}"}
            for i, (name, path) in enumerate(modules)
        ],
    )
    _write_json(
        out_dir / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": 32,
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": pooling == "lasttoken",
            "include_prompt": True,
        },
    )
    _write_json(
        out_dir / "sentence_bert_config.json",
        {"max_seq_length": MAX_LENGTH, "do_lower_case": False},
    )
    return out_dir


def build_gpt2_lm(out_dir: str | Path) -> Path:
    """GPT2LMHeadModel with a byte-level BPE tokenizer (``<|endoftext|>`` is bos, eos and unk)."""
    tokenizer = train_bytelevel_bpe_tokenizer(out_dir)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=MAX_LENGTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return _save_model(GPT2LMHeadModel, config, out_dir)


def build_llama(out_dir: str | Path, hidden_size: int = 32, max_length: int = MAX_LENGTH) -> Path:
    """LlamaForCausalLM (2 layers, 2 heads, 2 kv heads) with a byte-level BPE chat tokenizer.

    vLLM's CPU attention needs a head size of at least 32: ``hidden_size=64`` or more for it.
    """
    tokenizer = train_llama_tokenizer(out_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max_length,
        initializer_range=0.4,  # 20x the default: greedy text that varies with the context
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return _save_model(LlamaForCausalLM, config, out_dir)


def build_t5(out_dir: str | Path) -> Path:
    """T5ForConditionalGeneration with a Unigram tokenizer; decoding starts at ``<pad>`` (0)."""
    tokenizer = train_t5_tokenizer(out_dir)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_ff=37,
        d_kv=16,
        num_layers=2,
        num_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config.decoder_start_token_id = tokenizer.pad_token_id  # not among T5Config's parameters
    return _save_model(T5ForConditionalGeneration, config, out_dir)


ENCODER_TASK_HEADS = {
    "fill_mask": "AutoModelForMaskedLM",
    "token_classification": "AutoModelForTokenClassification",
    "sequence_classification": "AutoModelForSequenceClassification",
    "text_embedding": "AutoModel",
}
"""The auto class of each encoder task's model."""

TOKEN_TYPES = frozenset({"bert", "electra", "albert", "deberta-v2"})
"""Architectures whose tokenizers give ``token_type_ids`` (the others' tokenizers do not)."""


def _architecture_config(architecture: str, vocab_size: int, pad_token_id: int):
    """A tiny config of ``architecture`` (2 layers, 2 heads, hidden size 32)."""
    import transformers

    sizes = {
        "vocab_size": vocab_size,
        "pad_token_id": pad_token_id,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 37,
        "max_position_embeddings": MAX_LENGTH,
    }
    offset_positions = {"max_position_embeddings": MAX_LENGTH + 2}  # positions from pad + 1
    configs: dict[str, tuple[str, dict[str, Any]]] = {
        "bert": ("BertConfig", {}),
        "roberta": ("RobertaConfig", {**offset_positions, "type_vocab_size": 1}),
        "xlm-roberta": ("XLMRobertaConfig", {**offset_positions, "type_vocab_size": 1}),
        "electra": ("ElectraConfig", {"embedding_size": 16}),
        "albert": ("AlbertConfig", {"embedding_size": 16}),
        "mpnet": ("MPNetConfig", offset_positions),
        # DeBERTa-v3's attention: relative positions in buckets, no absolute positions
        "deberta-v2": (
            "DebertaV2Config",
            {
                "relative_attention": True,
                "position_buckets": 32,
                "max_relative_positions": -1,
                "pos_att_type": ["p2c", "c2p"],
                "position_biased_input": False,
                "norm_rel_ebd": "layer_norm",
                "share_att_key": True,
                "type_vocab_size": 2,
            },
        ),
        "modernbert": (
            "ModernBertConfig",
            {"global_attn_every_n_layers": 2, "local_attention": 8},
        ),
    }
    if architecture == "distilbert":
        return DistilBertConfig(
            vocab_size=vocab_size,
            dim=32,
            n_layers=2,
            n_heads=2,
            hidden_dim=37,
            max_position_embeddings=MAX_LENGTH,
            pad_token_id=pad_token_id,
        )
    name, extra = configs[architecture]
    return getattr(transformers, name)(**{**sizes, **extra})


def build_encoder_architecture(
    out_dir: str | Path, architecture: str, task: str, cross_encoder: bool = False
) -> Path:
    """A tiny random model of ``architecture`` (a ``model_type``: bert, roberta, distilbert,
    deberta-v2, electra, albert, xlm-roberta, mpnet, modernbert) for an encoder ``task``, with
    the WordPiece tokenizer (giving ``token_type_ids`` only where the architecture's own
    tokenizers do). ``cross_encoder``: a sequence classifier with one label (a reranker)."""
    import transformers

    names = ["input_ids", "attention_mask"]
    if architecture in TOKEN_TYPES:
        names.insert(1, "token_type_ids")
    tokenizer = train_wordpiece_tokenizer(out_dir, model_input_names=names)
    config = _architecture_config(architecture, len(tokenizer), tokenizer.pad_token_id)
    if architecture == "modernbert":
        config.cls_token_id, config.sep_token_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    if task == "sequence_classification":
        config.update(_labels(["score"] if cross_encoder else ["negative", "neutral", "positive"]))
    elif task == "token_classification":
        config.update(_labels(["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]))
    auto_class = getattr(transformers, ENCODER_TASK_HEADS[task])
    torch.manual_seed(SEED)
    auto_class.from_config(config).eval().save_pretrained(out_dir)
    return Path(out_dir)


BUILDERS: dict[str, Callable[[str | Path], Path]] = {
    "bert_fill_mask": build_bert_fill_mask,
    # head size 32, which vLLM's CPU attention takes: its refusals are about the task, not this
    "bert_fill_mask64": partial(build_bert_fill_mask, hidden_size=64),
    "bert_token_classification": build_bert_token_classification,
    "bert_sequence_classification": build_bert_sequence_classification,
    "distilbert_sequence_classification": build_distilbert_sequence_classification,
    "bert_embedding": build_bert_embedding,
    "st_cls": partial(build_sentence_transformers, pooling="cls"),
    "st_mean_nonorm": partial(build_sentence_transformers, pooling="mean", normalize=False),
    "st_lasttoken": partial(build_sentence_transformers, pooling="lasttoken"),
    "gpt2": build_gpt2_lm,
    "llama": build_llama,
    "llama64": partial(build_llama, hidden_size=64),  # head size 32: what vLLM's CPU build needs
    "t5": build_t5,
}


def build_all(root: str | Path) -> dict[str, Path]:
    """Build every tiny model into ``root/<name>`` and return ``{name: path}``."""
    root = Path(root)
    return {name: builder(root / name) for name, builder in BUILDERS.items()}


LORA_TARGETS = ("q_proj", "v_proj", "down_proj")


def build_lora_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    seed: int,
    targets: tuple[str, ...] = LORA_TARGETS,
    modules_to_save: tuple[str, ...] = (),
) -> Path:
    """A random LoRA adapter (PEFT) for the tiny Llama at ``base_dir``, on the ``targets``
    modules: its A and B matrices both random (``init_lora_weights=False``; PEFT's default B
    of zeros changes nothing) and scaled up, so that greedy text differs from the base model's
    and from another seed's; ``modules_to_save``: modules it replaces whole, their weights
    changed at random."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base_dir)
    config = LoraConfig(
        r=4,
        lora_alpha=64,
        target_modules=list(targets),
        init_lora_weights=False,
        task_type="CAUSAL_LM",
        modules_to_save=list(modules_to_save) or None,
    )
    adapted = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if ".modules_to_save." in name:
                parameter.add_(torch.randn_like(parameter))
    adapted.save_pretrained(str(out_dir))
    return Path(out_dir)
