"""The messages between front and engine processes: rows packed into one message and back,
every message type through msgpack unchanged, and failures carried with their status."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from huggingfaceserver.errors import (
    BadRequest,
    ClientClosedRequest,
    NotFound,
    NotReady,
    ServerError,
)
from huggingfaceserver.generation.params import (
    ChoiceDelta,
    Constraint,
    SamplingParams,
    TokenLogprob,
)
from huggingfaceserver.topology.engine.messages import (
    Abort,
    Deltas,
    Encode,
    EngineError,
    EngineFault,
    EngineState,
    Failed,
    Finished,
    Generate,
    Hello,
    ModelFacts,
    Results,
    decode,
    encode,
    failure,
    failure_error,
    pack_rows,
    unpack_rows,
)


def row(length: int, start: int = 0) -> dict[str, np.ndarray]:
    """A token-classification row: ids, token types and (start, end) character offsets."""
    ids = np.arange(start, start + length, dtype=np.int64)
    offsets = np.stack([ids * 3, ids * 3 + 2], axis=1)
    return {"input_ids": ids, "token_type_ids": ids % 2, "offset_mapping": offsets}


def assert_same_rows(got: list[dict[str, np.ndarray]], rows: list[dict[str, np.ndarray]]):
    assert len(got) == len(rows)
    for back, sent in zip(got, rows, strict=True):
        assert set(back) == set(sent)
        for key, values in sent.items():
            assert back[key].dtype == np.int64, key
            assert back[key].shape == values.shape, key
            np.testing.assert_array_equal(back[key], values, err_msg=key)


@pytest.mark.parametrize("lengths", [[5], [3, 1, 7], [1, 1]])
def test_rows_come_back_as_they_were_packed(lengths):
    rows = [row(n, start=10 * i) for i, n in enumerate(lengths)]
    message = pack_rows(7, rows, "task")
    assert (message.id, message.kind, message.lengths) == (7, "task", lengths)
    assert message.widths == {"input_ids": 1, "token_type_ids": 1, "offset_mapping": 2}
    assert_same_rows(unpack_rows(message), rows)


def test_packed_rows_survive_msgpack():
    rows = [row(4), {key: values[:2] for key, values in row(9, 40).items()}]
    [message] = decode(encode([pack_rows(3, rows, "pair")]))
    assert isinstance(message, Encode) and message.kind == "pair"
    assert_same_rows(unpack_rows(message), rows)


def test_rows_of_ids_alone():
    rows = [{"input_ids": np.array([101, 7, 102], dtype=np.int64)}]
    message = pack_rows(1, rows, "task")
    assert message.widths == {"input_ids": 1}
    assert_same_rows(unpack_rows(message), rows)


EVERY_MESSAGE = [
    Hello(1),
    EngineState(False, 0),
    EngineState(True, 2, ModelFacts(128, 512, False)),
    EngineState(True, 1, ModelFacts(128, 512, False, 4096)),
    pack_rows(1, [row(3)], "task"),
    Results(2, [[0.25, -1.5], {"negative": 0.1, "positive": 0.9}, 3, "paris", None]),
    Generate(3, [0, 17, 42], SamplingParams()),
    Generate(
        4,
        [5],
        SamplingParams(
            n=2,
            max_tokens=9,
            min_tokens=1,
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            min_p=0.05,
            seed=123,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            logit_bias={7: -100.0, 8: 2.5},
            stop=("\n", "END"),
            stop_token_ids=(1, 2),
            ignore_eos=True,
            logprobs=2,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
        ),
        adapter="sql-lora",
    ),
    Deltas(
        5,
        [
            ChoiceDelta(0, "", [17]),
            ChoiceDelta(1, "", [2], [TokenLogprob(2, -0.25, ((2, -0.25), (9, -1.75)))], "length"),
        ],
    ),
    Finished(6),
    Failed(7, 400, "input 0 has no tokens"),
    Abort(8),
    Abort(9, [0, 2]),
    Generate(  # structured output after a reasoning parser's end marker
        10, [5], SamplingParams(constraint=Constraint("choice", '["a"]', after="</think>"))
    ),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips(message):
    [back] = decode(encode([message]))
    assert type(back) is type(message)
    if isinstance(message, Encode):
        assert back.columns == message.columns and back.lengths == message.lengths
    else:
        assert back == message


def test_messages_travel_together_in_order():
    assert decode(encode(EVERY_MESSAGE[-4:])) == EVERY_MESSAGE[-4:]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1 not msgpack",
        msgspec.msgpack.encode([["exec", "import os"]]),  # an unknown tag
        msgspec.msgpack.encode([["abort", "not an id"]]),  # a known tag, the wrong field type
        msgspec.msgpack.encode({"hello": 1}),  # not a list of messages
    ],
    ids=["garbage", "unknown-tag", "wrong-type", "not-a-list"],
)
def test_anything_but_our_messages_is_a_decode_error(payload):
    with pytest.raises(msgspec.DecodeError):
        decode(payload)


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (BadRequest("input 0 has no tokens"), 400, BadRequest),
        (NotReady("the model is not loaded"), 503, NotReady),
    ],
    ids=["bad-request", "not-ready"],
)
def test_a_failure_is_raised_in_the_front_with_its_status(error, status, kind):
    failed = failure(11, error)
    assert (failed.id, failed.status) == (11, status)
    [back] = decode(encode([failed]))
    raised = failure_error(back)
    assert type(raised) is kind
    assert raised.status_code == status
    assert raised.message == failed.message
    assert str(error) in raised.message


def test_an_unexpected_exception_stays_in_the_engine_log(caplog):
    """Not one of ours: the front gets a generic fault (answered as any unexpected error, a
    generic 500); the exception, with its traceback, is logged in the engine."""
    try:
        raise RuntimeError("CUDA out of memory at 0xdeadbeef")
    except RuntimeError as exc:
        failed = failure(11, exc)
    [back] = decode(encode([failed]))
    raised = failure_error(back)
    assert type(raised) is EngineFault and not isinstance(raised, ServerError)
    assert "0xdeadbeef" not in str(raised) and "11" in str(raised)
    [record] = [r for r in caplog.records if r.name.endswith("engine.messages")]
    assert "0xdeadbeef" in record.getMessage() and record.exc_info is not None


@pytest.mark.parametrize("error", [NotFound("no such adapter"), ClientClosedRequest("gone")])
def test_other_statuses_are_kept(error):
    raised = failure_error(failure(1, error))
    assert isinstance(raised, EngineError)
    assert (raised.status_code, raised.message) == (error.status_code, error.message)
