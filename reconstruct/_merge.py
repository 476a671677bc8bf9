"""Prefix merging: a session's model calls → a few traces ``p1 ‖ a1 ‖ u1 ‖ a2 ‖ … ‖ aK``, each call in exactly one.

Notation: call C_i has prompt ids p_i (the server's tokenization) and sampled ids a_i with their log-probs.

1. **Parent.** In call order, C_i's parent is the earlier call whose prompt is the longest *strict* token prefix
   of p_i, among calls whose ids come from the same source (captured vs retokenized). Among equally long ones:
   the one C_i actually continues (p_j ‖ a_j is a prefix of p_i) first, then the latest. Identical prompts
   (retries, n>1) are never parent and child, so siblings never fold into one chain (Polar caveat 2).
2. **Edge.** ``exact`` when p_j ‖ a_j is a prefix of p_i: the interstitial u_j is the rest of p_i, and the
   trace's context for a_i is exactly p_i, token for token. Otherwise the next prompt re-rendered a_j
   differently (thinking stripped, tool-call JSON re-serialised, BPE merges): **drift**. Under
   ``on_drift="split"`` (default) a drifted call starts a new trace, so the context of every trained token is
   the one it was sampled in (Polar caveat 1). Under ``"keep"`` it is merged the way Polar does — u_j starts
   after the first end-of-turn token of p_i's tail (at it, masked, when a_j did not end with it) — and the turn
   is listed in ``drift_turns``.
3. **Traces.** The parent links form a forest. Each call continues the trace of its parent when it is the
   parent's preferred child: an eligible edge (exact, or drift that ``keep`` can cut), then exact before drift,
   then the larger subtree (most calls to merge), then a complete exchange, then the earliest. Every other call
   starts a trace of its own with its whole prompt: nothing after a break is dropped (Polar caveat 3).
   Every start is counted by cause.

No end-of-turn token is needed for exact edges (the tail itself says where u begins); it only cuts drift
under ``keep`` (Polar caveat 4: it comes from the chat template or ``--eot-token``, see ``_retokenize``).
Interstitials are always loss-masked, ``<|im_start|>`` included (Polar caveat 5). Pure: no I/O.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Iterable

from reconstruct._calls import Call

__all__ = ["CAUSES", "Trace", "merge", "vote_eot"]

CAUSES = ("prompt_rewritten", "separate_agent", "sibling", "drift", "swallowed_text", "missing_ids", "incomplete")
"""Why a trace starts anywhere but at a session's first call: a prompt that extends no earlier one though the
agent (system prompt and tools) is the same — compaction or rewritten history; a different agent (sub-agent,
new chat); the continuation of the same prefix was taken by another call (retry, n>1, fork); the next prompt
re-rendered the sampled turn (under split, or when keep finds no end-of-turn to cut at); the same, where the
re-rendered turn is one whose text the upstream's tool-call parser kept from a streamed client (vLLM's empty
deltas, issue 15: the harness sent back what it saw, not what was sampled); the prefix call's ids
came from the other source (captured vs retokenized); an exchange that did not finish."""


@dataclasses.dataclass(slots=True)
class Edge:
    parent: int
    exact: bool  # p_parent ‖ a_parent is a prefix of the child's prompt
    tail: list[int]  # the child's prompt ids after p_parent
    cut: int | None  # where u_parent begins in ``tail``; None: drift with no end-of-turn to cut at


@dataclasses.dataclass(slots=True)
class Trace:
    calls: list[Call]
    prompt_ids: list[int]
    response_ids: list[int]  # a1 ‖ u1 ‖ … ‖ aK
    loss_mask: list[int]  # 1 on a, 0 on u
    logprobs: list[float] | None  # sampling log-probs on a, 0.0 on u; None when a call has none
    drift_turns: list[int]  # positions (in ``calls``) whose next prompt re-rendered them
    cause: str | None  # why this trace starts (None: the session's first call, or per-request mode)


def merge(
    calls: Iterable[Call], *, mode: str = "prefix", on_drift: str = "split", eot_id: int | None = None
) -> list[Trace]:
    """The traces of one session's usable calls, in order of their first call."""
    ordered = sorted((c for c in calls if c.usable), key=lambda c: c.order)
    if mode == "per-request":
        return [_assemble([c], [], None) for c in ordered]
    if mode != "prefix":
        raise ValueError(f"mode must be prefix or per-request, not {mode!r}")
    if on_drift not in ("split", "keep"):
        raise ValueError(f"on_drift must be split or keep, not {on_drift!r}")
    edges, root_causes = _link(ordered, eot_id)

    def eligible(i: int) -> bool:
        e = edges[i]
        return e is not None and (e.exact or (on_drift == "keep" and e.cut is not None))

    size = [1] * len(ordered)
    for i in reversed(range(len(ordered))):
        if (e := edges[i]) is not None:
            size[e.parent] += size[i]
    preferred: dict[int, int] = {}
    for i, e in enumerate(edges):
        if e is None or not eligible(i):
            continue
        best = preferred.get(e.parent)
        if best is None or _rank(i, edges, size, ordered) > _rank(best, edges, size, ordered):
            preferred[e.parent] = i
    continued = set(preferred.values())
    traces = []
    for i, e in enumerate(edges):
        if i in continued:
            continue
        chain = [i]
        while chain[-1] in preferred:
            chain.append(preferred[chain[-1]])
        if e is None:
            cause = root_causes[i]
        elif not eligible(i):
            cause = "swallowed_text" if ordered[e.parent].swallowed else "drift"
        else:
            cause = "sibling" if ordered[i].complete else "incomplete"
        traces.append(_assemble([ordered[k] for k in chain], [edges[k] for k in chain[1:]], cause))
    return traces


def _rank(i: int, edges: list[Edge | None], size: list[int], calls: list[Call]) -> tuple[bool, int, bool, int]:
    e = edges[i]
    return (e is not None and e.exact, size[i], calls[i].complete, -i)


def _link(calls: list[Call], eot_id: int | None) -> tuple[list[Edge | None], list[str | None]]:
    """Each call's edge to its parent (None for a root), and for roots the cause of their trace's start."""
    edges: list[Edge | None] = []
    causes: list[str | None] = []
    # Earlier calls, longest prompt first, then latest. Prompt *text* length orders them: among prefixes of one
    # prompt, more ids means more text, and the text's length costs nothing while the count of ids would.
    by_length: list[tuple[int, int]] = []  # (-len(prompt text), -index)
    for i, c in enumerate(calls):
        assert c.prompt is not None and c.output_ids is not None
        edge: Edge | None = None
        identical = other_source = False
        best = -1
        size = len(c.prompt.body)
        for neg_n, neg_j in by_length:
            n, j = -neg_n, -neg_j
            if n < best:
                break
            if n >= size:
                identical = identical or calls[j].prompt == c.prompt
                continue
            d = calls[j]
            assert d.prompt is not None and d.output_ids is not None
            if not d.prompt.is_prefix_of(c.prompt):
                continue
            if d.source != c.source:
                other_source = True
                continue
            tail = c.prompt.tail_after(d.prompt)
            a = d.output_ids
            exact = tail[: len(a)] == a
            if edge is None or (exact and not edge.exact):
                edge = Edge(j, exact, tail, len(a) if exact else _cut(tail, a, eot_id))
                best = n
            if exact:
                break
        edges.append(edge)
        if edge is not None or i == 0:
            causes.append(None)
        elif identical:
            causes.append("sibling")
        elif other_source:
            causes.append("missing_ids")
        else:
            same_agent = any(calls[j].agent_key() == c.agent_key() for j in range(i))  # computed only here
            causes.append("prompt_rewritten" if same_agent else "separate_agent")
        bisect.insort(by_length, (-size, -i))
    return edges, causes


def _cut(tail: list[int], sampled: list[int], eot_id: int | None) -> int | None:
    """Where the interstitial starts in a drifted tail: after the first end-of-turn token (the re-rendered turn's
    end), or at it when the sampled turn did not end with one (cut by max_tokens), so the turn is still closed."""
    if eot_id is None or eot_id not in tail:
        return None
    e = tail.index(eot_id)
    return e + 1 if sampled and sampled[-1] == eot_id else e


def _assemble(chain: list[Call], edges: list[Edge | None], cause: str | None) -> Trace:
    assert chain[0].prompt is not None
    with_logprobs = all(c.logprobs is not None for c in chain)
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    drift: list[int] = []
    for pos, c in enumerate(chain):
        a = c.output_ids or []
        response += a
        mask += [1] * len(a)
        if with_logprobs:
            logprobs += c.logprobs or []
        if pos + 1 < len(chain):
            e = edges[pos]
            assert e is not None and e.cut is not None
            u = e.tail[e.cut :]
            if not e.exact:
                drift.append(pos)
            response += u
            mask += [0] * len(u)
            if with_logprobs:
                logprobs += [0.0] * len(u)
    return Trace(chain, chain[0].prompt.ids(), response, mask, logprobs if with_logprobs else None, drift, cause)


def vote_eot(calls: Iterable[Call]) -> int | None:
    """Without a tokenizer or ``--eot-token``: the last sampled id of most naturally stopped calls, when more
    than half of them agree (a lone vote is not trusted: an engine that omits the stop token would win it)."""
    stopped = [
        c for c in calls if c.usable and c.complete and c.output_ids and c.finish_reason in ("stop", "tool_calls")
    ]
    last = collections.Counter(c.output_ids[-1] for c in stopped if c.output_ids)
    if not last:
        return None
    token, count = last.most_common(1)[0]
    return token if count * 2 > sum(last.values()) else None
