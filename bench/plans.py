"""Prebuilt requests for the lean load generator (:mod:`bench.fastload`)."""

from __future__ import annotations

import orjson

from . import texts
from .fastload import Plan, http_request

HOST = "127.0.0.1"


def v1_predict(model: str, duration_s: float, texts_per_request: int = 1, port: int = 0) -> Plan:
    """V1 ``:predict`` requests of ``texts_per_request`` sentences each (the sentences in
    turn), each answered by a 200 with ``predictions``."""
    path = f"/v1/models/{model}:predict"
    sentences = texts.SENTENCES
    requests = []
    for i in range(len(sentences)):
        start = i * texts_per_request
        instances = [sentences[(start + j) % len(sentences)] for j in range(texts_per_request)]
        requests.append(http_request("POST", path, HOST, orjson.dumps({"instances": instances})))
    return Plan(HOST, port, tuple(requests), b'"predictions"', duration_s)


def health_live(duration_s: float, port: int = 0) -> Plan:
    """``GET /v2/health/live``: the HTTP stack and nothing else."""
    return Plan(HOST, port, (http_request("GET", "/v2/health/live", HOST),), b"live", duration_s)
