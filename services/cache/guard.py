"""The key-term guard: the cheap second half of the semantic match rule.

Embedding similarity says two prompts are *about* the same thing; it cannot tell "capital of
France" from "capital of Germany", 12 x 7 from 12 x 8, or "safe" from "not safe". A semantic
hit therefore also needs the two prompts to agree on their key terms:

- numbers (digits, English number words and ordinals, Chinese numerals) as sets;
- negation (not / no / never / n't / without ..., 不 / 没 / 无 ...), and a word that is the
  other prompt's word with a negating prefix (un-, in-, dis-, non- ...);
- named entities: a capitalised word or acronym of one prompt must occur in the other
  (case-insensitively), so "what is the capital of italy" still meets "... of Italy?";
- script: a Chinese prompt never matches an English one (the answer would be in the wrong
  language);
- Chinese content characters: a *substitution* (content characters on both sides that the other
  lacks, as in 法国 / 德国) fails, an addition of filler on one side (哪一座 / 哪座) does not.

Pure string work, microseconds per pair; no model, no grpc. ``calibrate.py`` measures the rule
with and without this guard on the labelled pairs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CJK = r"\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WORD = re.compile(rf"[A-Za-z][A-Za-z'’\-]*|\d+(?:[.,]\d+)*(?:st|nd|rd|th)?|[{_CJK}]")
_SENTENCE_START = re.compile(r"(?:^|[.!?。！？;；:：]\s*)[\"'“‘(]*([A-Za-z][\w'’\-]*)")
_CJK_NUMERAL_RUN = re.compile(r"第?[零〇一二两三四五六七八九十百千万亿]+")

_NUMBER_WORDS = {
    "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12",
    "thirteen": "13", "fourteen": "14", "fifteen": "15", "sixteen": "16", "seventeen": "17",
    "eighteen": "18", "nineteen": "19", "twenty": "20", "thirty": "30", "forty": "40", "fifty": "50",
    "sixty": "60", "seventy": "70", "eighty": "80", "ninety": "90", "hundred": "100",
    "thousand": "1000", "million": "1000000", "billion": "1000000000", "dozen": "12",
    "first": "1", "third": "3", "fourth": "4", "fifth": "5", "sixth": "6", "seventh": "7",
    "eighth": "8", "ninth": "9", "tenth": "10", "twice": "2", "double": "2", "triple": "3",
}
_NEGATION_WORDS = frozenset({
    "not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without", "cannot",
    "nowhere",
})
_NEGATING_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non", "non-", "anti")
# Chinese negation characters, and compounds where they do not negate (非常 = very, 未来 = future).
_CJK_NEGATIONS = frozenset("不没沒无無非未别別莫勿")
_CJK_NOT_NEGATING = ("非常", "未来", "别人", "不同", "无线", "无论", "不错", "并非", "莫名", "差不多")
_A_NOT_A = re.compile(rf"([{_CJK}])[不没]\1")  # 是不是, 有没有: a yes/no question, not a negation
# Function characters of Chinese questions: dropping or adding them does not change the question.
_CJK_FUNCTION = frozenset(
    "的了吗嗎呢吧啊呀嘛是在有请請问問一下哪里裡儿兒什么麼怎样樣如何个個告诉訴我你他她它们們能可以会會要想"
    "应應该該这這那些几幾多少和与與及或对對给給把被让讓用为為就还還也很吗得地着著过過叫呀呢元")
# Capitalised words that are not names: question words, auxiliaries, imperatives, pronouns.
_NOT_ENTITIES = frozenset("""
a about above after all also an and any are as at be because before but by can could define describe
did do does during each even every explain find for from give has have hello help her here hey hi his
how i i'd i'll i'm i've if in into is it it's its just let let's list make may me might must my name
no not now of on or our please provide quick quickly say shall she should show so some suggest
summarize summarise tell thanks thank that that's the their them then there these they this those to
translate under use was we were what what's whats when where where's which who who's whom whose why
will with would write you your compose recommend calculate compute convert create round briefly
""".split())
_FOLD = str.maketrans({"’": "'", "两": "二", "〇": "零"})
_PRONOUN_ONE = re.compile(r"\b(?:which|this|that|the|each|every|any|no|some|another)\s+one\b|\bone\s+(?:of|another)\b",
                          re.IGNORECASE)
# Opposites: one prompt has one word, the other its opposite (and not the word itself).
_OPPOSITES = [tuple(pair.split("/")) for pair in """
on/off up/down in/out before/after above/below over/under inside/outside open/close start/stop
add/remove add/drop increase/decrease increase/reduce raise/lower import/export upload/download
encrypt/decrypt compress/decompress push/pull buy/sell borrow/lend send/receive win/lose gain/lose
good/bad best/worst better/worse high/low higher/lower highest/lowest hot/cold hotter/colder
hottest/coldest warm/cool big/small bigger/smaller biggest/smallest large/small larger/smaller
largest/smallest long/short longer/shorter longest/shortest tall/short fast/slow faster/slower
fastest/slowest heavy/light old/new old/young oldest/youngest early/late earlier/later first/last
near/far nearer/farther closest/farthest nearest/farthest cheap/expensive rich/poor strong/weak
easy/hard easy/difficult safe/dangerous healthy/unhealthy true/false right/wrong left/right
north/south east/west more/less most/least many/few max/min maximum/minimum ascending/descending
horizontal/vertical horizontally/vertically positive/negative plus/minus pros/cons
advantages/disadvantages benefits/risks benefits/drawbacks causes/effects causes/consequences
male/female men/women boy/girl day/night summer/winter spring/autumn spring/fall sunrise/sunset
enable/disable allow/deny accept/reject include/exclude encode/decode login/logout sign-in/sign-out
""".split()]
# What kind of answer a question wants; two prompts that want different kinds never share one.
_ANSWER_KINDS = {"who": "person", "whom": "person", "whose": "person", "when": "time",
                 "where": "place", "why": "reason"}


@dataclass(frozen=True, slots=True)
class KeyTerms:
    """What of a prompt must agree with the other prompt for a semantic hit."""

    numbers: frozenset[str]
    is_negated: bool
    entities: frozenset[str]
    words: tuple[str, ...]
    """Every Latin word and number in order, lowercased, possessive dropped."""
    cjk_content: frozenset[str]
    script: str
    """"cjk", "latin" or "" (neither): by majority of CJK characters vs Latin words."""


def _norm(word: str) -> str:
    word = word.lower().translate(_FOLD)
    return word[:-2] if word.endswith("'s") else word.rstrip("'")


def _numbers(text: str, tokens: list[str]) -> set[str]:
    found: set[str] = set()
    if _PRONOUN_ONE.search(text):  # "which one", "one of": a pronoun, not the number
        tokens = [t for t in _WORD.findall(_PRONOUN_ONE.sub(" ", text)) if t[0].isascii()]
    for token in tokens:
        if token[0].isdigit():
            found.add(re.sub(r"(st|nd|rd|th)$", "", token).replace(",", ""))
        elif (value := _NUMBER_WORDS.get(token.lower())) is not None:
            found.add(value)
    for run in _CJK_NUMERAL_RUN.findall(text.translate(_FOLD)):
        if run != "一":  # a lone 一 is mostly "a" (一下, 一个, 一共), not the number one
            found.add(run.removeprefix("第"))
    return found


def _is_negated(text: str, tokens: list[str]) -> bool:
    for token in tokens:
        lower = token.lower().translate(_FOLD)
        if lower in _NEGATION_WORDS or lower.endswith("n't"):
            return True
    cjk = _A_NOT_A.sub("", text)
    for compound in _CJK_NOT_NEGATING:
        cjk = cjk.replace(compound, "")
    return any(ch in _CJK_NEGATIONS for ch in cjk)


def _entities(text: str, tokens: list[str]) -> set[str]:
    starts = {m.start(1) for m in _SENTENCE_START.finditer(text)}
    found: set[str] = set()
    for match in _WORD.finditer(text):
        token = match.group()
        if not token[0].isupper():
            continue
        word = _norm(token)
        if word in _NOT_ENTITIES and (match.start() in starts or word in {"the", "a", "an", "of", "and", "i"}):
            continue
        found.add(word)
    return found


def key_terms(text: str) -> KeyTerms:
    """The key terms of one prompt (cheap: regular expressions over the text)."""
    tokens = _WORD.findall(text)
    latin = [t for t in tokens if t[0].isascii()]
    cjk = [t for t in tokens if not t[0].isascii()]
    num_words = sum(1 for t in latin if t[0].isalpha())
    script = "" if not (cjk or num_words) else ("cjk" if len(cjk) >= num_words else "latin")
    return KeyTerms(
        numbers=frozenset(_numbers(text, latin)),
        is_negated=_is_negated(text, latin),
        entities=frozenset(_entities(text, latin)),
        words=tuple(_norm(t) for t in latin),
        cjk_content=frozenset(ch for ch in cjk if ch not in _CJK_FUNCTION and ch not in _CJK_NEGATIONS),
        script=script,
    )


def _prefix_negates(words: set[str], others: set[str]) -> bool:
    """"unsafe" against "safe", "disadvantages" against "advantages"."""
    for word in words - others:
        for prefix in _NEGATING_PREFIXES:
            stem = word.removeprefix(prefix)
            if stem != word and len(stem) >= 4 and stem in others:
                return True
    return False


def _opposed(words: set[str], others: set[str]) -> bool:
    only, other_only = words - others, others - words
    return any((x in only and y in other_only) or (y in only and x in other_only) for x, y in _OPPOSITES)


def _kinds(words: tuple[str, ...]) -> set[str]:
    return {_ANSWER_KINDS[w] for w in words if w in _ANSWER_KINDS}


def disagreement(a: KeyTerms, b: KeyTerms) -> str | None:
    """Why ``a`` and ``b`` must not share an answer ("number", "negation", ...), or None if they agree."""
    if a.script != b.script:
        return "script"
    if a.numbers != b.numbers:
        return "number"
    words_a, words_b = set(a.words), set(b.words)
    if a.is_negated != b.is_negated or _prefix_negates(words_a, words_b) or _prefix_negates(words_b, words_a):
        return "negation"
    if _opposed(words_a, words_b):
        return "opposite"
    if not a.entities <= words_b or not b.entities <= words_a:
        return "entity"
    if (kinds_a := _kinds(a.words)) and (kinds_b := _kinds(b.words)) and not kinds_a & kinds_b:
        return "answer_kind"
    if a.words != b.words and sorted(a.words) == sorted(b.words):
        return "order"  # the same words in another order: "Celsius to Fahrenheit" / "Fahrenheit to Celsius"
    if (a.cjk_content - b.cjk_content) and (b.cjk_content - a.cjk_content):
        return "cjk_term"
    return None
