"""reconstruct/_merge.py: every captured scenario merged as expected, each trace faithful to what was sampled;
then the algorithm's corner cases (siblings, forks, drift without an end-of-turn, mixed sources) on small calls."""

import pytest
from transformers import AutoTokenizer

from reconstruct._calls import Call, Request
from reconstruct._extract import extract
from reconstruct._merge import merge, vote_eot
from reconstruct._retokenize import Retokenizer
from reconstruct._tokens import TokenText
from tests.reconstruct.conftest import EXPECTED_CALLS, S, oracle

EOT = 2  # <|im_end|> in the tiny tokenizer

# Per scenario: (calls, cause) of each trace, under the default split; the keep ones where they differ.
EXPECTED = {
    S.streamed: [(3, None)],
    S.non_streamed: [(3, None)],
    S.subagents: [(2, None), (3, "separate_agent")],
    S.compaction: [(3, None), (2, "prompt_rewritten")],
    S.retry: [(1, None), (2, "sibling")],
    S.no_reasoning: [(1, None), (1, "drift"), (1, "drift")],
    S.max_tokens: [(3, None)],
    S.plain_streamed: [(3, None)],
    S.plain_non_streamed: [(3, None)],
}
EXPECTED_KEEP = {**EXPECTED, S.no_reasoning: [(3, None)]}


@pytest.fixture(scope="module")
def tokenizer(captures):
    return AutoTokenizer.from_pretrained(captures.model_dir)


@pytest.fixture(scope="module")
def session_calls(captures, tokenizer):
    retokenizer = Retokenizer(tokenizer)
    assert retokenizer.eot_id == EOT
    return {s: [c for r in captures.records(s) for c in extract(r, retokenizer)] for s in EXPECTED_CALLS}


def assert_faithful(traces, records):
    """The trainable tokens of each trace, in order, are exactly the ids the upstream sampled, with exactly its
    log-probs; each call's context in the trace is its real prompt (except turns flagged as drift); no call of
    the session is missing."""
    by_id = {r["id"]: r for r in records}
    for t in traces:
        assert len(t.response_ids) == len(t.loss_mask)
        sampled = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
        want_ids, want_logprobs, offset = [], [], 0
        for k, call in enumerate(t.calls):
            prompt, ids, logprobs = oracle(by_id[call.exchange_id])
            if k == 0:
                assert t.prompt_ids == prompt
            else:
                offset = t.loss_mask.index(1, offset + len(t.calls[k - 1].output_ids))  # where a_k starts
                context = t.prompt_ids + t.response_ids[:offset]
                assert (context == prompt) is (k - 1 not in t.drift_turns)
            assert t.response_ids[offset : offset + len(ids)] == ids
            want_ids += ids
            want_logprobs += logprobs
        assert sampled == want_ids
        if t.logprobs is not None:
            assert len(t.logprobs) == len(t.response_ids)
            assert [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m] == want_logprobs
            assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if not m)
    merged = sorted(c.exchange_id for t in traces for c in t.calls)
    assert merged == sorted(by_id)


@pytest.mark.slow
@pytest.mark.parametrize("on_drift", ["split", "keep"])
@pytest.mark.parametrize("session", [s for s in EXPECTED if not s.startswith("plain")])
def test_captured_scenarios(session, on_drift, captures, session_calls):
    traces = merge(session_calls[session], on_drift=on_drift, eot_id=EOT)
    expected = (EXPECTED if on_drift == "split" else EXPECTED_KEEP)[session]
    assert [(len(t.calls), t.cause) for t in traces] == expected
    assert_faithful(traces, captures.records(session))
    assert all(t.logprobs is not None and {c.source for c in t.calls} == {"captured"} for t in traces)
    drift = [t.drift_turns for t in traces]
    assert drift == ([[0, 1]] if (session, on_drift) == (S.no_reasoning, "keep") else [[]] * len(traces))


@pytest.mark.slow
def test_per_request_is_one_faithful_trace_per_call(captures, session_calls):
    for session in (S.subagents, S.retry, S.max_tokens):
        traces = merge(session_calls[session], mode="per-request")
        assert [len(t.calls) for t in traces] == [1] * EXPECTED_CALLS[session]
        assert all(t.cause is None and set(t.loss_mask) == {1} for t in traces)
        assert_faithful(traces, captures.records(session))


@pytest.mark.slow
def test_max_tokens_turn_is_kept_unclosed_and_its_closing_masked(captures, session_calls):
    (trace,) = merge(session_calls[S.max_tokens])
    first = trace.calls[0]
    assert first.finish_reason == "length" and len(first.output_ids) == 6 and EOT not in first.output_ids
    # The template closed the cut turn itself: that end-of-turn is in the interstitial, loss-masked.
    u = trace.response_ids[6 : trace.loss_mask.index(1, 6)]
    assert EOT in u and all(m == 0 for m in trace.loss_mask[6 : 6 + len(u)])


@pytest.mark.slow
def test_plain_sessions_retokenize_to_the_captured_tokens(session_calls):
    for plain, captured in ((S.plain_streamed, S.streamed), (S.plain_non_streamed, S.non_streamed)):
        (p,), (c,) = merge(session_calls[plain]), merge(session_calls[captured])
        assert {x.source for x in p.calls} == {"retokenized"} and p.logprobs is None
        assert (p.prompt_ids, p.response_ids, p.loss_mask) == (c.prompt_ids, c.response_ids, c.loss_mask)


# ---- corner cases on small calls: prompts and samples as token lists


def call(n, prompt, out, *, source="captured", complete=True, finish="stop", agent="A", logprobs=True):
    return Call(
        exchange_id=f"c{n}",
        session_id="s",
        order=(float(n), f"c{n}", 0),
        api="chat",
        request=Request.known("m", [], None),
        prompt=TokenText.from_ids(prompt),
        output_ids=out,
        logprobs=[-0.5] * len(out) if logprobs else None,
        finish_reason=finish,
        complete=complete,
        source=source,
        completion=None,
        agent=agent,
    )


def shape(traces):
    return [([c.exchange_id for c in t.calls], t.cause) for t in traces]


P = [10, 11, 12]


def test_identical_prompts_are_siblings_and_the_continued_one_keeps_the_chain():
    c0, c1 = call(0, P, [20, EOT]), call(1, P, [21, EOT])
    continues_second = call(2, [*P, 21, EOT, 30, 31], [22, EOT])
    assert shape(merge([c0, c1, continues_second])) == [(["c0"], None), (["c1", "c2"], "sibling")]
    continues_first = call(2, [*P, 20, EOT, 30, 31], [22, EOT])
    assert shape(merge([c0, c1, continues_first])) == [(["c0", "c2"], None), (["c1"], "sibling")]


def test_a_fork_continues_along_the_larger_subtree_and_the_rest_is_emitted():
    c0 = call(0, P, [20, EOT])
    c1 = call(1, [*P, 20, EOT, 30], [21, EOT])  # abandoned branch
    c2 = call(2, [*P, 20, EOT, 30], [22, EOT])  # the branch the agent went on with
    c3 = call(3, [*P, 20, EOT, 30, 22, EOT, 31], [23, EOT])
    traces = merge([c3, c1, c0, c2])  # input order does not matter: calls are ordered by start
    assert shape(traces) == [(["c0", "c2", "c3"], None), (["c1"], "sibling")]
    assert traces[0].response_ids == [20, EOT, 30, 22, EOT, 31, 23, EOT]
    assert traces[0].loss_mask == [1, 1, 0, 1, 1, 0, 1, 1]
    assert traces[0].logprobs == [-0.5, -0.5, 0.0, -0.5, -0.5, 0.0, -0.5, -0.5]
    assert traces[1].prompt_ids == c1.prompt.ids()  # the break keeps its whole context: nothing dropped


def test_drift_is_split_by_default_kept_when_asked_and_split_without_an_end_of_turn():
    c0 = call(0, P, [40, 41, 20, EOT])  # sampled "<think>…</think> answer"
    c1 = call(1, [*P, 20, EOT, 30], [21, EOT])  # the next prompt re-rendered it without the thinking
    assert shape(merge([c0, c1])) == [(["c0"], None), (["c1"], "drift")]
    (kept,) = merge([c0, c1], on_drift="keep", eot_id=EOT)
    assert kept.drift_turns == [0] and kept.response_ids == [40, 41, 20, EOT, 30, 21, EOT]
    assert shape(merge([c0, c1], on_drift="keep", eot_id=None)) == [(["c0"], None), (["c1"], "drift")]
    cut = call(0, P, [40, 41], finish="length")  # no end-of-turn sampled: the template's is masked
    (kept,) = merge([cut, call(1, [*P, 20, EOT, 30], [21, EOT])], on_drift="keep", eot_id=EOT)
    assert kept.response_ids == [40, 41, EOT, 30, 21, EOT] and kept.loss_mask == [1, 1, 0, 0, 1, 1]


def test_causes_of_roots_and_of_incomplete_or_mixed_calls():
    first = call(0, P, [20, EOT])
    sub = call(1, [99, 11], [20, EOT], agent="B")
    rewritten = call(2, [10, 77], [20, EOT])
    assert [t.cause for t in merge([first, sub, rewritten])] == [None, "separate_agent", "prompt_rewritten"]
    torn = call(1, [*P, 20, EOT, 30], [21], complete=False, finish=None)
    retried = call(2, [*P, 20, EOT, 30], [21, EOT])
    assert shape(merge([first, torn, retried])) == [(["c0", "c2"], None), (["c1"], "incomplete")]
    rebuilt = call(1, [*P, 20, EOT, 30], [21, EOT], source="retokenized", logprobs=False)
    traces = merge([first, rebuilt])
    assert shape(traces) == [(["c0"], None), (["c1"], "missing_ids")] and traces[1].logprobs is None
    # A call after one whose ids were lost still chains to the last captured prefix: the lost turn is masked.
    after = call(2, [*P, 20, EOT, 30, 21, EOT, 31], [22, EOT])
    assert shape(merge([first, rebuilt, after])) == [(["c0", "c2"], None), (["c1"], "missing_ids")]


def test_unusable_calls_and_bad_options():
    broken = call(1, P, [20])
    broken.problem = "error"
    assert shape(merge([call(0, P, [20, EOT]), broken])) == [(["c0"], None)]
    with pytest.raises(ValueError, match="mode"):
        merge([], mode="tree")
    with pytest.raises(ValueError, match="on_drift"):
        merge([], on_drift="maybe")


def test_vote_eot_needs_a_majority():
    stops = [call(i, P, [20 + i, EOT]) for i in range(3)]
    assert vote_eot(stops) == EOT
    assert vote_eot([call(i, P, [20 + i]) for i in range(3)]) is None  # engine left the stop token out
    assert vote_eot([call(0, P, [20], finish="length")]) is None
