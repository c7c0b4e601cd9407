"""sentence-transformers' similarity functions (``similarity_fn_name``), on NumPy: how an
embedding model compares a query's vector with documents' (higher is more similar)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Vectors = Sequence[Sequence[float]] | np.ndarray


def _unit(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def cosine(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    return _unit(documents) @ _unit(query)


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
