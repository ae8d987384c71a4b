"""A small rule-based English sentence splitter (no model, no external dependencies).

Sentences only feed sentence-level objectives (NSP/SOP) and shard sentence offsets, so a cheap splitter
that is right on ordinary prose is enough: lines are always boundaries, and a . ! or ? ends a sentence
when followed by whitespace and something that can start one, unless the word it ends is an abbreviation.
"""

from __future__ import annotations

import re

SPLITTER_VERSION = 1
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
# A candidate end: terminal punctuation, optional closing quotes/brackets, whitespace, then a sentence start.
_END = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*\s+(?=[\"'\u201c\u2018(\[]?[A-Z0-9])")
_INITIAL = re.compile(r"^[(\[\"'\u201c\u2018]*[A-Za-z]\.$")  # "J." in "John F. Kennedy"


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, stripped, in order; empty pieces dropped."""
    out: list[str] = []
    for line in _LINES.split(text):
        start = 0
        for m in _END.finditer(line):
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


def _is_abbreviation(line: str, dot: int) -> bool:
    """Whether the period at `dot` closes an abbreviation or an initial rather than a sentence."""
    word_start = line.rfind(" ", 0, dot) + 1
    word = line[word_start : dot + 1]
    return word.lower().lstrip("(\"'\u201c\u2018") in ABBREVIATIONS or bool(_INITIAL.match(word))
