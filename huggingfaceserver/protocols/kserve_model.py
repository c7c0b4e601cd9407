"""The KServe V1/V2 face of an encoder backend: a ``kserve.Model``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kserve import Model
from kserve.errors import ModelNotReady
from kserve.protocol.infer_type import InferRequest, InferResponse

from ..backends.base import EncoderBackend, GenerationBackend
from ..cli import ServerConfig
from ..errors import BadRequest
from ..generation.defaults import NO_DEFAULTS, SamplingDefaults
from ..generation.params import SamplingParams
from ..generation.reasoning import ReasoningFormat
from ..loading import freeze_loaded_heap
from ..observability import request_notes
from ..observability.request_ids import new_request_id
from ..observability.startup import STARTUP
from ..tasks import Task
from .kserve_inputs import Instances, instances_from_v1, instances_from_v2

logger = logging.getLogger(__name__)


@dataclass
class EncoderCall:
    """A decoded request on its way through preprocess -> predict -> postprocess."""

    request_id: str
    instances: Instances
    v2: InferRequest | None = None
    results: list[Any] | None = None

    @property
    def texts(self) -> list[str]:
        return self.instances.texts


@dataclass(frozen=True)
class RequestLogging:
    enabled: bool
    max_len: int
    """Characters of the inputs' repr shown (``--max_log_len``)."""

    def log(self, call: EncoderCall, model: str) -> None:
        """The request's inputs, cut to ``max_len``, on its gateway log line, or on a line of
        their own."""
        if not self.enabled:
            return
        shown = request_notes.preview(call.texts, self.max_len)
        detail = f"model={model} instances={len(call.instances.items)} {shown}"
        if not request_notes.add(detail):
            logger.info("request %s %s", call.request_id, detail)


class BackendModel(Model):
    """A backend registered with KServe: listed, health-checked, loaded once in the background."""

    backend: EncoderBackend | GenerationBackend
    max_inputs_per_request: int
    """Texts or prompts per request (``--max_inputs_per_request``)."""

    def __init__(self, name: str, task: Task):
        super().__init__(name)
        self.task = task

    def load(self) -> bool:
        """Loading happens once, in :meth:`load_backend`; kserve may call this on a request."""
        if not self.ready:
            raise ModelNotReady(self.name, "The model is still loading.")
        return True

    def load_backend(self) -> None:
        """Blocking: load tokenizer and weights (ready only after :meth:`warm_up`)."""
        self.backend.load()
        with STARTUP.phase("tune"):
            self.backend.tune()
        freeze_loaded_heap()

    async def warm_up(self) -> None:
        """One inference through the whole serving path before readiness: the first request
        pays for lazy initialisation (kernels, caches, threads), not a user's."""

    async def explain(self, payload: Any, headers: dict[str, str] | None = None) -> Any:
        raise BadRequest(f"model {self.name} has no explainer: use :predict")

    def validate(self, payload: Any) -> Any:
        """:meth:`preprocess` has checked the request already, into a call of our own; KServe's
        check (by ``--predictor_protocol`` in transformer mode) would look for a V1/V2 dict."""
        if isinstance(payload, EncoderCall):
            return payload
        return super().validate(payload)

    def stop(self) -> None:
        """KServe calls this on shutdown, once per name the model is registered under."""
        self.ready = False
        self.backend.shutdown()


class GenerationModel(BackendModel):
    """A generative model: served on the OpenAI routes; KServe V1/V2 inference is refused."""

    backend: GenerationBackend

    def __init__(
        self,
        name: str,
        task: Task,
        backend: GenerationBackend,
        chat_template: str | None,
        trust_request_chat_template: bool = False,
        max_inputs_per_request: int = ServerConfig.max_inputs_per_request,
        auto_tool_parser: str | None = None,
        reasoning: ReasoningFormat | None = None,
        sampling_defaults: SamplingDefaults = NO_DEFAULTS,
    ):
        super().__init__(name, task)
        self.backend = backend
        self.sampling_defaults = sampling_defaults
        """The model's own sampling settings (its generation config), where a request gives
        none."""
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        """Render ``chat_template`` sent in requests (sandboxed); refuse it otherwise."""
        self.max_inputs_per_request = max_inputs_per_request
        """Prompts (and prompts times ``n``) per completion request."""
        self.auto_tool_parser = auto_tool_parser
        """``--tool-call-parser`` with ``--enable-auto-tool-choice``: ``tool_choice: auto``
        parses the output into tool calls; None: auto is refused."""
        self.reasoning = reasoning
        """``--reasoning-parser``: chat output is split into reasoning and content; None: as
        the model wrote it."""

    async def warm_up(self) -> None:
        ids = self.backend.tokenizer("Hello", add_special_tokens=True)["input_ids"] or [0]
        ids = ids[: max(1, self.backend.max_model_len - 1)]
        async for _ in self.backend.generate(list(ids), SamplingParams(max_tokens=1)):
            pass

    async def preprocess(self, payload: Any, headers: dict[str, str] | None = None) -> Any:
        raise BadRequest(
            f"model {self.name} generates text: use the OpenAI routes "
            "(/v1/completions, /v1/chat/completions under the OpenAI prefix)"
        )


class EncoderModel(BackendModel):
    """Serves an :class:`EncoderBackend` on ``:predict``, V2 ``infer`` and gRPC ``ModelInfer``."""

    backend: EncoderBackend

    def __init__(
        self,
        name: str,
        task: Task,
        backend: EncoderBackend,
        logging_: RequestLogging,
        max_inputs_per_request: int = ServerConfig.max_inputs_per_request,
    ):
        super().__init__(name, task)
        self.backend = backend
        self.request_logging = logging_
        self.max_inputs_per_request = max_inputs_per_request

    async def warm_up(self) -> None:
        if not self.backend.warms_up:
            return
        mask = getattr(getattr(self.backend, "tokenizer", None), "mask_token", None)
        text = f"Hello {mask} world" if self.task is Task.fill_mask and mask else "Hello world"
        await self.backend.infer([text])

    def get_input_types(self) -> list[dict[str, Any]]:
        return [{"name": "input-0", "datatype": "BYTES", "shape": [-1]}]

    def get_output_types(self) -> list[dict[str, Any]]:
        return self.backend.task.v2_output_types() if self.ready else []

    @property
    def reads_pairs(self) -> bool:
        """Whether instances may be text pairs (a sequence classifier's)."""
        return self.task is Task.sequence_classification

    async def preprocess(self, payload: Any, headers: dict[str, str] | None = None) -> EncoderCall:
        headers = headers or {}
        limit = self.max_inputs_per_request
        if isinstance(payload, InferRequest):
            request_id = payload.id or headers.get("x-request-id") or new_request_id()
            instances = instances_from_v2(payload, limit, self.reads_pairs)
            call = EncoderCall(request_id, instances, v2=payload)
        else:
            request_id = headers.get("x-request-id") or new_request_id()
            call = EncoderCall(request_id, instances_from_v1(payload, limit, self.reads_pairs))
        self.request_logging.log(call, self.name)
        return call

    async def predict(  # type: ignore[override]
        self, call: EncoderCall, headers: dict[str, str] | None = None
    ) -> EncoderCall:
        instances = call.instances
        call.results, _ = await self.backend.infer_instances(instances.items, instances.params)
        return call

    async def postprocess(  # type: ignore[override]
        self,
        call: EncoderCall,
        headers: dict[str, str] | None = None,
        response_headers: dict[str, str] | None = None,
    ) -> dict[str, Any] | InferResponse:
        assert call.results is not None
        task = self.backend.task
        if call.v2 is None:
            return task.v1_response(call.results)
        return InferResponse(
            response_id=call.request_id,
            model_name=self.name,
            infer_outputs=task.v2_outputs(call.results),
        )
