"""The key-term guard: which prompt pairs may share an answer, and why not."""

from __future__ import annotations

import pytest

from services.cache.guard import disagreement, key_terms


def why(a: str, b: str) -> str | None:
    return disagreement(key_terms(a), key_terms(b))


@pytest.mark.parametrize(("a", "b"), [
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("what is the capital of italy", "What is the capital of Italy?"),  # a name typed in lower case
    ("Give me three tips for better sleep.", "What are 3 tips for sleeping better?"),  # number words
    ("What is the GDP of Germany?", "How large is Germany's GDP?"),  # possessive
    ("Explain photosynthesis in simple terms.", "Can you explain photosynthesis simply?"),
    ("Australia's capital city is which one?", "What is the capital of Australia?"),  # "which one" is no number
    ("北京是不是中国的首都？", "北京是中国的首都吗？"),  # 是不是 asks, it does not negate
    ("世界上最高的山是哪座？", "世界最高的山是哪一座？"),  # filler added on one side only
    ("Python怎么读取文件？", "用Python如何读取文件？"),
])
def test_paraphrases_agree(a: str, b: str) -> None:
    assert why(a, b) is None


@pytest.mark.parametrize(("a", "b", "reason"), [
    ("What is the capital of France?", "What is the capital of Germany?", "entity"),
    ("When did World War II end?", "When did World War I end?", "entity"),
    ("What is 12 times 7?", "What is 12 times 8?", "number"),
    ("Give me three tips.", "Give me five tips.", "number"),
    ("Explain the first law of thermodynamics.", "Explain the second law of thermodynamics.", "number"),
    ("Which birds can fly?", "Which birds can't fly?", "negation"),
    ("How do I make bread with yeast?", "How do I make bread without yeast?", "negation"),
    ("Which mushrooms are edible?", "Which mushrooms are inedible?", "negation"),
    ("How do I turn on dark mode?", "How do I turn off dark mode?", "opposite"),
    ("Who founded Microsoft?", "When was Microsoft founded?", "answer_kind"),
    ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?", "order"),
    ("What is 10 divided by 2?", "What is 2 divided by 10?", "order"),
    ("What is the capital of France?", "法国的首都是哪里？", "script"),
    ("法国的首都是哪里？", "德国的首都是哪里？", "cjk_term"),
    ("12乘以7等于多少？", "12乘以8等于多少？", "number"),
    ("第二次世界大战是哪一年结束的？", "第一次世界大战是哪一年结束的？", "number"),
    ("哪些鸟会飞？", "哪些鸟不会飞？", "negation"),
])
def test_one_different_fact_disagrees(a: str, b: str, reason: str) -> None:
    assert why(a, b) == reason
    assert why(b, a) == reason


def test_words_that_only_look_negative_do_not_negate() -> None:
    assert not key_terms("这个问题非常重要，未来怎么办？").is_negated
    assert key_terms("这个问题不重要").is_negated
