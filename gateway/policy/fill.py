"""Budget-filling recall: rank the dropped history by what the current request asks.

When eviction drops history, the budget the stable part leaves free is filled with
the dropped groups most relevant to the current user message, best first. Relevance
is Okapi BM25 over the words the memory store indexes (CJK runs as bigrams,
store.model.index_text), so it is a function of the request alone: no store, the
same answer on every replica. Pure: no I/O.

The index of a session's history is kept in the conversation's memo and extended
where the history grew: a session's groups are the same objects request after
request (history.join), so a growing session never re-reads its old text.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
import sys
from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.measure.bounded import BoundedMemo
from gateway.measure.conversation import Conversation, Group
from gateway.measure.terms import index_text

K1 = 1.2  # term-frequency saturation (the usual Okapi values)
B = 0.75  # length normalisation
# a group 1, 2, 3, 4 groups after / before a relevant one gets this share of its score:
# the reply to a matching message often holds the answer, and a topic runs over a few
# messages (LoCoMo dev, 4k: +2.2 points of evidence kept with 0.3 for the next one only;
# evidence ranked within 800 tokens of fill: 0.3 -> 0.5: +1.5 points, the wider window:
# 61.4 -> 64.8%); what follows a match more than what precedes it (shipped rules, 2k /
# 4k / 8k: +0.9 / +0.4 / -0.1 points against 0.5 / 0.35 / 0.2 / 0.1 on both sides; six
# groups on both sides: +0.5 / +0.5 / -0.1; BM25 k1 1.5 b 0.9: 0 / +0.2 / 0, k1 1.2
# b 0.5: +0.1 / +0.4 / -0.1)
AFTER = (0.6, 0.4, 0.25, 0.1)
BEFORE = (0.4, 0.3, 0.15, 0.1)
SPREAD = tuple(loan for d, (after, before) in enumerate(zip(AFTER, BEFORE), 1)
               for loan in ((d, after), (-d, before)))  # (offset, share)
# idf raised to this power: a question's one rare word outweighs its common ones (LoCoMo
# dev, evidence ranked within 800 tokens of fill: 56.5 -> 58.2%)
IDF_POWER = 2.0
# English function words: a question's "what did she ... when" matches every other
# question in a chat, not the answer (LoCoMo dev, within 800 tokens: 51.8 -> 56.5%)
STOPWORDS = frozenset("""a an the and or but if of to in on at by for with from as is are
was were be been being am do does did doing have has had having i me my myself we our ours
you your yours he him his she her hers it its they them their what which who whom whose when
where why how this that these those there here not no nor so than too very can will just
would could should shall may might must about into over after before again further then
once all any both each few more most other some such only own same don now up down out
off""".split())
# what one request's scoring reads, whatever the history's length (a warm request of a
# growing session costs the same at 100 or 10,000 messages): the query's first terms
# (as the store's search), and per term its newest groups; a term in more groups than
# that is common (its idf, squared, adds little)
MAX_QUERY_TERMS = 64
MAX_POSTINGS = 128
# and in all, the rarest terms first (their idf, squared, weighs most): a question of
# common words over a repetitive history (logs, code, a template) reads this many, not
# up to 64 x 128 (LoCoMo dev reads a median of 69, at most 334: 1.7% of its requests
# are cut, retention within 0.1 point at 2k / 4k / 8k; BFCL at most 29)
MAX_READ = 256
# the best direct matches lend their neighbours a share (LoCoMo dev, mean of five
# budgets around 2k / 4k / 8k: MAX_READ 512 and 128 of them -> 256 and 64, 81.0 / 88.1
# / 92.8 -> 81.0 / 88.0 / 93.0%, 81.0 / 88.1 / 93.0% reading only the candidates'
# postings (_read's `below`); at 8k alone 64 -> 32: -0.4 points, 16: -1.0)
MAX_SPREAD = 64
_SUFFIXES = ("ing", "ed", "es", "s")
_MEMO_KEY = "fill_index"
_SCORE_THEN_GROUP = operator.itemgetter(1, 0)  # of a (group, score) pair


@dataclass(slots=True)
class Index:
    """The words of groups[:n], per group."""

    n: int = 0
    last: Group | None = None  # groups[n - 1]: the same object while the session grows
    words: list[Mapping[str, int]] = field(default_factory=list)  # term -> frequency
    lengths: list[int] = field(default_factory=list)  # words per group
    total: int = 0  # sum(lengths)
    # term -> the groups holding it, ascending: scoring a query reads only its terms'
    # groups, so a growing session's warm request costs what its question matches,
    # not its history's length
    postings: dict[str, list[int]] = field(default_factory=dict)


def group_text(grp: Group, text_of: Callable[[int], str]) -> str:
    return "\n".join(text_of(i) for i in grp.indices)


@functools.lru_cache(maxsize=1 << 16)
def _stem(word: str) -> str:
    """An English inflection off an indexed word ("researched" finds "research"; LoCoMo
    dev, 4k: +1.3 points); other scripts as indexed."""
    if word.isascii():
        for suffix in _SUFFIXES:
            if len(word) > len(suffix) + 3 and word.endswith(suffix):
                return word[: -len(suffix)]
    return word


def terms(text: str) -> list[str]:
    """The words the fill matches on: the store's index words, stemmed."""
    return [_stem(w) for w in index_text(text).split()]


# a group's text can be a long tool output: bounded by bytes as well (issue #39)
COUNTED_BYTES = 16 << 20  # the default share (limits.cache_mb)
COUNTED: BoundedMemo[str, Mapping[str, int]] = BoundedMemo(8192, COUNTED_BYTES)


def _counted(text: str) -> Mapping[str, int]:
    """A group's words by text: a history parsed again (no session cache, another
    replica's session) is not read again (bounded: 8,192 texts and COUNTED_BYTES, shared,
    never changed)."""
    words = COUNTED.get(text)
    if words is None:
        words = Counter(terms(text))
        # the text, and per distinct word a dict slot (its string is _stem's, shared)
        COUNTED.put(text, words, sys.getsizeof(text) + sys.getsizeof(words))
    return words


def index_history(conv: Conversation, end: int, text_of: Callable[[int], str]) -> Index:
    """The index of groups[:end], resumed from the memo when its groups are still these."""
    groups = conv.groups
    idx = conv.memo.get(_MEMO_KEY)
    if not isinstance(idx, Index) or idx.n > end or (idx.n and groups[idx.n - 1] is not idx.last):
        idx = Index()
    postings = idx.postings
    for g in range(idx.n, end):
        words = _counted(group_text(groups[g], text_of))
        n = sum(words.values())
        for term in words:
            hits = postings.get(term)
            if hits is None:
                postings[term] = [g]
            else:
                hits.append(g)
        idx.words.append(words)
        idx.lengths.append(n)
        idx.total += n
    if end:
        idx.n, idx.last = end, groups[end - 1]
    conv.memo[_MEMO_KEY] = idx
    return idx


def query_terms(query: str, common: Container[str] = ()) -> list[str]:
    """The query's distinct terms that say what it is about: no function words, none of
    the `common` terms (the system prompt's: the names and setting every request
    repeats; LoCoMo dev, within 300 tokens of fill: 43.0 -> 47.9%). All of them when
    nothing else is left."""
    distinct = list(dict.fromkeys(terms(query)))
    some = [t for t in distinct if t not in STOPWORDS and t not in common] or distinct
    return some[:MAX_QUERY_TERMS]


def common_terms(text: str) -> Mapping[str, int]:
    """The terms of `text` (the always-kept system part), cached by text."""
    return _counted(text)


def bm25(idx: Index, query: Sequence[str], eligible: Container[int],
         below: int | None = None) -> dict[int, float]:
    """BM25 score (idf squared) of every eligible group that holds at least one of the
    query's terms; reads only the groups that hold them, for each term its newest
    MAX_POSTINGS, MAX_READ in all (_read; `below`: no eligible group is past it)."""
    n = idx.n
    if not n:
        return {}
    avg = idx.total / n or 1.0
    words, lengths, postings = idx.words, idx.lengths, idx.postings
    scores: dict[int, float] = {}
    get = scores.get
    k1p, omb = K1 + 1.0, 1.0 - B
    norms: dict[int, float] = {}  # per group, once: most groups hold several query terms
    norm_of = norms.get
    for term, df, hits in _read(postings, query, below=below):
        idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5)) ** IDF_POWER
        for g in hits:
            if g in eligible:
                tf = words[g][term]
                norm = norm_of(g)
                if norm is None:
                    norm = norms[g] = K1 * (omb + B * lengths[g] / avg)
                scores[g] = get(g, 0.0) + idf * tf * k1p / (tf + norm)
    return scores


def _read(postings: Mapping[str, list[int]], query: Sequence[str],
          per_term: int = MAX_POSTINGS, in_all: int = MAX_READ, below: int | None = None
          ) -> list[tuple[str, int, list[int]]]:
    """(term, how many groups hold it, the groups scoring reads) of the query's terms the
    index holds, in query order: of its groups before `below` (the fill's candidates end
    there: the newer ones are kept), its newest `per_term`, and `in_all` in all, the
    rarest terms' first (a term past that reads its newest that are left, or none)."""
    found = []  # (term, its groups, how many of them come before `below`)
    for term in dict.fromkeys(query):
        hits = postings.get(term)
        if hits:
            n = len(hits) if below is None or hits[-1] < below else bisect.bisect_left(
                hits, below)
            if n:
                found.append((term, hits, n))
    if sum(min(n, per_term) for _, _, n in found) <= in_all:
        return [(term, len(hits), hits[n - per_term:n] if n > per_term else hits[:n])
                for term, hits, n in found]
    left, share = in_all, {}
    for term, _, n in sorted(found, key=lambda t: len(t[1])):  # stable: ties in query order
        share[term] = take = min(n, per_term, left)
        left -= take
    return [(term, len(hits), hits[n - share[term]:n]) for term, hits, n in found
            if share[term]]


def rank(idx: Index, query: str, eligible: Container[int],
         common: Container[str] = (), below: int | None = None) -> list[int]:
    """Eligible groups that share words with `query` (but the `common` ones) or sit next
    to one that does, best first (ties: the newer); `below`: no eligible group is past
    it (the postings scoring reads are those of the groups before it)."""
    direct = bm25(idx, query_terms(query, common), eligible, below)
    best = direct if len(direct) <= MAX_SPREAD else dict(
        sorted(direct.items(), key=_SCORE_THEN_GROUP, reverse=True)[:MAX_SPREAD])
    # what the neighbours get, summed first: matches sit together (a topic), so most
    # neighbours are lent to by several and their eligibility is asked once, not per loan
    lent: dict[int, float] = {}
    get = lent.get
    for g, score in best.items():
        for offset, share in SPREAD:
            h = g + offset
            lent[h] = get(h, 0.0) + share * score
    scores = dict(direct)
    for h, part in lent.items():
        if h in direct or h in eligible:
            scores[h] = scores.get(h, 0.0) + part
    # best first, ties: the newer (the keys are distinct: the same order as sorting by
    # (-score, -group), with no Python-level key function)
    return [g for g, _ in sorted(scores.items(), key=_SCORE_THEN_GROUP, reverse=True)]


def forward_order(kept: Sequence[int], recalled: Sequence[int], current: int) -> list[int]:
    """The order kept items are forwarded in: the stable part (system and the kept history,
    as they were), then the recalled items (in their own order), then the current turn
    from message `current` on. Recalled history after the stable prefix leaves the
    provider's prompt cache hitting on it whatever the question recalls."""
    if not recalled:
        return list(kept)
    back = set(recalled)
    return ([i for i in kept if i < current and i not in back] + list(recalled)
            + [i for i in kept if i >= current])
