"""The terms a text is indexed and searched by: words as they are, CJK runs as bigrams.

One definition for the memory store's full-text index, the recall of archived turns and
the budget fill's ranking, so that what one of them finds the others find too.
"""

from __future__ import annotations

import re

MAX_QUERY_TERMS = 64  # the first distinct terms of a query; the rest is not searched
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")
_WORD = re.compile(r"\w+", re.UNICODE)


def index_text(text: str) -> str:
    """Words as they are, CJK runs as overlapping bigrams (single characters stay)."""
    out: list[str] = []
    pos = 0
    for m in _CJK.finditer(text):
        out.extend(_WORD.findall(text[pos:m.start()]))
        run = m.group(0)
        out.extend([run] if len(run) == 1 else [run[i:i + 2] for i in range(len(run) - 1)])
        pos = m.end()
    out.extend(_WORD.findall(text[pos:]))
    return " ".join(w.lower() for w in out)


def query_terms(query: str) -> list[str]:
    """The query's first MAX_QUERY_TERMS distinct terms (a 20k-word paste stays bounded)."""
    out: dict[str, None] = {}
    for t in index_text(query).split():
        out[t] = None
        if len(out) == MAX_QUERY_TERMS:
            break
    return list(out)
