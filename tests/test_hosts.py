"""The rewards split over processes and the agreement checks, with the other processes faked
(tests/test_pod.py runs four real ones)."""

import json

import numpy as np
import pytest

from dapo_jax import hosts


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_each_row_is_scored_by_exactly_one_process(n):
    for rows in range(12):
        shares = [hosts.rows_of(rows, p, n) for p in range(n)]
        expected = np.array_split(np.arange(rows), n)  # an independent split
        assert [list(range(rows)[s]) for s in shares] == [list(e) for e in expected]


class _Scorer:
    """A reward per row that depends on the text alone (every process computes the same), and
    one error counted per response holding "!"."""

    def __init__(self):
        self.calls = []

    def score_batch(self, responses, truths, contexts=None):
        self.calls.append(list(responses))
        results = [
            {"score": float(len(r)), "acc": r == t, "pred": r[::-1]} for r, t in zip(responses, truths)
        ]
        return results, {"n_error": sum("!" in r for r in responses), "n_timeout": 0}

    def close(self):
        pass


def test_a_split_scorer_scores_its_share_and_returns_everyone_s(monkeypatch):
    n, me = 3, 1
    responses = ["a", "bb!", "c", "dd", "e!", "f", "g"]
    truths = ["a", "x", "c", "dd", "y", "z", "g"]
    monkeypatch.setattr(hosts.jax, "process_count", lambda: n)
    monkeypatch.setattr(hosts.jax, "process_index", lambda: me)

    def allgather(own):  # the other processes score their own rows, as they would
        shares = [hosts.rows_of(len(responses), p, n) for p in range(n)]
        others = [_Scorer().score_batch(responses[s], truths[s]) for s in shares]
        others[me] = own
        return json.loads(json.dumps(others))

    monkeypatch.setattr(hosts, "allgather_json", allgather)
    scorer = _Scorer()
    split = hosts.SplitScorer(scorer)
    results, stats = split.score_batch(responses, truths)
    assert scorer.calls == [["dd", "e!"]]  # rows 3, 4 of 7: process 1's share
    assert results == _Scorer().score_batch(responses, truths)[0]
    assert stats == {"n_error": 2, "n_timeout": 0} and split.totals == stats


def test_one_process_scores_everything_itself():
    scorer = _Scorer()
    results, _ = hosts.SplitScorer(scorer).score_batch(["a", "b"], ["a", "c"])
    assert scorer.calls == [["a", "b"]] and [r["acc"] for r in results] == [True, False]


def test_allgather_json_pads_and_cuts_each_payload(monkeypatch):
    other = {"x": [1, 2, 3], "pred": "ünïcode"}
    other_bytes = np.frombuffer(json.dumps(other).encode(), np.uint8)

    def process_allgather(x):
        x = np.asarray(x)
        if x.ndim == 0:  # the lengths
            return np.array([int(x), other_bytes.size])
        padded = np.zeros_like(x)
        padded[: other_bytes.size] = other_bytes
        return np.stack([x, padded])

    monkeypatch.setattr(hosts.multihost_utils, "process_allgather", process_allgather)
    monkeypatch.setattr(hosts.jax, "process_count", lambda: 2)
    assert hosts.allgather_json("me") == ["me", other]


def _gathered(monkeypatch, rows):
    monkeypatch.setattr(hosts.jax, "process_count", lambda: len(rows))
    monkeypatch.setattr(hosts.multihost_utils, "process_allgather", lambda mine: np.stack(rows))


def test_processes_that_agree_pass(monkeypatch):
    values = {"kept groups": np.array([True, False]), "count": np.int64(2)}
    mine = np.array([hosts.digest(v) for v in values.values()], np.int32)
    _gathered(monkeypatch, [mine] * 4)
    hosts.check_agreed("step 1", values)


def test_a_disagreeing_process_is_named_in_one_line(monkeypatch):
    values = {"rewards": np.array([1.0, -1.0]), "kept groups": np.array([True, False])}
    mine = np.array([hosts.digest(v) for v in values.values()], np.int32)
    odd = np.array([mine[0] + 1, mine[1]], np.int32)
    _gathered(monkeypatch, [mine, mine, mine, odd])
    with pytest.raises(hosts.HostDisagreement) as e:
        hosts.check_agreed("step 3, generation batch 2", values)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(
        "step 3, generation batch 2: the processes disagree on the rewards (processes 3 differ)"
    )
    _gathered(monkeypatch, [odd, mine, mine, mine])  # the odd one out may be process 0
    with pytest.raises(hosts.HostDisagreement, match=r"rewards \(processes 0 differ\)"):
        hosts.check_agreed("here", values)


def test_digests_see_dtype_shape_and_values():
    a = np.array([1, 0], np.int32)
    assert hosts.digest(a) == hosts.digest(a.copy())
    assert (
        len({hosts.digest(a), hosts.digest(a.astype(np.int64)), hosts.digest(a[:1]), hosts.digest(a[::-1])})
        == 4
    )
