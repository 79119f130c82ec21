"""Gateway settings (defaults < TOML < AISERVE_GATEWAY_* < flags)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from aiserve.common.config import ServiceConfig, require
from aiserve.common.paths import ADMIN_KEY_FILE, KEYS_FILE, LEDGER_FILE, ROUTES_FILE, home_file
from aiserve.store import DEFAULT_MODEL_REF, is_model_ref
from services.gateway.judge_config import JudgeConfig
from services.gateway.pricing import Price, PriceTable, parse_prices
from services.gateway.targets import parse_target

STICKINESS = ("none", "tenant", "session")
"""The values of route_stickiness."""


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    """The public front door: where the backends are and what requests may ask for."""

    port: int = 50051
    """Public gRPC port."""
    metrics_port: int = 9101
    http_port: int = 8000
    """Port of the OpenAI-compatible HTTP API (docs/http.md), on ``host``, served in the gateway's
    own process; 0 = off; -1 = a free port, announced after the gRPC port (the tests' suites)."""
    http_max_body_bytes: int = 1_048_576
    """Largest HTTP request body; a longer one is refused with 413 before it is parsed."""
    http_max_choices: int = 8
    """Largest ``n`` (choices) of one HTTP request; each choice is its own generation."""
    tokenizer_address: str = "127.0.0.1:50052"
    """The tokenizer's replicas, a gRPC target: host:port (one), ipv4:a:port,b:port (these), or
    dns:///name:port (every address the name resolves to, asked every resolve_interval_s)."""
    inference_address: str = "127.0.0.1:50053"
    """The inference service's replicas, a target as tokenizer_address; the gateway balances
    generations over them itself (docs/decisions.md, decision 44)."""
    generate_mux: bool = True
    """Run the generations on each inference replica over one shared GenerateMux call per
    replica (one message per engine step); false = one Generate call per generation. Either
    way a generation picks its replica itself: this is no longer needed for several replicas
    (docs/decisions.md, decisions 34 and 44)."""
    cache_address: str = "127.0.0.1:50054"
    """The cache's replicas, a target as tokenizer_address; empty disables caching."""
    resolve_interval_s: float = 10.0
    """Seconds between two lookups of a dns:/// target's name (replicas come and go with it)."""
    admin_key_path: str = ""
    """File of the admin key that the Admin service requires; "" = $AISERVE_HOME/admin.key.
    Read at each Admin call, so a key written after the start works."""
    default_model: str = DEFAULT_MODEL_REF
    """name@version of the first route's stable version, served with tokenizer_address and
    inference_address while routes_path holds no routes; its name is the default route (a
    request that leaves `model` empty goes there)."""
    routes_path: str = ""
    """SQLite file of the model routes and their versions, weights and roles (the Admin service
    changes them; read at start); "" = $AISERVE_HOME/routes.sqlite3."""
    route_stickiness: str = "tenant"
    """How a route keeps requests on one version while weights split the traffic: "none" (each
    request by the weights), "tenant" (all of a tenant's requests on one version) or "session"
    (the x-aiserve-session metadata value; requests without one by the weights)."""
    retire_after_s: float = 300.0
    """Seconds a former stable version stays loaded after a promote (a rollback is instant
    meanwhile), when the Promote call does not say."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The canary judgement: ``canary_judge_interval_s``, ``canary_window_s``,
    ``canary_min_requests`` and the margins (services/gateway/canary_judge.py)."""
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
    """Requests sampled at a temperature above this are never looked up in or stored to the cache
    (a seed does not exempt them: a paraphrase with the same seed would get another sample)."""
    cache_exact_wait_ms: float = 10.0
    """How long a request waits for the cache's exact tier (answered without an embedding, ~1 ms)
    before it starts its generation anyway; the lookup goes on beside the generation and still
    wins if it hits before the first token (docs/gateway.md, "The cache lookup races the
    generation"). 0 = never wait. 0..1000."""
    fingerprint_ttl_s: float = 2.0
    """Seconds a tokenizer/model fingerprint pairing check stays valid."""
    max_prompt_tokens: int = 8192
    """Most prompt tokens (after the chat template) a request may send; longer prompts are
    INVALID_ARGUMENT, or cut from the left when the request asks for truncation."""
    prices: tuple[str, ...] = ("smollm2-135m-instruct@0.1.2=50/150/1000",)
    """Price table, one entry per model version: "name@version=PROMPT/COMPLETION/COMPUTE",
    millionths of the currency per prompt token, per generated token, per compute-second."""
    prompt_price_micros_per_token: int = 50
    """Price of one prompt token of a model missing from `prices` (0.05 per 1,000 tokens)."""
    completion_price_micros_per_token: int = 150
    """Price of one generated token of a model missing from `prices`."""
    compute_price_micros_per_second: int = 1000
    """Price of one second of model compute of a model missing from `prices`."""
    max_compute_ms_per_token: int = 100
    """Compute billed per token (prompt + generated) at most, and reserved at admission, so
    that no request ever costs more than the budget reserved for it."""
    downstream_timeout_s: float = 600.0
    """Deadline of a generation when the client set none."""
    slo_ttft_s: float = 2.0
    """Service-level target for time to first token (p99). A bucket bound of the latency histograms
    and the alert's threshold (deploy/prometheus/rules.yaml); 64 streams at once measured ~1.3 s
    p99 on the 2-core CPU host."""
    slo_tpot_s: float = 0.15
    """Service-level target for time per output token after the first (p99); ~0.07 s p50 at 64
    streams on the CPU host."""
    slo_e2e_s: float = 30.0
    """Service-level target for a whole generation, end to end (p99)."""
    keys_path: str = ""
    """SQLite file of tenants and API key hashes; "" = $AISERVE_HOME/keys.sqlite3."""
    ledger_path: str = ""
    """SQLite file of the usage ledger and feedback; "" = $AISERVE_HOME/ledger.sqlite3."""
    free_priority: int = 0
    """Scheduling priority of the free tier (higher is admitted to the batch first)."""
    free_requests_per_minute: int = 60
    """Generations a free tenant may start per minute (token bucket, burst = one minute)."""
    free_tokens_per_minute: int = 50_000
    """Prompt + generated tokens a free tenant may use per minute (reserved at admission)."""
    free_budget_micros: int = 0
    """Spending cap of a free tenant per budget_period in millionths; 0 = none."""
    paid_priority: int = 10
    """Scheduling priority of the paid tier."""
    paid_requests_per_minute: int = 1200
    """Generations a paid tenant may start per minute."""
    paid_tokens_per_minute: int = 2_000_000
    """Tokens a paid tenant may use per minute."""
    paid_budget_micros: int = 0
    """Spending cap of a paid tenant per budget_period; 0 = none."""
    budget_period: str = "month"
    """"day" or "month": the UTC calendar period a budget covers."""
    repeat_window_s: float = 300.0
    """A tenant asking a near-identical question within this many seconds is recorded as a
    passive "repeat" signal on the earlier request (docs/gateway.md, "Feedback")."""
    repeat_similarity: float = 0.85
    """Similarity (Jaccard of character 3-grams of the normalised question) that counts as
    near-identical, 0..1."""
    max_feedback_comment_chars: int = 2000
    """Longest feedback comment."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of range (each group checks its own)."""
        super().validate()
        self.judge.validate()
        self._validate_addresses()
        self._validate_request_limits()
        self._validate_prices()
        self._validate_tiers()
        self._validate_feedback()
        self._validate_routes()

    def _validate_addresses(self) -> None:
        for name in ("tokenizer_address", "inference_address"):
            parse_target(name, getattr(self, name))  # raises ConfigError naming the setting
        if self.cache_address:  # empty: no cache
            parse_target("cache_address", self.cache_address)
        require(0 < self.resolve_interval_s <= 3600,
                f"resolve_interval_s: must be in (0, 3600], got {self.resolve_interval_s}")
        require(is_model_ref(self.default_model),
                f"default_model: must be 'name@version', got {self.default_model!r}")
        require(-1 <= self.http_port <= 65535, f"http_port: must be -1..65535 (0 = off), got {self.http_port}")
        require(1024 <= self.http_max_body_bytes <= 1 << 30,
                f"http_max_body_bytes: must be 1024..{1 << 30}, got {self.http_max_body_bytes}")
        require(1 <= self.http_max_choices <= 128, f"http_max_choices: must be 1..128, got {self.http_max_choices}")
        require(self.fingerprint_ttl_s >= 0, f"fingerprint_ttl_s: must be >= 0, got {self.fingerprint_ttl_s}")
        for name in ("slo_ttft_s", "slo_tpot_s", "slo_e2e_s"):
            require(0 < getattr(self, name) <= 3_600, f"{name}: must be in (0, 3600], got {getattr(self, name)}")
        require(0 < self.downstream_timeout_s <= 86_400,
                f"downstream_timeout_s: must be in (0, 86400], got {self.downstream_timeout_s}")

    def _validate_request_limits(self) -> None:
        require(1 <= self.max_new_tokens_limit <= 1 << 20,
                f"max_new_tokens_limit: must be 1..1048576, got {self.max_new_tokens_limit}")
        require(1 <= self.default_max_new_tokens <= self.max_new_tokens_limit,
                f"default_max_new_tokens: must be 1..max_new_tokens_limit "
                f"({self.max_new_tokens_limit}), got {self.default_max_new_tokens}")
        require(1 <= self.max_prompt_tokens <= 1 << 24,
                f"max_prompt_tokens: must be 1..16777216, got {self.max_prompt_tokens}")
        for name in ("max_prompt_chars", "max_chat_messages", "max_stop_chars"):
            require(getattr(self, name) >= 1, f"{name}: must be >= 1, got {getattr(self, name)}")
        require(self.max_stop_strings >= 0, f"max_stop_strings: must be >= 0, got {self.max_stop_strings}")
        require(0 <= self.cache_max_temperature <= 2,
                f"cache_max_temperature: must be 0..2, got {self.cache_max_temperature}")
        require(0 <= self.cache_exact_wait_ms <= 1000,
                f"cache_exact_wait_ms: must be 0..1000, got {self.cache_exact_wait_ms}")

    def _validate_prices(self) -> None:
        parse_prices(self.prices)  # raises ConfigError naming the bad entry
        for name in ("prompt_price_micros_per_token", "completion_price_micros_per_token",
                     "compute_price_micros_per_second"):
            require(getattr(self, name) >= 0, f"{name}: must be >= 0, got {getattr(self, name)}")
        require(0 <= self.max_compute_ms_per_token <= 60_000,
                f"max_compute_ms_per_token: must be 0..60000, got {self.max_compute_ms_per_token}")

    def _validate_tiers(self) -> None:
        for tier in ("free", "paid"):
            priority = getattr(self, f"{tier}_priority")
            require(-(1 << 31) <= priority < 1 << 31, f"{tier}_priority: must be a 32-bit integer, got {priority}")
            for limit in ("requests_per_minute", "tokens_per_minute"):
                value = getattr(self, f"{tier}_{limit}")
                require(1 <= value <= 1 << 40, f"{tier}_{limit}: must be 1..{1 << 40}, got {value}")
            budget = getattr(self, f"{tier}_budget_micros")
            require(budget >= 0, f"{tier}_budget_micros: must be >= 0 (0 = none), got {budget}")
        require(self.budget_period in {"day", "month"},
                f"budget_period: must be day or month, got {self.budget_period!r}")

    def _validate_feedback(self) -> None:
        require(0 < self.repeat_window_s <= 86_400,
                f"repeat_window_s: must be in (0, 86400], got {self.repeat_window_s}")
        require(0 < self.repeat_similarity <= 1, f"repeat_similarity: must be in (0, 1], got {self.repeat_similarity}")
        require(0 <= self.max_feedback_comment_chars <= 100_000,
                f"max_feedback_comment_chars: must be 0..100000, got {self.max_feedback_comment_chars}")

    def _validate_routes(self) -> None:
        require(self.route_stickiness in STICKINESS,
                f"route_stickiness: must be one of {', '.join(STICKINESS)}, got {self.route_stickiness!r}")
        require(0 <= self.retire_after_s <= 7 * 86_400,
                f"retire_after_s: must be in [0, 604800], got {self.retire_after_s}")

    def price_table(self) -> PriceTable:
        """The prices of `prices`, with the default prices for models missing from it."""
        default = Price(self.prompt_price_micros_per_token, self.completion_price_micros_per_token,
                        self.compute_price_micros_per_second)
        return PriceTable(parse_prices(self.prices), default, self.max_compute_ms_per_token)

    def keys_file(self) -> Path:
        """The tenants and keys database this config names ("" = under $AISERVE_HOME)."""
        return home_file(self.keys_path, KEYS_FILE)

    def admin_key_file(self) -> Path:
        """The admin key's file this config names ("" = under $AISERVE_HOME)."""
        return home_file(self.admin_key_path, ADMIN_KEY_FILE)

    def routes_file(self) -> Path:
        """The model routes database this config names ("" = under $AISERVE_HOME)."""
        return home_file(self.routes_path, ROUTES_FILE)

    def ledger_file(self) -> Path:
        """The usage ledger database this config names ("" = under $AISERVE_HOME)."""
        return home_file(self.ledger_path, LEDGER_FILE)
