"""Texts out of KServe V1 bodies and Open Inference Protocol (V2) requests, checked.

The number of texts is checked against ``--max_inputs_per_request`` first, before any of
them is decoded.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from kserve.protocol.infer_type import InferRequest

from ..errors import BadRequest
from .limits import check_input_count


def _check_texts(values: list[Any], where: str) -> list[str]:
    if not values:
        raise BadRequest(f"{where} is empty: send at least one text")
    texts = []
    for index, value in enumerate(values):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest(f"{where}[{index}] is not valid UTF-8") from None
        if not isinstance(value, str):
            raise BadRequest(
                f"{where}[{index}] must be a string, got {type(value).__name__}: {value!r:.60}"
            )
        texts.append(value)
    return texts


def texts_from_v1(payload: Any, max_inputs: int) -> list[str]:
    """``{"instances": [...]}`` (or ``{"inputs": [...]}``) -> texts.

    KServe hands over the raw bytes when the content type is not JSON (curl's default form
    encoding): those are parsed here.
    """
    if isinstance(payload, (bytes, bytearray)):
        try:
            payload = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequest('request body must be a JSON object like {"instances": ["text"]}')
    for key in ("instances", "inputs"):
        if key in payload:
            values = payload[key]
            if isinstance(values, str):
                values = [values]
            if not isinstance(values, list):
                raise BadRequest(f'"{key}" must be a list of strings')
            check_input_count(len(values), max_inputs, key)
            return _check_texts(values, key)
    raise BadRequest('request body needs "instances" (a list of strings)')


def texts_from_v2(request: InferRequest, max_inputs: int) -> list[str]:
    """One BYTES input of shape ``[N]`` (or ``[N, 1]``) -> N texts."""
    if len(request.inputs) != 1:
        raise BadRequest(f"expected exactly one input tensor of texts, got {len(request.inputs)}")
    tensor = request.inputs[0]
    name = f"input {tensor.name!r}"
    if tensor.datatype != "BYTES":
        raise BadRequest(f"{name} must have datatype BYTES, got {tensor.datatype}")
    shape = list(tensor.shape)
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
        raise BadRequest(f"{name} must have shape [N] or [N, 1], got {shape}")
    check_input_count(int(shape[0]), max_inputs, "texts")
    data = tensor.data
    if isinstance(data, list):  # REST: decoded JSON, which the shape may understate
        check_input_count(len(data), max_inputs, "texts")
    try:
        array = tensor.as_numpy()
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"{name}: data does not match shape {shape}: {exc}") from None
    if array.size != int(np.prod(shape)):
        raise BadRequest(f"{name}: {array.size} values for shape {shape}")
    return _check_texts(array.reshape(-1).tolist(), name)
