"""Gateway settings (defaults < TOML < AISERVE_GATEWAY_* < flags)."""

from __future__ import annotations

from dataclasses import dataclass

from aiserve.common.config import ServiceConfig, require
from aiserve.store import DEFAULT_MODEL_REF


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    """The public front door: where the backends are and what requests may ask for."""

    port: int = 50051
    """Public gRPC port."""
    metrics_port: int = 9101
    tokenizer_address: str = "127.0.0.1:50052"
    """host:port of the tokenizer service."""
    inference_address: str = "127.0.0.1:50053"
    """host:port of the inference service."""
    cache_address: str = "127.0.0.1:50054"
    """host:port of the cache service; empty disables caching."""
    default_model: str = DEFAULT_MODEL_REF
    """name@version served when a request leaves `model` empty (the only route for now)."""
    default_max_new_tokens: int = 256
    """max_new_tokens when neither the request nor its preset sets it."""
    max_new_tokens_limit: int = 2048
    """Largest max_new_tokens a request may ask for."""
    max_prompt_chars: int = 200_000
    """Largest prompt (or sum of chat message contents) in characters, checked before tokenizing."""
    max_chat_messages: int = 256
    """Most messages in one chat."""
    max_stop_strings: int = 4
    """Most stop strings in one request."""
    max_stop_chars: int = 64
    """Longest stop string in characters."""
    cache_max_temperature: float = 0.0
    """Sampled requests (temperature above this, without a seed) are never cached."""
    fingerprint_ttl_s: float = 2.0
    """Seconds a tokenizer/model fingerprint pairing check stays valid."""
    prompt_price_micros_per_token: int = 50
    """Price of one prompt token in millionths of the currency (0.05 per 1,000 tokens)."""
    completion_price_micros_per_token: int = 150
    """Price of one generated token in millionths of the currency."""
    downstream_timeout_s: float = 600.0
    """Deadline of a generation when the client set none."""

    def validate(self) -> None:
        super().validate()
        require(1 <= self.default_max_new_tokens <= self.max_new_tokens_limit,
                f"default_max_new_tokens: must be 1..max_new_tokens_limit "
                f"({self.max_new_tokens_limit}), got {self.default_max_new_tokens}")
        require(1 <= self.max_new_tokens_limit <= 1 << 20,
                f"max_new_tokens_limit: must be 1..1048576, got {self.max_new_tokens_limit}")
        require(0 <= self.cache_max_temperature <= 2,
                f"cache_max_temperature: must be 0..2, got {self.cache_max_temperature}")
        require(self.prompt_price_micros_per_token >= 0 and self.completion_price_micros_per_token >= 0,
                "prompt_price_micros_per_token, completion_price_micros_per_token: must be >= 0")
        for name in ("tokenizer_address", "inference_address"):
            require(":" in getattr(self, name), f"{name}: must be host:port, got {getattr(self, name)!r}")
