"""Instances out of KServe V1 bodies and Open Inference Protocol (V2) requests, checked.

An instance is a text, or for a sequence classifier (a cross-encoder) a pair of texts: a V1
instance ``["query", "document"]``, a V2 BYTES tensor of shape ``[N, 2]``. The number of
instances is checked against ``--max_inputs_per_request`` first, before any of them is
decoded. A request's ``parameters`` choose a prompt and a truncation
(:mod:`.encode_fields`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from kserve.protocol.infer_type import InferRequest, to_http_parameters

from ..encoder_tasks.params import EncodeParams, Instance
from ..errors import BadRequest
from .encode_fields import params_from
from .limits import check_input_count


@dataclass(frozen=True)
class Instances:
    """A request's instances and what it asked of them."""

    items: list[Instance]
    params: EncodeParams

    @property
    def texts(self) -> list[str]:
        """The texts of the instances (both of a pair's), as the request log shows them."""
        return [t for item in self.items for t in ((item,) if isinstance(item, str) else item)]


def _check_text(value: Any, where: str) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"{where} is not valid UTF-8") from None
    if not isinstance(value, str):
        raise BadRequest(f"{where} must be a string, got {type(value).__name__}: {value!r:.60}")
    return value


def _check_texts(values: list[Any], where: str) -> list[str]:
    if not values:
        raise BadRequest(f"{where} is empty: send at least one text")
    return [_check_text(value, f"{where}[{index}]") for index, value in enumerate(values)]


def _check_instances(values: list[Any], where: str, pairs: bool) -> list[Instance]:
    """Texts, and where ``pairs`` are read text pairs (two-element lists)."""
    if not values:
        raise BadRequest(f"{where} is empty: send at least one text")
    items: list[Instance] = []
    for index, value in enumerate(values):
        at = f"{where}[{index}]"
        if pairs and isinstance(value, list):
            if len(value) != 2:
                raise BadRequest(f"{at} must be a text or a pair of texts, got {len(value)} items")
            items.append((_check_text(value[0], f"{at}[0]"), _check_text(value[1], f"{at}[1]")))
        else:
            items.append(_check_text(value, at))
    return items


def instances_from_v1(payload: Any, max_inputs: int, pairs: bool = False) -> Instances:
    """``{"instances": [...], "parameters": {...}}`` (or ``{"inputs": [...]}``) -> instances.

    KServe hands over the raw bytes when the content type is not JSON (curl's default form
    encoding): those are parsed here. An unknown parameter is a 400.
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
            items = _check_instances(values, key, pairs)
            return Instances(items, params_from(payload.get("parameters"), strict=True))
    raise BadRequest('request body needs "instances" (a list of strings)')


def instances_from_v2(request: InferRequest, max_inputs: int, pairs: bool = False) -> Instances:
    """One BYTES input of shape ``[N]`` (or ``[N, 1]``) -> N texts; ``[N, 2]`` -> N pairs
    where ``pairs`` are read. Request parameters this server does not know are left alone
    (clients add their own)."""
    if len(request.inputs) != 1:
        raise BadRequest(f"expected exactly one input tensor of texts, got {len(request.inputs)}")
    tensor = request.inputs[0]
    name = f"input {tensor.name!r}"
    if tensor.datatype != "BYTES":
        raise BadRequest(f"{name} must have datatype BYTES, got {tensor.datatype}")
    shape = list(tensor.shape)
    widths = (1, 2) if pairs else (1,)
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] in widths)):
        accepted = "[N], [N, 1] or [N, 2] (text pairs)" if pairs else "[N] or [N, 1]"
        raise BadRequest(f"{name} must have shape {accepted}, got {shape}")
    check_input_count(int(shape[0]), max_inputs, "texts")
    data = tensor.data
    if isinstance(data, list):  # REST: decoded JSON, which the shape may understate
        check_input_count(len(data), max_inputs, "texts")
    try:
        array = tensor.as_numpy()
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"{name}: data does not match shape {shape}: {exc}") from None
    except struct.error as exc:  # raw BYTES whose length prefixes overrun the data
        raise BadRequest(f"{name}: its raw BYTES are not length-prefixed strings: {exc}") from None
    if array.size != int(np.prod(shape)):
        raise BadRequest(f"{name}: {array.size} values for shape {shape}")
    texts = _check_texts(array.reshape(-1).tolist(), name)
    items: list[Instance] = list(texts)
    if len(shape) == 2 and shape[1] == 2:
        items = list(zip(texts[0::2], texts[1::2], strict=True))
    parameters = request.parameters
    plain = to_http_parameters(parameters) if parameters else None
    return Instances(items, params_from(plain, strict=False))
