"""The wire formats of served teachers (hf_distill.serving.protocol): vLLM's prompt_logprobs, SGLang's native answer,
the package's own tail; malformed and short answers refused with what was wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hf_distill.serving.protocol import MalformedAnswer, log_tail, parse_scores, score_request


def _vllm(rows_positions, tails=None):
    choices = []
    for i, positions in enumerate(rows_positions):
        entries = [None] + [{str(t): {"logprob": v, "rank": r + 1, "decoded_token": "x"}
                             for r, (t, v) in enumerate(pos)} for pos in positions]
        choice = {"index": i, "text": "", "prompt_logprobs": entries}
        if tails is not None:
            choice["prompt_logprobs_tail"] = [None, *tails[i]]
        choices.append(choice)
    return {"choices": choices}


def test_vllm_answer_keeps_the_k_largest_and_the_tail_in_float64():
    # position 1: the prompt's own token (id 9) is outside the top 2, so vLLM sends 3 entries
    answer = _vllm([[[(4, math.log(0.5)), (7, math.log(0.3)), (9, math.log(0.01))]]])
    (scores,) = parse_scores(answer, "vllm", [[1, 9]], k=2)
    assert scores.ids.tolist() == [[4, 7]] and scores.log_probs.dtype == np.float64
    assert scores.log_tail[0] == pytest.approx(math.log(0.2), rel=1e-12)  # log(1 - 0.8), not from the 3rd entry


def test_the_servers_own_tail_is_taken_when_sent():
    answer = _vllm([[[(4, math.log(0.5)), (7, math.log(0.3))]]], tails=[[-3.0]])
    (scores,) = parse_scores(answer, "hf_distill", [[1, 9]], k=2)
    assert scores.log_tail.tolist() == [-3.0]


def test_sglang_native_answer():
    answer = {"text": "", "meta_info": {"input_top_logprobs": [None, [[-0.1, 5, "a"], [-2.5, 6, None]],
                                                               [[-0.2, 3, None], [-1.9, 2, None]]]}}
    (scores,) = parse_scores([answer], "sglang", [[1, 5, 3]], k=2)
    assert scores.ids.tolist() == [[5, 6], [3, 2]] and scores.positions == 2
    path, body = score_request("sglang", None, [[1, 5, 3]], 2)
    assert path == "/generate" and body["logprob_start_len"] == 0 and body["top_logprobs_num"] == 2


@pytest.mark.parametrize("what, answer, rows, words", [
    ("short", _vllm([[[(4, -0.1)]]]), [[1, 9]], "1 log-probabilities, 2 asked (short answer)"),
    ("positions", _vllm([[[(4, -0.1), (5, -3.0)]]]), [[1, 9, 9]], "3 tokens but the answer holds 2 positions"),
    ("rows", _vllm([]), [[1, 9]], "0 choices for 1 rows"),
    ("mass", _vllm([[[(4, -0.1), (5, -0.2)]]]), [[1, 9]], "sum to"),
    ("vocabulary", _vllm([[[(4, -0.1), (500, -3.0)]]]), [[1, 9]], "outside the vocabulary"),
    ("positive", _vllm([[[(4, 0.5), (5, -3.0)]]]), [[1, 9]], "must be <= 0"),
    ("not a list", {"choices": [{"index": 0}]}, [[1, 9]], "without a prompt_logprobs list"),
])
def test_malformed_or_short_answers_are_refused_naming_what_was_wrong(what, answer, rows, words):
    with pytest.raises(MalformedAnswer, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_scores(answer, "vllm", rows, k=2, vocab_size=128)


def test_log_tail_is_minus_inf_when_the_top_k_hold_everything():
    assert log_tail(np.log(np.array([0.25, 0.75]))) == -math.inf
    assert log_tail(np.log(np.array([0.5]))) == pytest.approx(math.log(0.5))


def test_our_compact_arrays_round_trip_and_a_short_one_is_refused():
    from hf_distill.serving.protocol import encode_arrays

    lp = np.log(np.array([[0.5, 0.25], [0.6, 0.3]]))
    ids, tail = np.array([[3, 4], [5, 6]]), np.log(np.array([0.25, 0.1]))
    answer = {"choices": [{"index": 0, "hf_distill_arrays": encode_arrays(lp, ids, tail)}]}
    (scores,) = parse_scores(answer, "hf_distill", [[1, 2, 3]], k=2)
    assert scores.ids.tolist() == ids.tolist() and np.allclose(scores.log_tail, tail, atol=1e-7)
    with pytest.raises(MalformedAnswer, match=r"arrays for \(positions, k\) = \(2, 2\), \(3, 2\) asked"):
        parse_scores(answer, "hf_distill", [[1, 2, 3, 4]], k=2)
