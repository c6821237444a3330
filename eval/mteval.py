"""BLEU and NIST as the official Perl scripts compute them.

Two ports:

- :func:`mteval_e2e`: ``mteval-v13a-sig.pl`` as run by the E2E challenge's
  ``measure_scores.py`` (tuetschek/e2e-metrics): mteval-13a tokenisation of
  Unicode text with ASCII-only lowercasing (``tr/[A-Z]/[a-z]/``), corpus BLEU-4
  with the closest reference length (ties to the shorter, empty references
  skipped) and mteval's smoothing (a zero match count counts as 1/2^k), and
  NIST-5 with information weights from all reference n-grams of the corpus and
  the length penalty on ``hyp_words / (ref_words / mean non-empty refs per segment)``.
  The 13a tokenizer is sacrebleu's (:class:`sacrebleu.tokenizers.tokenizer_13a.Tokenizer13a`).
- :func:`multi_bleu_detok`: Moses ``multi-bleu-detok.perl`` as run by WebNLG's
  GenerationEval: the same tokenisation in Perl's byte mode (only ASCII
  whitespace separates words), case-sensitive, closest reference length with
  empty references counting as length 0, no smoothing, scale 0-100.

Quirks kept on purpose (they change official numbers): mteval's closest-length
update ignores a zero-length reference only after the first one, and an n-gram
whose prefix is the word ``0`` gets its NIST information from the unigram total
(Perl treats the string ``"0"`` as false).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache
from itertools import chain

from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

__all__ = [
    "tokenize_e2e",
    "tokenize_bytes_mode",
    "mteval_e2e",
    "multi_bleu_detok",
    "multi_bleu_detok_line",
    "MtevalResult",
]

_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_TOK13A = Tokenizer13a()
_NIST_BETA = -math.log(0.5) / math.log(1.5) / math.log(1.5)

# mteval-13a rules (identical to sacrebleu's TokenizerRegexp), for byte-mode text.
_RULES_13A = [
    (re.compile(r"([\{-\~\[-\` -\&\(-\+\:-\@\/])"), r" \1 "),
    (re.compile(r"([^0-9])([\.,])"), r"\1 \2 "),
    (re.compile(r"([\.,])([^0-9])"), r" \1 \2"),
    (re.compile(r"([0-9])(-)"), r"\1 \2 "),
]
_ASCII_WS = re.compile(r"[ \t\n\r\f\v]+")


# the first 13a rule puts spaces around single characters: a translation table does the same
_RULE1_13A = str.maketrans({c: f" {c} " for c in map(chr, range(128)) if _RULES_13A[0][0].fullmatch(c)})


def _tokenize_13a(line: str, lower: bool = False) -> list[str]:
    """sacrebleu's ``Tokenizer13a()(line).split()``, its first rule by ``str.translate``;
    ``lower``: ASCII-lowercased where mteval-v13a's ``tokenization`` does it (without ``-c``),
    after the entities are decoded (``&QUOT;`` stays as it is, then reads ``&quot;``)."""
    line = line.replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
    if "&" in line:
        line = line.replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    if lower:
        line = line.translate(_ASCII_LOWER)
    line = f" {line} ".translate(_RULE1_13A)
    for pattern, repl in _RULES_13A[1:]:
        line = pattern.sub(repl, line)
    return line.split()


def tokenize_e2e(text: str) -> list[str]:
    """mteval-v13a tokens of ``text`` as the E2E scorer sees them (ASCII-lowercased after the
    entities are decoded, in mteval's order: sacrebleu's ``lowercase=True`` lowercases first, so
    it reads ``&QUOT;`` as a quote where mteval keeps ``& quot ;``)."""
    return _tokenize_13a(text, lower=True)


@lru_cache(maxsize=2**16)
def tokenize_bytes_mode(text: str) -> tuple[str, ...]:
    """mteval-13a tokens, case kept, with Perl byte-mode whitespace (ASCII only)."""
    text = text.replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
    if "&" in text:
        text = text.replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    text = f" {text} "
    for pattern, repl in _RULES_13A:
        text = pattern.sub(repl, text)
    return tuple(w for w in _ASCII_WS.split(text) if w)


def _ngram_list(words: Sequence[str], max_n: int) -> list[tuple]:
    """All n-grams (as word tuples) for n = 1..max_n, unigrams first, each order in text order."""
    return list(chain.from_iterable(zip(*(words[i:] for i in range(n))) for n in range(1, min(max_n, len(words)) + 1)))


def _ngrams(words: Sequence[str], max_n: int) -> Counter:
    """Counts of all n-grams (as word tuples) for n = 1..max_n."""
    return Counter(_ngram_list(words, max_n))


class MtevalResult:
    """Corpus BLEU and NIST plus mteval's segment-level scores."""

    def __init__(self, bleu: float, nist: float, seg_bleu: list[float], seg_nist: list[float]):
        self.bleu, self.nist, self.seg_bleu, self.seg_nist = bleu, nist, seg_bleu, seg_nist


def _closest(current: int, ref_len: int, tst_len: int) -> int:
    """mteval ``brevity_penalty_closest`` (the -sig variant skips zero-length references)."""
    if not ref_len:
        return current
    d_ref, d_cur = abs(tst_len - ref_len), abs(tst_len - current)
    if d_ref < d_cur or (d_ref == d_cur and current > ref_len):
        return ref_len
    return current


class _NgramInfo(dict):
    """NIST information weight of reference n-grams (n <= 5) of the corpus, computed
    when first looked up (only the matched n-grams of the hypotheses are).

    Args:
        counts: the count of every n-gram over all references of the corpus.
        total_words: the number of reference words of the corpus.
    """

    def __init__(self, counts: Counter, total_words: int):
        super().__init__()
        self._counts, self._total = counts, total_words

    def __missing__(self, gram: tuple) -> float:
        prefix = gram[:-1]
        # Perl: `$mgram ? count/count(mgram) : count/tot_wrds`; "0" is false in Perl.
        denom = self._counts[prefix] if prefix and prefix != ("0",) else self._total
        value = self[gram] = -math.log(self._counts[gram] / denom) / math.log(2)
        return value


def _bleu_smoothed(ref_len: float, match: Sequence[float], tst: Sequence[float]) -> float:
    """mteval ``bleu_score`` (default smoothing), 4-grams; lists indexed 1..4."""
    exp_len = math.exp(min(0.0, 1 - ref_len / tst[1])) if tst[1] > 0 else 0.0
    smooth, score = 1, 0.0
    for j in range(1, 5):
        if tst[j] == 0:
            iscore = 0.0
        elif match[j] == 0:
            smooth *= 2
            iscore = math.log(1 / (smooth * tst[j]))
        else:
            iscore = math.log(match[j] / tst[j])
        score += iscore
    return math.exp(score / 4) * exp_len


def _nist(nsys: float, tst: Sequence[float], ref1: float, info: Sequence[float]) -> float:
    """mteval ``nist_score`` for 5-grams; 0 where Perl would divide by zero."""
    score = 0.0
    for n in range(1, 6):
        score += info[n] / max(tst[n], 1)
    if nsys == 0 or ref1 == 0:
        return 0.0
    ratio = tst[1] / (ref1 / nsys)
    if ratio >= 1:
        return score
    if ratio <= 0:
        return 0.0
    return score * math.exp(-_NIST_BETA * math.log(ratio) ** 2)


def _score_segment(hyp: list[str], refs: list[list[str]], ref_counts: list[Counter], info: dict) -> tuple:
    """mteval ``score_segment``: (ref_length, nrefs, match, tst, ref_count1, tst_info)."""
    tst_counts = _ngrams(hyp, 5)
    tst = [0] + [max(0, len(hyp) - n + 1) for n in range(1, 6)]
    ref_max: dict = {}
    ref1, nrefs, ref_length = 0, 0, None
    for words, counts in zip(refs, ref_counts, strict=True):
        ref_length = len(words) if ref_length is None else _closest(ref_length, len(words), len(hyp))
        if not words:
            continue
        nrefs += 1
        ref1 += len(words)
        for gram, c in counts.items():
            if c > ref_max.get(gram, 0):
                ref_max[gram] = c
    match, tst_info = [0] * 6, [0.0] * 6
    for gram, c in tst_counts.items():
        if gram in ref_max:
            m = min(c, ref_max[gram])
            match[len(gram)] += m
            tst_info[len(gram)] += info[gram] * m
    return ref_length or 0, nrefs, match, tst, ref1, tst_info


def mteval_e2e(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> MtevalResult:
    """Corpus BLEU and NIST of ``mteval-v13a-sig.pl`` as ``measure_scores.py`` runs it.

    Args:
        hyps: one (stripped) hypothesis per instance.
        refs: the references of each instance (at least one each).

    Returns:
        :class:`MtevalResult` with BLEU (0-1), NIST and mteval's segment scores.
    """
    hyp_tok = [tokenize_e2e(h) for h in hyps]
    # measure_scores pads missing references with '' into systems ref_0, ref_1, ... that
    # mteval visits in string order (ref_0, ref_1, ref_10, ..., ref_2): ref_0 always comes
    # first, and the order of the others does not matter (closest length, ties to the
    # shorter; empty references skipped after the first), so the padding is left out.
    ref_tok = [[tokenize_e2e(r) for r in rs] for rs in refs]
    ref_grams = [[_ngram_list(w, 5) for w in rs] for rs in ref_tok]
    ref_counts = [[Counter(g) for g in rs] for rs in ref_grams]
    corpus = Counter(chain.from_iterable(g for rs in ref_grams for g in rs))
    info = _NgramInfo(corpus, sum(len(w) for rs in ref_tok for w in rs))
    cum_len, cum_nrefs, cum_ref1 = 0, 0, 0
    cum_match, cum_tst, cum_info = [0] * 6, [0] * 6, [0.0] * 6
    seg_bleu, seg_nist = [], []
    for hyp, rs, rc in zip(hyp_tok, ref_tok, ref_counts, strict=True):
        ref_length, nrefs, match, tst, ref1, tst_info = _score_segment(hyp, rs, rc, info)
        seg_bleu.append(_bleu_smoothed(ref_length, match, tst))
        seg_nist.append(_nist(nrefs, tst, ref1, tst_info))
        cum_len, cum_nrefs, cum_ref1 = cum_len + ref_length, cum_nrefs + nrefs, cum_ref1 + ref1
        for n in range(1, 6):
            cum_match[n] += match[n]
            cum_tst[n] += tst[n]
            cum_info[n] += tst_info[n]
    n_seg = len(hyp_tok)
    bleu = _bleu_smoothed(cum_len, cum_match, cum_tst)
    nist = _nist(cum_nrefs / n_seg if n_seg else 0, cum_tst, cum_ref1, cum_info)
    return MtevalResult(bleu, nist, seg_bleu, seg_nist)


def _brevity_penalty(hyp_len: int, ref_len: int) -> float:
    """multi-bleu-detok.perl's ``exp(1 - r/h)`` below the reference length, else 1; no hypothesis
    token: 0, the limit as h -> 0 (where the Perl script divides by zero)."""
    if hyp_len >= ref_len:
        return 1.0
    return math.exp(1 - ref_len / hyp_len) if hyp_len else 0.0


def _multi_bleu(correct: Sequence[int], total: Sequence[int], hyp_len: int, ref_len: int) -> float:
    """multi-bleu-detok.perl's final formula, 0-100; 0 where the script gives up."""
    if ref_len == 0 or hyp_len == 0:
        return 0.0
    bp = _brevity_penalty(hyp_len, ref_len)
    logs = 0.0
    for n in range(1, 5):
        p = correct[n] / total[n] if total[n] else 0.0
        logs += math.log(p) if p else -9999999999
    return 100 * bp * math.exp(logs / 4)


def _multi_bleu_counts(hyps: Sequence[str], refs: Sequence[Sequence[str | None]]) -> tuple:
    """multi-bleu-detok's corpus counts: (correct, total, hyp_len, ref_len, sentence BLEU)."""
    correct, total = [0] * 5, [0] * 5
    hyp_len = ref_len = 0
    sent = []
    for hyp, rs in zip(hyps, refs, strict=True):
        words = tokenize_bytes_mode(hyp)
        closest_diff, closest_len = 9999, 9999
        ref_max: dict = {}
        for ref in rs:
            if ref is None:
                continue
            rwords = tokenize_bytes_mode(ref)
            diff = abs(len(words) - len(rwords))
            if diff < closest_diff or (diff == closest_diff and len(rwords) < closest_len):
                closest_diff, closest_len = diff, len(rwords)
            for gram, c in _ngrams(rwords, 4).items():
                if c > ref_max.get(gram, 0):
                    ref_max[gram] = c
        s_correct, s_total = [0] * 5, [0] * 5
        for gram, c in _ngrams(words, 4).items():
            s_total[len(gram)] += c
            s_correct[len(gram)] += min(c, ref_max.get(gram, 0))
        for n in range(1, 5):
            correct[n] += s_correct[n]
            total[n] += s_total[n]
        hyp_len += len(words)
        ref_len += closest_len
        sent.append(_multi_bleu(s_correct, s_total, len(words), closest_len))
    return correct, total, hyp_len, ref_len, sent


def multi_bleu_detok(hyps: Sequence[str], refs: Sequence[Sequence[str | None]]) -> tuple[float, list[float]]:
    """Corpus BLEU (0-100) of ``multi-bleu-detok.perl`` and its per-sentence values.

    Args:
        hyps: hypothesis lines as the script reads them.
        refs: for each instance, the reference lines in file order (empty ones included;
            None where a reference file has no line for the instance: not a reference).

    Returns:
        ``(bleu, sentence_bleu)``, the sentence values by the same unsmoothed formula.
    """
    correct, total, hyp_len, ref_len, sent = _multi_bleu_counts(hyps, refs)
    return _multi_bleu(correct, total, hyp_len, ref_len), sent


def multi_bleu_detok_line(hyps: Sequence[str], refs: Sequence[Sequence[str | None]]) -> str:
    """The line ``multi-bleu-detok.perl`` prints, e.g. ``BLEU = 48.56, 83.2/60.0/43.7/32.1
    (BP=0.944, ratio=0.945, hyp_len=110554, ref_len=116952)`` (arguments as
    :func:`multi_bleu_detok`)."""
    correct, total, hyp_len, ref_len, _ = _multi_bleu_counts(hyps, refs)
    if ref_len == 0:
        return "BLEU = 0, 0/0/0/0 (BP=0, ratio=0, hyp_len=0, ref_len=0)"
    prec = [100 * correct[n] / total[n] if total[n] else 0.0 for n in range(1, 5)]
    bp = _brevity_penalty(hyp_len, ref_len)
    return (
        f"BLEU = {_multi_bleu(correct, total, hyp_len, ref_len):.2f}, {'/'.join(f'{p:.1f}' for p in prec)} "
        f"(BP={bp:.3f}, ratio={hyp_len / ref_len:.3f}, hyp_len={hyp_len}, ref_len={ref_len})"
    )
