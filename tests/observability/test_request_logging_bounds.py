"""A request's logged inputs are bounded: ``--max_log_len`` characters (512 by default) of
their repr, then their whole length, at a cost that does not grow with the inputs."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from huggingfaceserver.observability.request_notes import preview
from tests.harness import ServerProcess, run_server
from tiny_models import build_bert_sequence_classification


def test_inputs_that_fit_are_shown_whole():
    texts = ["the capital of France", 'it\'s "quoted"\n', ""]
    assert preview(texts, 512) == repr(texts)
    assert preview(texts, len(repr(texts))) == repr(texts)
    assert preview([], 512) == "[]"


@pytest.mark.parametrize("texts", [["a"], ["abc", "de", "", "fghij"], ["x" * 40]])
def test_a_cut_shows_the_first_characters_of_the_repr_then_the_whole_length(texts):
    whole = repr(texts)
    chars = sum(len(text) for text in texts)
    for limit in range(len(whole)):
        assert preview(texts, limit) == f"{whole[:limit]}... ({chars} characters, {limit} shown)"


def test_zero_shows_no_input_character():
    assert preview(["secret"], 0) == "... (6 characters, 0 shown)"
    assert preview(["secret"], -1) == preview(["secret"], 0)


def test_the_line_stays_one_line():
    assert "\n" not in preview(["line\n" * 1000], 100)


class WholeText(str):
    """A text that counts the characters taken from it and refuses a repr of itself whole."""

    taken = 0

    def __getitem__(self, key):  # type: ignore[override]
        piece = super().__getitem__(key)
        WholeText.taken += len(piece)
        return piece

    def __repr__(self) -> str:
        raise AssertionError("repr of a whole text")


class WholeList(list):
    def __repr__(self) -> str:
        raise AssertionError("repr of the whole list")


@pytest.mark.parametrize(
    ("count", "size"), [(1, 16 * 1024 * 1024), (1024, 16 * 1024), (1024, 0), (1024, 1)]
)
def test_the_cost_is_bounded_by_the_limit_not_the_inputs(count, size):
    texts = WholeList(WholeText("é" * size) for _ in range(count))
    WholeText.taken = 0
    shown = preview(texts, 512)
    assert WholeText.taken <= 512 + 1  # characters read from the texts, whatever their size
    note = f"... ({count * size} characters, 512 shown)"
    assert len(shown) <= 512 + len(note) and shown.endswith(note)


# --- a real server ---------------------------------------------------------------------------

BODY_MIB = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    folder = build_bert_sequence_classification(tmp_path_factory.mktemp("classifier"))
    args = ["--model_dir", str(folder), "--model_name", "m", "--backend", "huggingface"]
    with run_server(args, Path(folder)) as process:
        yield process


@pytest.mark.slow
@pytest.mark.parametrize("instances", [1, 1024], ids=["one-text", "many-texts"])
def test_a_4_mib_body_costs_a_short_log_line_that_notes_its_size(server, instances):
    chars = BODY_MIB * 1024 * 1024 // instances
    text = ("the quick brown fox " * (chars // 20 + 1))[:chars]
    since = len(server.log())
    request_id = f"big-{instances}"
    response = httpx.post(
        f"{server.url}/v1/models/m:predict",
        json={"instances": [text] * instances},
        headers={"x-request-id": request_id},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["predictions"]) == instances  # the data is whole
    line = server.wait_for_log(rf"[^\n]* request {request_id} [^\n]*\n", since).group(0)
    assert len(line.encode()) < 1024, line
    assert line.endswith(f"... ({chars * instances} characters, 512 shown)\n")
    assert f"{repr([text] * instances)[:512]}..." in line
    assert re.search(
        rf'"POST /v1/models/m:predict" 200 [\d.]+ ms model=m instances={instances} ', line
    )
