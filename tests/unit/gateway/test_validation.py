import pytest

from aiserve.common.errors import InvalidArgument
from services.gateway.config import GatewayConfig
from services.gateway.validation import (
    MAX_TOP_LOGPROBS,
    LogprobsRequest,
    ResponseFormat,
    SamplingInput,
    checked_logprobs,
    checked_min_similarity,
    checked_response_format,
    resolve_sampling,
    usage_period,
    validate_input,
)

CONFIG = GatewayConfig(default_max_new_tokens=64, max_new_tokens_limit=512, max_stop_strings=2, max_stop_chars=8)


def test_defaults_are_greedy() -> None:
    s = resolve_sampling(SamplingInput(), CONFIG)
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.max_new_tokens) == (0.0, 1.0, 0, 1.0, 64)


def test_presets_set_factual_and_creative_decoding_and_explicit_fields_override() -> None:
    factual = resolve_sampling(SamplingInput(preset="factual"), CONFIG)
    assert 0.1 <= factual.temperature <= 0.3 and factual.top_p == pytest.approx(0.9)
    creative = resolve_sampling(SamplingInput(preset="creative"), CONFIG)
    assert 0.7 <= creative.temperature <= 0.9 and creative.repetition_penalty > 1.0
    assert resolve_sampling(SamplingInput(preset="creative", temperature=0.5), CONFIG).temperature == 0.5


@pytest.mark.parametrize(
    ("given", "field"),
    [
        (SamplingInput(preset="wild"), "sampling.preset"),
        (SamplingInput(temperature=2.5), "sampling.temperature"),
        (SamplingInput(temperature=-0.1), "sampling.temperature"),
        (SamplingInput(temperature=float("nan")), "sampling.temperature"),
        (SamplingInput(top_p=0.0), "sampling.top_p"),
        (SamplingInput(top_p=1.5), "sampling.top_p"),
        (SamplingInput(repetition_penalty=3.0), "sampling.repetition_penalty"),
        (SamplingInput(top_k=-1), "sampling.top_k"),
        (SamplingInput(max_new_tokens=0), "sampling.max_new_tokens"),
        (SamplingInput(max_new_tokens=513), "sampling.max_new_tokens"),
        (SamplingInput(stop=("a", "b", "c")), "sampling.stop"),
        (SamplingInput(stop=("x" * 9,)), "sampling.stop"),
    ],
)
def test_out_of_range_names_the_field_and_limit(given: SamplingInput, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        resolve_sampling(given, CONFIG)
    assert info.value.message.startswith(field)
    assert any(ch.isdigit() for ch in info.value.message) or "preset" in field


def test_cache_key_changes_with_answer_changing_params() -> None:
    a = resolve_sampling(SamplingInput(), CONFIG).cache_key()
    b = resolve_sampling(SamplingInput(max_new_tokens=65), CONFIG).cache_key()
    assert a != b and a == resolve_sampling(SamplingInput(), CONFIG).cache_key()


@pytest.mark.parametrize(
    ("prompt", "messages", "needle"),
    [
        (None, None, "input"),
        ("", None, "prompt"),
        ("x" * 200_001, None, "prompt: at most 200000"),
        (None, [], "chat.messages"),
        (None, [("robot", "hi")], "chat.messages[0].role"),
        (None, [("user", "")], "chat.messages[0].content"),
    ],
)
def test_bad_input(prompt: str | None, messages: list[tuple[str, str]] | None, needle: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_input(prompt, messages, GatewayConfig())
    assert needle in info.value.message


def test_good_input_passes() -> None:
    validate_input("hi", None, GatewayConfig())
    validate_input(None, [("system", "be brief"), ("user", "hi")], GatewayConfig())


def test_fit_prompt_refuses_or_truncates_at_the_context_and_max_prompt_tokens() -> None:
    from services.gateway.validation import fit_prompt

    ids = list(range(10))
    assert fit_prompt(ids, 4, 16, "m@1", 100, False) == ids
    with pytest.raises(InvalidArgument) as info:
        fit_prompt(ids, 8, 16, "m@1", 100, False)
    assert info.value.message.startswith("prompt:") and "16" in info.value.message
    assert fit_prompt(ids, 8, 16, "m@1", 100, True) == ids[-8:]
    with pytest.raises(InvalidArgument) as info:
        fit_prompt(ids, 4, 100, "m@1", 6, False)
    assert "max_prompt_tokens 6" in info.value.message
    assert fit_prompt(ids, 4, 100, "m@1", 6, True) == ids[-6:]
    with pytest.raises(InvalidArgument) as info:
        fit_prompt(ids, 16, 16, "m@1", 100, True)
    assert info.value.message.startswith("sampling.max_new_tokens")


def test_cache_min_similarity_is_unset_or_in_zero_to_one() -> None:
    assert checked_min_similarity(None) is None and checked_min_similarity(0.0) == 0.0
    for bad in (-0.1, 1.01, float("nan")):
        with pytest.raises(InvalidArgument, match="cache_min_similarity: must be in"):
            checked_min_similarity(bad)


def test_usage_period_reads_rfc3339_with_an_offset() -> None:
    assert usage_period("", "") == (None, None)
    assert usage_period("2025-01-15T12:00:00Z", "2025-01-15T13:00:00+01:00") == (1736942400000, 1736942400000)
    with pytest.raises(InvalidArgument, match="since: must be an RFC 3339 time with an offset"):
        usage_period("2025-01-15T12:00:00", "")  # no offset: ambiguous
    with pytest.raises(InvalidArgument, match="until: must be an RFC 3339"):
        usage_period("", "yesterday")
    with pytest.raises(InvalidArgument, match="until: must not be before since"):
        usage_period("2025-01-16T00:00:00Z", "2025-01-15T00:00:00Z")


def test_logprobs_options_within_limits() -> None:
    assert checked_logprobs(False, 0) is None
    assert checked_logprobs(True, 0) == LogprobsRequest(top=0)
    assert checked_logprobs(True, MAX_TOP_LOGPROBS) == LogprobsRequest(top=20)


@pytest.mark.parametrize(("enabled", "top", "limit"), [(True, 21, "[0, 20]"), (False, 3, "requires logprobs.enabled")])
def test_bad_logprobs_options_name_the_field_and_limit(enabled: bool, top: int, limit: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        checked_logprobs(enabled, top)
    assert info.value.message.startswith("logprobs.top_logprobs") and limit in info.value.message


def test_a_response_format_is_canonical_and_scopes_the_cache() -> None:
    assert checked_response_format(None, "") is None
    assert checked_response_format("json_object", "") == ResponseFormat()
    a = checked_response_format("json_schema", '{"type": "object", "required": ["a"]}')
    b = checked_response_format("json_schema", '{"required":["a"],"type":"object"}')
    assert a == b and a is not None
    assert a.cache_key() != ResponseFormat().cache_key()


@pytest.mark.parametrize(("schema", "reason"), [
    ("", "1..65536 characters"),
    ("{not json", "not JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"type": "bogus"}', "not supported by the grammar compiler"),
], ids=["empty", "not-json", "not-object", "uncompilable"])
def test_a_bad_schema_is_refused_at_admission(schema: str, reason: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        checked_response_format("json_schema", schema)
    assert info.value.message.startswith("response_format.json_schema.schema") and reason in info.value.message
