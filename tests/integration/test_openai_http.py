"""The OpenAI-compatible HTTP door, through the official ``openai`` client (and curl), against
the real suite: the same keys, limits, ledger and request ids as the gRPC API."""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from grpc import aio

from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.config import GatewayConfig
from suite.runner import Suite
from tests.integration.conftest import auth, create_tenant, dev_key, eventually, ledger_rows, new_request_id

TIMEOUT_S = 120
QUESTION = "Name three colours of the rainbow."


def base_url(suite: Suite) -> str:
    return suite.config.http_address() + "/v1"


def client(suite: Suite, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(suite), api_key=key or dev_key(suite), max_retries=0, timeout=TIMEOUT_S)


def async_client(suite: Suite, key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(suite), api_key=key or dev_key(suite), max_retries=0,
                              timeout=TIMEOUT_S)


def chat(text: str = QUESTION) -> list[Any]:
    return [{"role": "user", "content": text}]


def extra(usage: Any, name: str) -> Any:
    """An aiserve usage field beyond OpenAI's three counts."""
    return (usage.model_extra or {})[name]


# --- plain endpoints --------------------------------------------------------------------------

def test_models_lists_the_routes_and_their_versions(suite: Suite) -> None:
    ids = [m.id for m in client(suite).models.list().data]
    assert "smollm2-135m-instruct" in ids
    assert any(i.startswith("smollm2-135m-instruct@") for i in ids)


def test_health_tells_the_gateway_health(suite: Suite) -> None:
    reply = httpx.get(suite.config.http_address() + "/health", timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"status": "serving"}


def test_embeddings_are_not_served_and_say_so_in_the_openai_shape(suite: Suite) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(suite).embeddings.create(model="x", input="hello")
    assert info.value.status_code == 404
    body: Any = info.value.body
    assert set(body) == {"message", "type", "param", "code"} and "/v1/embeddings" in body["message"]


# --- chat and completions ---------------------------------------------------------------------

def test_chat_whole_answer_with_request_id_usage_and_cost(suite: Suite) -> None:
    request_id = new_request_id()
    raw = client(suite).chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct", messages=chat(), max_tokens=12, temperature=0,
        extra_headers={"x-request-id": request_id})
    answer = raw.parse()
    assert raw.headers["x-request-id"] == request_id == answer.id
    assert answer.object == "chat.completion"
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in {"stop", "length"}
    usage = answer.usage
    assert usage is not None and usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    (row,) = [r for r in ledger_rows(suite.config.home) if r.request_id == request_id]
    assert row.status == "OK" and extra(usage, "cost_micros") == row.cost_micros > 0
    assert answer.model == row.model and row.completion_tokens == usage.completion_tokens


async def test_chat_stream_with_include_usage_async(suite: Suite) -> None:
    async with async_client(suite) as api:
        stream = await api.chat.completions.create(
            model="smollm2-135m-instruct", messages=chat(), max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    *body, last = chunks
    assert all(c.usage is None for c in body) and all(len(c.choices) == 1 for c in body)
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 10
    assert body[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in body)
    whole = client(suite).chat.completions.create(model="smollm2-135m-instruct", messages=chat(), max_tokens=10,
                                                  temperature=0)
    assert text == whole.choices[0].message.content  # greedy: the stream says what the whole answer says


def test_stream_without_include_usage_has_no_usage_chunk(suite: Suite) -> None:
    chunks = list(client(suite).chat.completions.create(
        model="smollm2-135m-instruct", messages=chat(), max_tokens=6, temperature=0, stream=True))
    assert chunks and all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_whole_and_streamed(suite: Suite) -> None:
    api = client(suite)
    whole = api.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=8,
                                   temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    streamed = list(api.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                           max_tokens=8, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    assert streamed[-1].choices == [] and streamed[-1].usage is not None


async def test_same_seed_same_text_async(suite: Suite) -> None:
    async with async_client(suite) as api:
        async def sample(seed: int) -> str:
            answer = await api.chat.completions.create(model="smollm2-135m-instruct", messages=chat("Tell a story."),
                                                       max_tokens=24, temperature=1.0, seed=seed)
            return answer.choices[0].message.content or ""
        first, again, other = await asyncio.gather(sample(7), sample(7), sample(8))
    assert first == again
    assert first != other  # 24 tokens sampled at temperature 1: another seed, another story


def test_cache_control_chooses_whether_the_cache_answers_and_stores(suite: Suite) -> None:
    text = f"Name one colour for {new_request_id()}."  # a question of its own

    def hit(cache_control: str | None) -> bool:
        answer = client(suite).chat.completions.create(
            model="smollm2-135m-instruct", messages=chat(text), max_tokens=6, temperature=0,
            extra_headers={"Cache-Control": cache_control} if cache_control else None)
        assert answer.usage is not None
        return bool(extra(answer.usage, "cache_hit"))

    assert not hit("no-store")
    assert not hit(None)  # so no-store stored nothing; this answer is stored
    assert hit(None)
    assert not hit("no-cache")  # not answered from the cache, though it holds the answer
    assert not hit("no-store")


def test_stop_list_ends_the_answer_before_the_stop_string(suite: Suite) -> None:
    api = client(suite)
    full = api.completions.create(model="smollm2-135m-instruct", prompt="Count: one, two, three,", max_tokens=16,
                                  temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = api.completions.create(model="smollm2-135m-instruct", prompt="Count: one, two, three,", max_tokens=16,
                                 temperature=0, stop=["@@never@@", stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[:full.index(stop)]


def test_n_choices_are_separate_generations(suite: Suite) -> None:
    request_id = new_request_id()
    answer = client(suite).chat.completions.create(
        model="smollm2-135m-instruct", messages=chat("Tell a story."), max_tokens=16, temperature=1.0, seed=3, n=3,
        extra_headers={"x-request-id": request_id})
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert len({c.message.content for c in answer.choices}) == 3  # seeds 3, 4, 5
    rows = [r for r in ledger_rows(suite.config.home) if r.request_id == request_id]
    assert len(rows) == 3  # each choice its own generation, billed on its own row
    assert answer.usage is not None
    assert answer.usage.completion_tokens == sum(r.completion_tokens for r in rows)
    assert extra(answer.usage, "cost_micros") == sum(r.cost_micros for r in rows)


async def test_n_choices_stream_each_with_its_index(suite: Suite) -> None:
    async with async_client(suite) as api:
        stream = await api.chat.completions.create(
            model="smollm2-135m-instruct", messages=chat(), max_tokens=6, temperature=0, stream=True, n=2)
        chunks = [chunk async for chunk in stream]
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert texts[0] == texts[1] and texts[0]  # greedy: both choices say the same


def test_user_is_recorded_in_the_ledger_row(suite: Suite) -> None:
    request_id = new_request_id()
    client(suite).chat.completions.create(model="smollm2-135m-instruct", messages=chat(), max_tokens=4,
                                          user="end-user-42", extra_headers={"x-request-id": request_id})
    (row,) = [r for r in ledger_rows(suite.config.home) if r.request_id == request_id]
    assert row.user == "end-user-42"


# --- log-probabilities and structured output (the engine's, through the door) -----------------

def test_chat_logprobs_with_top_alternatives(suite: Suite) -> None:
    answer = client(suite).chat.completions.create(model="smollm2-135m-instruct", messages=chat(), max_tokens=6,
                                                   temperature=0, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == answer.usage.completion_tokens  # type: ignore[union-attr]
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert item.token == item.top_logprobs[0].token  # greedy: the token chosen is the most likely
    assert "".join(i.token for i in content) == answer.choices[0].message.content


def test_completions_logprobs(suite: Suite) -> None:
    answer = client(suite).completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                              max_tokens=5, temperature=0, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 5
    assert logprobs.top_logprobs is not None and all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}


def test_json_schema_answer_validates(suite: Suite) -> None:
    answer = client(suite).chat.completions.create(
        model="smollm2-135m-instruct", messages=chat("Give a city and its population as JSON."), max_tokens=64,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), SCHEMA)


def test_json_object_answer_is_an_object(suite: Suite) -> None:
    answer = client(suite).chat.completions.create(
        model="smollm2-135m-instruct", messages=chat("What is the capital of France? Answer as JSON."), max_tokens=64,
        temperature=0, response_format={"type": "json_object"})
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
    assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)


async def test_streamed_logprobs_arrive_with_their_tokens(suite: Suite) -> None:
    stream = await async_client(suite).chat.completions.create(
        model="smollm2-135m-instruct", messages=chat(), max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
        stream=True, stream_options={"include_usage": True})
    tokens, text, completion_tokens = [], "", 0
    async for chunk in stream:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                tokens.extend(choice.logprobs.content)
    assert len(tokens) == completion_tokens > 0
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)
    assert "".join(t.token for t in tokens).startswith(text)


# --- errors -----------------------------------------------------------------------------------

def test_unknown_key_is_401(suite: Suite) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(suite, key="not-a-key").chat.completions.create(model="smollm2-135m-instruct", messages=chat())
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


@pytest.mark.parametrize(("params", "param", "needle"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ({"max_tokens": 100_000}, "max_tokens", "2048"),
    ({"temperature": 3.5}, "temperature", "[0.0, 2.0]"),
    ({"n": 99}, "n", "[1, 8]"),
    ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
])
def test_bad_parameter_is_400_naming_it(suite: Suite, params: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(suite).chat.completions.create(model="smollm2-135m-instruct", messages=chat(), **params)
    assert info.value.status_code == 400 and info.value.param == param
    assert needle in info.value.message


def test_unknown_model_is_404(suite: Suite) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(suite).chat.completions.create(model="no-such-model", messages=chat())
    assert "no-such-model" in info.value.message


def test_over_the_rate_limit_is_429_with_retry_after(suite: Suite) -> None:
    _, key = create_tenant(suite.config.home, "http-rpm", requests_per_minute=1)
    api = client(suite, key)
    api.chat.completions.create(model="smollm2-135m-instruct", messages=chat(), max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        api.chat.completions.create(model="smollm2-135m-instruct", messages=chat(), max_tokens=1)
    headers = info.value.response.headers
    assert info.value.status_code == 429 and int(headers["retry-after"]) >= 1
    assert int(headers["retry-after"]) == -(-int(headers["retry-after-ms"]) // 1000)


def post(suite: Suite, body: bytes, content_type: str = "application/json") -> httpx.Response:
    return httpx.post(base_url(suite) + "/chat/completions", content=body, timeout=TIMEOUT_S,
                      headers={"authorization": f"Bearer {dev_key(suite)}", "content-type": content_type})


def test_malformed_json_wrong_type_and_huge_body_are_400_and_413(suite: Suite) -> None:
    for reply, status in ((post(suite, b'{"messages": [}'), 400), (post(suite, b"[1, 2]"), 400),
                          (post(suite, b'{"messages": []}', "text/plain"), 400),
                          (post(suite, b'{"x": "' + b"a" * (GatewayConfig().http_max_body_bytes + 1) + b'"}'), 413)):
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert reply.headers["x-request-id"]


async def test_a_client_that_disconnects_cancels_and_is_billed_for_what_it_was_sent(suite: Suite) -> None:
    request_id = new_request_id()
    body = {"model": "smollm2-135m-instruct", "messages": chat(f"Write a long essay about rivers ({request_id})."),
            "max_tokens": 1000, "temperature": 0, "stream": True}
    headers = {"authorization": f"Bearer {dev_key(suite)}", "x-request-id": request_id}
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http, \
            http.stream("POST", base_url(suite) + "/chat/completions", json=body, headers=headers) as reply:
        events = 0
        async for line in reply.aiter_lines():
            events += line.startswith("data: {")
            if events == 4:
                break  # leaving the block closes the connection mid-stream
    def row() -> Any:
        return next((r for r in ledger_rows(suite.config.home) if r.request_id == request_id), None)
    await eventually(lambda: row() is not None, TIMEOUT_S, "the cancelled stream's ledger row")
    cancelled = row()
    assert cancelled.status == "CANCELLED" and cancelled.finish_reason == "cancelled"
    assert 0 < cancelled.completion_tokens < 1000 and cancelled.cost_micros > 0


# --- curl, and the two doors billed alike -----------------------------------------------------

def test_curl_stream_line_by_line(suite: Suite) -> None:
    body = json.dumps({"model": "smollm2-135m-instruct", "messages": chat(), "max_tokens": 5, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    out = subprocess.run(
        ["curl", "-sS", "-N", "--max-time", str(TIMEOUT_S), base_url(suite) + "/chat/completions",
         "-H", f"Authorization: Bearer {dev_key(suite)}", "-H", "Content-Type: application/json", "-d", body],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=True).stdout
    lines = out.split("\n")
    assert lines[-3:] == ["data: [DONE]", "", ""]
    events = lines[:-3]
    assert all(line.startswith("data: {") for line in events[0::2]) and all(line == "" for line in events[1::2])
    chunks = [json.loads(line[len("data: "):]) for line in events[0::2]]
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


async def test_http_and_grpc_bill_the_same_request_alike(suite: Suite) -> None:
    text = f"Say hello to {new_request_id()}."  # a question of its own: no cache hit on either door
    http_id, grpc_id = new_request_id(), new_request_id()
    async with async_client(suite) as api:
        stream = await api.chat.completions.create(
            model="smollm2-135m-instruct", messages=chat(text), max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_headers={"x-request-id": http_id})
        http_usage = [c async for c in stream][-1].usage
    request = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_new_tokens=8, temperature=0),
                                          cache=gateway_pb2.CACHE_POLICY_BYPASS, model="smollm2-135m-instruct")
    request.chat.messages.add(role="user", content=text)
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            request, timeout=TIMEOUT_S, metadata=auth(dev_key(suite)) + (("x-request-id", grpc_id),))
        grpc_usage = [m async for m in call][-1].usage
    rows = {r.request_id: r for r in ledger_rows(suite.config.home) if r.request_id in {http_id, grpc_id}}
    http_row, grpc_row = rows[http_id], rows[grpc_id]
    prices = GatewayConfig().price_table()
    for row in (http_row, grpc_row):
        assert row.status == "OK" and not row.cache_hit and row.api == "Generate"
        assert row.cost_micros == prices.cost(row.model, row.prompt_tokens, row.completion_tokens, row.compute_ms)
    assert (http_row.prompt_tokens, http_row.completion_tokens, http_row.model) == \
        (grpc_row.prompt_tokens, grpc_row.completion_tokens, grpc_row.model)
    assert http_usage is not None
    assert (http_usage.prompt_tokens, http_usage.completion_tokens, extra(http_usage, "cost_micros")) == \
        (http_row.prompt_tokens, http_row.completion_tokens, http_row.cost_micros)
    assert (grpc_usage.prompt_tokens, grpc_usage.completion_tokens, grpc_usage.cost_micros) == \
        (grpc_row.prompt_tokens, grpc_row.completion_tokens, grpc_row.cost_micros)


async def test_grpc_generate_serves_logprobs_and_a_json_schema(suite: Suite) -> None:
    """The primary contract serves both options too: Complete with a schema and the top 3
    alternatives gives JSON that validates, one TokenLogprob per token, each with its bytes."""
    request = gateway_pb2.GenerateRequest(
        model="smollm2-135m-instruct", sampling=common_pb2.SamplingParams(max_new_tokens=64, temperature=0),
        logprobs=gateway_pb2.LogprobsOptions(enabled=True, top_logprobs=3),
        response_format=gateway_pb2.ResponseFormat(json_schema=gateway_pb2.JsonSchemaFormat(
            name="city", schema=json.dumps(SCHEMA))))
    request.chat.messages.add(role="user", content="Give a city and its population as JSON.")
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        reply = await gateway_pb2_grpc.GatewayStub(channel).Complete(request, timeout=TIMEOUT_S,
                                                                     metadata=auth(dev_key(suite)))
    jsonschema.validate(json.loads(reply.text), SCHEMA)
    assert [lp.token_id for lp in reply.logprobs] == list(reply.token_ids)
    assert b"".join(lp.token_bytes for lp in reply.logprobs).decode().startswith(reply.text)
    for lp in reply.logprobs:
        assert lp.logprob <= 0 and 1 <= len(lp.top) <= 3
        assert lp.top[0].logprob >= lp.logprob - 1e-6  # greedy picks the most likely allowed token
