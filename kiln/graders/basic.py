"""The graders that compare two rendered strings: `string_check` and `text_similarity`.

The similarity metrics come from maintained libraries, not from code of ours: rapidfuzz
(fuzzy_match), NLTK (bleu, gleu, meteor) and Google's rouge-score (rouge_1 ... rouge_l).
Choices where OpenAI does not document its own:
- fuzzy_match is rapidfuzz's `fuzz.ratio` (normalised Indel similarity) / 100;
- bleu, gleu and meteor see words from NLTK's `wordpunct_tokenize` (a regex: no data files);
- bleu is NLTK's sentence BLEU (4-grams) with smoothing method 1, so a short answer that
  shares no 4-gram with the reference still scores by its shorter n-grams instead of ~0;
- rouge_* is the F-measure, with rouge-score's own tokenizer and no stemming;
- meteor: see `_meteor`;
- cosine needs an embeddings model, which Kiln does not serve: it is refused at validation.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, ClassVar

from kiln.graders import templates
from kiln.graders.base import Fields, Grader, Judge
from kiln.graders.result import GradeResult

OPERATIONS = ("eq", "ne", "like", "ilike")
ROUGE = {"rouge_1": "rouge1", "rouge_2": "rouge2", "rouge_3": "rouge3", "rouge_4": "rouge4", "rouge_5": "rouge5",
         "rouge_l": "rougeL"}
METRICS = ("fuzzy_match", "bleu", "gleu", "meteor", *ROUGE)
UNSUPPORTED_METRICS = {"cosine": "needs an embeddings model, which Kiln does not serve: it is not supported locally"}


@dataclasses.dataclass(kw_only=True)
class _ComparingGrader(Grader):
    """Renders `input` and `reference` for a sample and scores the two texts."""

    input: str
    reference: str

    def _grade(self, sample: dict, item: Any, judge: Judge | None) -> GradeResult:
        text = templates.render(self.input, sample, item)
        return GradeResult(self._score(text, templates.render(self.reference, sample, item)))

    def _score(self, text: str, reference: str) -> float:
        raise NotImplementedError


@dataclasses.dataclass(kw_only=True)
class StringCheckGrader(_ComparingGrader):
    """1.0 when the check holds, else 0.0: eq / ne compare exactly; like is a case-sensitive
    "input contains reference", ilike the same ignoring case."""

    type: ClassVar[str] = "string_check"
    operation: str

    @classmethod
    def from_json(cls, f: Fields) -> StringCheckGrader:
        return cls(name=f.text("name"), input=f.text("input", template=True),
                   reference=f.text("reference", template=True), operation=f.choice("operation", OPERATIONS))

    def _score(self, text: str, reference: str) -> float:
        return 1.0 if string_check(text, reference, self.operation) else 0.0


def string_check(text: str, reference: str, operation: str) -> bool:
    if operation == "eq":
        return text == reference
    if operation == "ne":
        return text != reference
    if operation == "like":
        return reference in text
    if operation == "ilike":
        return reference.casefold() in text.casefold()
    raise ValueError(f"unknown string_check operation {operation!r}")


@dataclasses.dataclass(kw_only=True)
class TextSimilarityGrader(_ComparingGrader):
    """A similarity in [0, 1] between the rendered input and reference. Evals pass a sample
    when the score reaches `pass_threshold` (see `Grader.passed`)."""

    type: ClassVar[str] = "text_similarity"
    evaluation_metric: str

    @classmethod
    def from_json(cls, f: Fields) -> TextSimilarityGrader:
        metric = f.get("evaluation_metric")
        if metric in UNSUPPORTED_METRICS:
            raise f.bad("evaluation_metric", f"{metric!r} {UNSUPPORTED_METRICS[metric]}")
        return cls(name=f.text("name"), input=f.text("input", template=True),
                   reference=f.text("reference", template=True), evaluation_metric=f.choice("evaluation_metric",
                                                                                            METRICS))

    def _score(self, text: str, reference: str) -> float:
        return similarity(text, reference, self.evaluation_metric)


def similarity(text: str, reference: str, metric: str) -> float:
    """`text` scored against `reference` by one of METRICS, in [0, 1]."""
    if metric == "fuzzy_match":
        from rapidfuzz import fuzz

        return fuzz.ratio(text, reference) / 100.0
    if metric in ROUGE:
        return _rouge_scorer().score(reference, text)[ROUGE[metric]].fmeasure
    from nltk.tokenize import wordpunct_tokenize

    hyp, ref = wordpunct_tokenize(text), wordpunct_tokenize(reference)
    if not hyp or not ref:
        return 0.0
    if metric == "bleu":
        from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

        with warnings.catch_warnings():  # NLTK warns about missing n-gram orders; smoothing handles them
            warnings.simplefilter("ignore")
            return float(sentence_bleu([ref], hyp, smoothing_function=SmoothingFunction().method1))
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu

        return float(sentence_gleu([ref], hyp))
    if metric == "meteor":
        return _meteor(ref, hyp)
    raise ValueError(f"unknown evaluation_metric {metric!r}")


@functools.cache
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(ROUGE.values()), use_stemmer=False)


class _NoSynonyms:
    """Stands in for NLTK's WordNet reader: no word has a synonym."""

    def synsets(self, word: str, *args, **kwargs) -> list:
        return []


def _meteor(ref: list[str], hyp: list[str]) -> float:
    """NLTK's METEOR with its exact and Porter-stem matching stages only.

    Full METEOR also matches WordNet synonyms, but NLTK reads WordNet from a corpus that is
    downloaded at run time, which this deployment cannot do, and no maintained PyPI package
    ships it. So the synonym stage is switched off (a reader with no synonyms is passed as
    `wordnet`), which keeps the score the same on every machine. It can be lower than
    OpenAI's when the output paraphrases with synonyms; exact and stemmed matches
    ("running"/"run") score as in full METEOR."""
    from nltk.translate.meteor_score import meteor_score

    return float(meteor_score([ref], hyp, wordnet=_NoSynonyms()))
