"""A small rule-based sentence splitter (no model, no external dependencies).

Sentences only feed sentence-level objectives (NSP/SOP) and shard sentence offsets, so a cheap splitter
that is right on ordinary prose is enough: lines are always boundaries; a . ! or ? (and the Devanagari danda, the
Arabic question mark) ends a sentence when followed by whitespace and something that can start one (an ASCII capital
or digit, or a capital or caseless letter of a non-Latin script), unless the word it ends is an English abbreviation;
a full-width 。！？ ends one wherever text follows, as CJK writes no space after it.
"""

from __future__ import annotations

import functools
import re
import unicodedata

SPLITTER_VERSION = 2  # 2: sentences of non-Latin scripts (Latin text splits as in version 1)
"""Bump when a change here changes any split: shard caches are keyed on it."""

# Lowercased words whose final period does not end a sentence.
ABBREVIATIONS = frozenset(
    """
mr. mrs. ms. messrs. dr. prof. st. jr. sr. rev. hon. gen. col. capt. lt. sgt. gov. sen. rep. pres.
mt. ft. no. nos. vol. vols. fig. figs. ch. sec. art. p. pp. ed. eds. al. cf. vs. v. approx. dept. est.
inc. ltd. co. corp. bros. jan. feb. mar. apr. jun. jul. aug. sep. sept. oct. nov. dec.
e.g. i.e. u.s. u.k. u.n. u.s.a. a.m. p.m. d.c. n.y.
""".split()
)

_LINES = re.compile(r"\s*\n\s*")
# A candidate end: terminal punctuation, optional closing quotes/brackets, whitespace, then (opening quotes and) the
# character that decides (`_starts_sentence`); or a full-width terminal, its closing brackets and any spaces, but
# not one a quotation ends with (「…。」と言った。 is one sentence).
_END = re.compile(
    r"[.!?\u0964\u0965\u061f]+[\"'\u201d\u2019)\]]*\s+(?=[\"'\u201c\u2018\u00ab(\[]?(?P<next>\S))"
    r"|[\u3002\uff01\uff1f]+(?![\u3002\uff01\uff1f\u300d\u300f])[\uff09\u201d\u2019]*\s*(?=\S)"
)
_INITIAL = re.compile(r"^[(\[\"'\u201c\u2018]*[A-Za-z]\.$")  # "J." in "John F. Kennedy"


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, stripped, in order; empty pieces dropped."""
    out: list[str] = []
    for line in _LINES.split(text):
        start = 0
        for m in _END.finditer(line):
            if m["next"] is not None and not _starts_sentence(m["next"]):
                continue
            if line[m.start()] == "." and _is_abbreviation(line, m.start()):
                continue
            piece = line[start : m.end()].strip()
            if piece:
                out.append(piece)
            start = m.end()
        piece = line[start:].strip()
        if piece:
            out.append(piece)
    return out


@functools.cache
def _starts_sentence(c: str) -> bool:
    """A character a sentence may start with: an ASCII capital or digit, as version 1 had it (so that Latin text,
    English above all, splits as before and its shards stay the same), or a capital or letter of another script:
    Cyrillic, Greek, and the scripts without case (Chinese, Arabic, Devanagari; category Lo)."""
    if c.isascii():
        return c.isupper() or c.isdigit()
    return unicodedata.category(c) in ("Lu", "Lt", "Lo") and not unicodedata.name(c, "").startswith("LATIN")


def _is_abbreviation(line: str, dot: int) -> bool:
    """Whether the period at `dot` closes an abbreviation or an initial rather than a sentence."""
    word_start = line.rfind(" ", 0, dot) + 1  # back over the word only: a search from the line's start was quadratic
    word = line[word_start : dot + 1]
    return word.lower().lstrip("(\"'\u201c\u2018") in ABBREVIATIONS or bool(_INITIAL.match(word))
