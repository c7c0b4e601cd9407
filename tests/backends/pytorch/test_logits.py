"""The row-wise pieces of a decode step on small hand-made logits, with transformers' own logits
processors as the oracle: the sampling filters and the penalties, each row with its own
values."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from huggingfaceserver.backends.pytorch.logits import filter_for_sampling
from huggingfaceserver.backends.pytorch.penalties import (
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
)

NEG_INF = float("-inf")


def column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).unsqueeze(1)


def random_logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def occurrences(logits: torch.Tensor, token_ids: list[list[int]]) -> torch.Tensor:
    counts = torch.zeros_like(logits)
    for row, ids in enumerate(token_ids):
        for token in ids:
            counts[row, token] += 1
    return counts


def test_repetition_penalty_matches_transformers() -> None:
    logits = random_logits(rows=2)
    seen = [[1, 4, 4, 7], [2, 3]]
    expected = torch.cat(
        [
            RepetitionPenaltyLogitsProcessor(penalty)(
                torch.tensor([ids]), logits[i : i + 1].clone()
            )
            for i, (ids, penalty) in enumerate(zip(seen, [1.3, 0.7], strict=True))
        ]
    )
    apply_repetition_penalty(logits, occurrences(logits, seen) > 0, column([1.3, 0.7]))
    torch.testing.assert_close(logits, expected)


def test_presence_and_frequency_penalties_count_the_output() -> None:
    logits = torch.zeros(2, 4)
    counts = occurrences(logits, [[1, 1, 2], []])
    apply_presence_frequency_penalties(logits, counts, column([0.5, 0.5]), column([0.25, 0.25]))
    assert logits.tolist() == [[0, -1.0, -0.75, 0], [0] * 4]


def filters(
    temperature: list[float],
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
) -> dict[str, object]:
    return {
        "temperature": column(temperature),
        "top_k": None if top_k is None else torch.tensor(top_k),
        "top_p": None if top_p is None else column(top_p),
        "min_p": None if min_p is None else column(min_p),
        "max_top_k": max(top_k or [0]),
    }


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(0.7, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.3, 10, 0.9, 0.05)],
)
def test_sampling_filters_match_transformers(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    logits = random_logits(rows=1)
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    if min_p:
        expected = MinPLogitsWarper(min_p)(None, expected)
    actual = filter_for_sampling(logits, **filters([temperature], [top_k], [top_p], [min_p]))  # type: ignore[arg-type]
    torch.testing.assert_close(actual, expected)


def test_sampling_filters_apply_per_row() -> None:
    logits = random_logits(rows=3)
    actual = filter_for_sampling(logits, **filters([1.0] * 3, [3, 0, 0], [1.0, 0.5, 1.0]))  # type: ignore[arg-type]
    assert (actual[0] > NEG_INF).sum() == 3
    assert 1 <= (actual[1] > NEG_INF).sum() < logits.shape[1]
    assert torch.equal(actual[2], logits[2])


def test_each_row_is_filtered_as_it_would_be_alone() -> None:
    logits = random_logits(rows=4, vocab=80, seed=3)
    settings = ([0.5, 1.0, 1.7, 1.0], [5, 0, 12, 2], [1.0, 0.7, 0.9, 1.0], [0.0, 0.1, 0.0, 0.2])
    together = filter_for_sampling(logits, **filters(*settings))  # type: ignore[arg-type]
    for i in range(4):
        alone = filter_for_sampling(logits[i : i + 1], **filters(*([s[i]] for s in settings)))  # type: ignore[arg-type]
        assert torch.equal(together[i], alone[0])
