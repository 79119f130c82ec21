"""Settings of the tokenizer service (defaults, TOML ``[tokenizer]``, ``AISERVE_TOKENIZER_*``, flags)."""

from __future__ import annotations

from dataclasses import dataclass

from aiserve.common.config import ServiceConfig, require
from aiserve.store import DEFAULT_MODEL_REF, is_model_ref


@dataclass(frozen=True)
class TokenizerConfig(ServiceConfig):
    """Tokenizer service: text <-> token ids for exactly one model version."""

    port: int = 50052
    """gRPC port (docs/architecture.md lists each service's); 0 binds a free port."""
    metrics_port: int = 9102
    """Prometheus HTTP port; 0 disables the metrics endpoint."""
    model: str = DEFAULT_MODEL_REF
    """The model whose tokenizer is served, ``name@version`` (a version is always explicit)."""
    model_store: str = ""
    """Root folder of the model store; empty = ``$AISERVE_MODEL_STORE``, else
    ``$AISERVE_HOME/models``, resolved when the server is created (never at import)."""

    def validate(self) -> None:
        super().validate()
        require(is_model_ref(self.model), f"model: must be 'name@version', got {self.model!r}")
