"""Where an answer lives in the cache: the namespace, and what is matched by meaning."""

from __future__ import annotations

from services.gateway.cache_keys import cache_key

CHAT = (("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "capital of France?"))


def test_a_chats_last_user_message_is_matched_by_meaning_within_its_conversation() -> None:
    key = cache_key("m@1", "acme", "p", "RENDERED", CHAT, is_truncated=False)
    assert (key.prompt, key.query) == ("RENDERED", "capital of France?")
    assert (key.scope.model, key.scope.tenant, key.scope.params) == ("m@1", "acme", "p")
    assert len(key.scope.context) == 64  # a sha256 of the earlier turns, never the turns themselves
    # the same earlier turns share a namespace; another system prompt is another namespace
    again = cache_key("m@1", "acme", "p", "OTHER RENDERING", (*CHAT[:3], ("user", "and of Spain?")), False)
    assert again.scope == key.scope
    other = cache_key("m@1", "acme", "p", "RENDERED", (("system", "be verbose"), *CHAT[1:]), False)
    assert other.scope.context != key.scope.context


def test_raw_prompts_truncated_prompts_and_non_user_endings_are_exact_only() -> None:
    raw = cache_key("m@1", "acme", "p", "continue this", None, is_truncated=False)
    truncated = cache_key("m@1", "acme", "p", "[truncated-left:4]...", CHAT, is_truncated=True)
    assistant_last = cache_key("m@1", "acme", "p", "RENDERED", CHAT[:3], is_truncated=False)
    for key in (raw, truncated, assistant_last):
        assert key.query == "" and key.scope.context == ""


def test_model_tenant_and_parameters_separate_namespaces() -> None:
    base = cache_key("m@1", "acme", "p", "RENDERED", CHAT, False)
    for changed in (cache_key("m@2", "acme", "p", "RENDERED", CHAT, False),
                    cache_key("m@1", "other", "p", "RENDERED", CHAT, False),
                    cache_key("m@1", "acme", "q", "RENDERED", CHAT, False)):
        assert changed.scope != base.scope and changed.query == base.query
