"""OpenAI bodies -> GenerateRequest: shapes, types, and what is refused (naming the parameter)."""

from __future__ import annotations

from typing import Any

import pytest

from aiserve.common.errors import InvalidArgument
from aiserve.v1 import gateway_pb2
from services.gateway.http_errors import openai_message
from services.gateway.openai_request import ParamError, cache_policy, chat_request, completion_request, parse_body

USER = [{"role": "user", "content": "hi"}]


def test_null_parameters_are_unset_and_neutral_ones_are_accepted() -> None:
    asked = chat_request({"messages": USER, "tools": None, "temperature": None, "frequency_penalty": 0,
                          "logit_bias": {}}, 8)
    assert not asked.request.sampling.HasField("temperature") and asked.n == 1 and asked.top_logprobs is None


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": USER, "tools": []}, "tools"),
    ({"messages": USER, "presence_penalty": 1.0}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": "hi"}, "messages"),
    ({"messages": USER, "max_tokens": 4, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"messages": USER, "max_tokens": "4"}, "max_tokens"),
    ({"messages": USER, "temperature": True}, "temperature"),
    ({"messages": USER, "seed": -1}, "seed"),
    ({"messages": USER, "stop": [1]}, "stop"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"messages": USER, "user": "u" * 257}, "user"),
])
def test_refused_naming_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ParamError) as info:
        chat_request(body, 8)
    assert info.value.param == param and info.value.message.startswith(param + ":")


def test_chat_shape_onto_the_request() -> None:
    asked = chat_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}] + USER,
                          "max_completion_tokens": 9, "stop": "END", "n": 3, "seed": 5, "logprobs": True,
                          "stream": True, "stream_options": {"include_usage": True}, "user": "u", "top_k": 4}, 8)
    r = asked.request
    assert [(m.role, m.content) for m in r.chat.messages] == [("system", "ab"), ("user", "hi")]
    assert (r.sampling.max_new_tokens, list(r.sampling.stop), r.sampling.top_k) == (9, ["END"], 4)
    assert r.logprobs.enabled and r.logprobs.top_logprobs == 0 and asked.top_logprobs == 0
    assert asked.stream and asked.include_usage and asked.user == "u"
    assert [asked.choice(i).sampling.seed for i in range(3)] == [5, 6, 7]


def test_completions_take_one_prompt() -> None:
    assert completion_request({"prompt": ["once"]}, 8).request.prompt == "once"
    with pytest.raises(ParamError, match="prompt"):
        completion_request({"prompt": ["a", "b"]}, 8)
    with pytest.raises(ParamError, match=r"logprobs: must be in \[0, 5\]"):
        completion_request({"prompt": "a", "logprobs": 6}, 8)


def test_bodies_must_be_json_objects() -> None:
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        parse_body(b"{")
    with pytest.raises(InvalidArgument, match="must be a JSON object"):
        parse_body(b"[]")


def test_gateway_messages_name_the_openai_parameter() -> None:
    assert openai_message("sampling.max_new_tokens: must be in [1, 2048], got 5000", True) == \
        ("max_tokens: must be in [1, 2048], got 5000", "max_tokens")
    assert openai_message("sampling.top_p: must be in (0.0, 1.0], got 0.0", False)[1] == "top_p"
    assert openai_message("chat.messages[1].content: must not be empty", True)[1] == "messages[1].content"
    assert openai_message("prompt: 9000 tokens + max_new_tokens 16 exceed", True)[1] == "messages"
    assert openai_message("prompt: must not be empty", False)[1] == "prompt"


@pytest.mark.parametrize(("header", "policy"), [
    ("", gateway_pb2.CACHE_POLICY_USE),
    ("max-age=0", gateway_pb2.CACHE_POLICY_USE),
    ("no-cache", gateway_pb2.CACHE_POLICY_REFRESH),
    ("No-Cache", gateway_pb2.CACHE_POLICY_REFRESH),
    ("max-age=0, no-cache", gateway_pb2.CACHE_POLICY_REFRESH),
    ("no-store", gateway_pb2.CACHE_POLICY_BYPASS),
    ("no-cache,no-store", gateway_pb2.CACHE_POLICY_BYPASS),
    ('no-cache="x", NO-STORE', gateway_pb2.CACHE_POLICY_BYPASS),
    ("no-stored, nocache", gateway_pb2.CACHE_POLICY_USE),
])
def test_cache_control_header_is_the_cache_policy(header: str, policy: int) -> None:
    assert cache_policy(header) == policy
