"""Task names and the architecture -> task table (CONTRACT.md section 1, task inference)."""

from __future__ import annotations

import pytest

from huggingfaceserver.errors import StartupError
from huggingfaceserver.tasks import Task, infer_task

ALL_TASKS_IN_ORDER = (
    "text_generation, text2text_generation, fill_mask, token_classification, "
    "sequence_classification, text_embedding, sparse_embedding"
)


@pytest.mark.parametrize(
    ("architecture", "task"),
    [
        ("BertForMaskedLM", Task.fill_mask),
        ("RobertaForMaskedLM", Task.fill_mask),
        ("XForTokenClassification", Task.token_classification),
        ("XForSequenceClassification", Task.sequence_classification),
        ("LlamaForCausalLM", Task.text_generation),
        ("GPT2LMHeadModel", Task.text_generation),
        ("T5ForConditionalGeneration", Task.text2text_generation),
        ("MTModel", Task.text2text_generation),
        ("EncoderDecoderModel", Task.text2text_generation),
        ("BertModel", Task.text_embedding),
    ],
)
def test_architecture_maps_to_its_task(architecture, task):
    assert infer_task([architecture], sentence_model_type=None) is task


def test_marian_translation_models_are_text2text():
    assert infer_task(["MarianMTModel"], sentence_model_type=None) is Task.text2text_generation


def test_every_architecture_entry_is_tried():
    architectures = ["SomethingUnknown", "BertForMaskedLM"]
    assert infer_task(architectures, sentence_model_type=None) is Task.fill_mask


def test_the_first_architecture_that_names_a_task_wins():
    architectures = ["BertForSequenceClassification", "BertForMaskedLM"]
    assert infer_task(architectures, sentence_model_type=None) is Task.sequence_classification


@pytest.mark.parametrize(
    "architectures", [["BertForMaskedLM"], ["LlamaForCausalLM"], ["SomethingUnknown"], None]
)
@pytest.mark.parametrize(
    ("model_type", "task"),
    [
        ("SentenceTransformer", Task.text_embedding),
        ("SparseEncoder", Task.sparse_embedding),
        ("CrossEncoder", Task.sequence_classification),
    ],
)
def test_sentence_transformers_folders_are_what_their_model_type_says(
    architectures, model_type, task
):
    assert infer_task(architectures, sentence_model_type=model_type) is task


@pytest.mark.parametrize("architectures", [["SomethingUnknown", "AlsoUnknown"], [], None])
def test_unknown_architectures_list_every_task(architectures):
    with pytest.raises(StartupError) as error:
        infer_task(architectures, sentence_model_type=None)
    message = str(error.value)
    assert message.endswith(f"pass --task, one of: {ALL_TASKS_IN_ORDER}")
    for architecture in architectures or []:
        assert architecture in message
    assert "\n" not in message


def test_error_lists_tasks_in_enum_order():
    assert ", ".join(task.value for task in Task) == ALL_TASKS_IN_ORDER


@pytest.mark.parametrize(
    ("value", "task"),
    [
        ("fill_mask", Task.fill_mask),
        ("fill-mask", Task.fill_mask),
        ("Fill-Mask", Task.fill_mask),
        (" TEXT_EMBEDDING ", Task.text_embedding),
        ("text2text-generation", Task.text2text_generation),
        ("sequence-classification", Task.sequence_classification),
    ],
)
def test_task_parse_ignores_dashes_and_case(value, task):
    assert Task.parse(value) is task


def test_task_parse_rejects_unknown_names_listing_the_tasks():
    with pytest.raises(StartupError) as error:
        Task.parse("summarization")
    message = str(error.value)
    assert "'summarization'" in message
    assert message.endswith(ALL_TASKS_IN_ORDER)


@pytest.mark.parametrize("task", list(Task))
def test_only_generation_tasks_are_generative(task):
    assert task.is_generative == task.value.endswith("generation")
