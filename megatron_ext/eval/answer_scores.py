"""Scores of generated answers against references, computed by the metrics' reference libraries.

- BLEU: sacrebleu's corpus BLEU (its default 13a tokenization), 0-100.
- ROUGE-L: rouge-score's `rougeL` F-measure, best over a sample's references, averaged, 0-1.
- CIDEr: pycocoevalcap's CIDEr-D (the COCO caption evaluation code, n-grams 1-4, sigma 6), on
  text lower-cased and split with sacrebleu's 13a tokenizer (COCO's own PTB tokenizer needs Java).
  Its idf comes from the references of the evaluated samples, so it needs several samples to mean
  anything (one sample always scores 0).
- exact match: the share of answers equal to one of their references after lower-casing,
  collapsing whitespace and dropping final punctuation (a string comparison, no library needed).

Every function takes `predictions` [N] and `references` [N][k]: k >= 1 references per sample.
"""

from __future__ import annotations

from itertools import zip_longest

_FINAL_PUNCTUATION = ".!?。！？"


def _normalize(text: str) -> str:
    return " ".join(text.casefold().split()).rstrip(_FINAL_PUNCTUATION).strip()


def _check(predictions: list[str], references: list[list[str]]) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference sets")
    if any(not refs for refs in references):
        raise ValueError("every sample needs at least one reference")


def exact_match(predictions: list[str], references: list[list[str]]) -> float:
    _check(predictions, references)
    hits = [any(_normalize(p) == _normalize(r) for r in refs) for p, refs in zip(predictions, references)]
    return sum(hits) / len(hits) if hits else 0.0


def bleu(predictions: list[str], references: list[list[str]]) -> float:
    import sacrebleu

    _check(predictions, references)
    # sacrebleu takes one stream per reference index; None marks a sample with fewer references.
    streams = [list(stream) for stream in zip_longest(*references, fillvalue=None)]
    return float(sacrebleu.corpus_bleu(predictions, streams).score)


def rouge_l(predictions: list[str], references: list[list[str]]) -> float:
    from rouge_score import rouge_scorer

    _check(predictions, references)
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    scores = [scorer.score_multi(refs, p)["rougeL"].fmeasure for p, refs in zip(predictions, references)]
    return sum(scores) / len(scores) if scores else 0.0


def cider(predictions: list[str], references: list[list[str]]) -> float:
    from pycocoevalcap.cider.cider import Cider
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    _check(predictions, references)
    if not predictions:
        return 0.0
    tokenize = Tokenizer13a()

    def words(text: str) -> str:
        return tokenize(text.casefold())

    gts = {i: [words(r) for r in refs] for i, refs in enumerate(references)}
    res = {i: [words(p)] for i, p in enumerate(predictions)}
    score, _ = Cider().compute_score(gts, res)
    return float(score)


METRICS = {"exact_match": exact_match, "bleu": bleu, "rouge_l": rouge_l, "cider": cider}


def score_all(predictions: list[str], references: list[list[str]]) -> dict[str, float]:
    return {name: metric(predictions, references) for name, metric in METRICS.items()}
