"""Embedding vectors on NumPy: sentence-transformers' similarity functions
(``similarity_fn_name``: how an embedding model compares a query's vector with documents',
higher is more similar), L2 normalisation and Matryoshka truncation (``dimensions``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..errors import BadRequest

Vectors = Sequence[Sequence[float]] | np.ndarray
MIN_NORM = 1e-12
"""torch's ``F.normalize`` floor: a zero vector stays zero."""


def unit(vectors: Vectors) -> np.ndarray:
    """Each vector (the last axis) L2-normalised."""
    array = np.asarray(vectors, dtype=np.float64)
    return array / np.maximum(np.linalg.norm(array, axis=-1, keepdims=True), MIN_NORM)


def first_dimensions(vectors: Vectors, dimensions: int) -> np.ndarray:
    """The first ``dimensions`` values of each vector (a 400 beyond the model's)."""
    array = np.asarray(vectors, dtype=np.float64)
    width = array.shape[-1] if array.size else 0
    if dimensions > width:
        raise BadRequest(f"dimensions {dimensions} exceeds the model's {width} dimensions")
    return array[..., :dimensions]


def cosine(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    return unit(documents) @ unit(query)


def dot(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    return documents @ query


def euclidean(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    return -np.linalg.norm(documents - query, axis=-1)


def manhattan(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    return -np.abs(documents - query).sum(axis=-1)


SIMILARITIES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "cosine": cosine,
    "dot": dot,
    "euclidean": euclidean,
    "manhattan": manhattan,
}


def similarities(name: str, query: Sequence[float], documents: Vectors) -> list[float]:
    """Each document's similarity to the query, by the model's function ``name``."""
    vectors = np.asarray(documents, dtype=np.float64)
    return SIMILARITIES[name](np.asarray(query, dtype=np.float64), vectors).tolist()
