"""megatron_ext.eval.answer_scores gives the numbers the metrics' own libraries publish for their examples,
and the CIDEr-D value its definition gives on a fixture small enough to work out by hand."""

from __future__ import annotations

import pytest

from megatron_ext.eval import answer_scores


def test_bleu_matches_sacrebleus_documented_example():
    # sacrebleu's README: two reference streams for three hypotheses -> "BLEU = 48.53".
    streams = [["The dog bit the man.", "It was not unexpected.", "The man bit him first."],
               ["The dog had bit the man.", "No one was surprised.", "The man had bitten the dog."]]
    hypotheses = ["The dog bit the man.", "It wasn't surprising.", "The man had just bitten him."]
    references = [list(per_sample) for per_sample in zip(*streams)]
    assert answer_scores.bleu(hypotheses, references) == pytest.approx(48.530827, abs=1e-6)


def test_rouge_l_matches_rouge_scores_documented_example():
    # rouge-score's README: rougeL of this pair has precision 0.625, recall 0.5556, F 0.5882 (LCS 5 of 8 / 9 words).
    score = answer_scores.rouge_l(["The quick brown dog jumps on the log."], [["The quick brown fox jumps over the lazy dog"]])
    assert score == pytest.approx(2 * (5 / 8) * (5 / 9) / (5 / 8 + 5 / 9))
    # Several references: the best one counts; samples are averaged.
    assert answer_scores.rouge_l(["a b", "c d"], [["x y", "a b"], ["c z"]]) == pytest.approx((1.0 + 0.5) / 2)


def test_cider_d_matches_its_definition_worked_by_hand():
    # Two images with disjoint words: each n-gram's idf is log(2). Image 0's answer shares 3/4 unigrams,
    # 2/3 bigrams, 1/2 trigrams and no 4-gram with its reference (same length: no length penalty);
    # image 1's answer shares nothing. CIDEr-D = 10 x mean over n of the cosines, averaged over images.
    score = answer_scores.cider(["a red circle right", "one green line"], [["a red circle left"], ["two blue squares"]])
    assert score == pytest.approx(10 * (3 / 4 + 2 / 3 + 1 / 2 + 0) / 4 / 2)
    # Identical after lower-casing and 13a tokenization: the maximum, 10 per image.
    assert answer_scores.cider(["A red circle left.", "Two BLUE squares."],
                         [["a red circle left."], ["two blue squares."]]) == pytest.approx(10.0)


def test_exact_match_ignores_case_spacing_and_final_punctuation():
    predictions = ["A  Cat.", "dog", "The answer is 42!"]
    references = [["a cat"], ["a dog", "cat"], ["the answer is 42"]]
    assert answer_scores.exact_match(predictions, references) == pytest.approx(2 / 3)


def test_score_all_and_mismatched_inputs():
    scores = answer_scores.score_all(["a red circle left"] * 2, [["a red circle left"], ["a red circle left"]])
    assert scores["exact_match"] == 1.0 and scores["bleu"] == pytest.approx(100.0) and scores["rouge_l"] == 1.0
    with pytest.raises(ValueError, match="2 predictions for 1 reference sets"):
        answer_scores.bleu(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="at least one reference"):
        answer_scores.rouge_l(["a"], [[]])
