"""The pipeline's tokenizer, detokenizer and generations over the model routes: each call goes
to the backends of the exact version (name@version) its request was routed to (``routing.py``),
so a request finishes on the version that started it.

The ``PromptTokenizer``, ``Detokenizer`` and ``Generations`` of
``services/gateway/interfaces.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.detokenize_mux_client import MuxStream
from services.gateway.domain import GenerationRequest, RenderedPrompt
from services.gateway.fleet_inference import FleetGeneration
from services.gateway.routing import Routes


class RoutedTokenizer:
    """Renders, tokenizes and counts on the version's own tokenizer replicas."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    async def apply_chat_template(self, messages: Sequence[tuple[str, str]], model: str) -> RenderedPrompt:
        return await self.routes.backends_of(model).tokenizer.apply_chat_template(messages)

    async def tokenize(self, text: str, model: str) -> tuple[int, ...]:
        return await self.routes.backends_of(model).tokenizer.tokenize(text)

    async def count_tokens(self, prompt: str | None, messages: Sequence[tuple[str, str]] | None,
                           model: str) -> int:
        return await self.routes.backends_of(model).tokenizer.count_tokens(prompt, messages, model)

    async def token_bytes(self, ids: Sequence[int], model: str) -> tuple[bytes, ...]:
        return await self.routes.backends_of(model).tokenizer.token_bytes(ids)


class RoutedDetokenizer:
    """Each generation's stream on its version's tokenizer replicas."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def open(self, request_id: str, skip_special_tokens: bool, model: str) -> MuxStream:
        return self.routes.backends_of(model).detokenizer.open(request_id, skip_special_tokens)

    async def close(self) -> None:
        """The replicas own their calls (``Routes.close`` closes them)."""


class RoutedGenerations:
    """Each generation on its version's inference replicas (``request.model``)."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def open(self, request: GenerationRequest, timeout_s: float) -> FleetGeneration:
        return self.routes.backends_of(request.model).generations.open(request, timeout_s)

    async def close(self) -> None:
        """The replicas own their calls (``Routes.close`` closes them)."""
