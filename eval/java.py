"""The two Java tools the official scorers use, one JVM per tool per run.

- the Stanford CoreNLP 3.4.1 ``PTBTokenizer`` (``-preserveLines -lowerCase``), as
  coco-caption's ``ptbtokenizer.py`` runs it, followed by its punctuation filter;
- METEOR 1.5 (:mod:`eval.meteor`).

Both jars and METEOR's paraphrase table come with the PyPI package ``pycocoevalcap``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from .inputs import JavaUnavailableError

__all__ = [
    "find_java",
    "require_java",
    "ptb_tokenize",
    "PtbRun",
    "coco_score_line",
    "meteor_jar",
    "JAVA_OPTS",
    "PTB_PUNCTUATION",
]

# coco-caption's PUNCTUATIONS: tokens dropped after PTB tokenisation.
PTB_PUNCTUATION = frozenset(
    ["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-", ".", "?", "!", ",", ":", "-", "--", "...", ";"]
)
JAVA_OPTS = ["-Dfile.encoding=UTF-8"]
# characters PTBTokenizer -preserveLines ends a line at (coco replaces only "\n"; the
# others cannot occur in the official scorer's lines, which codecs splits at them)
_PTB_BREAKS = str.maketrans(dict.fromkeys("\n\r\x0b\x0c\u2028\u2029", " "))


@lru_cache(maxsize=1)
def _coco_dir() -> Path:
    """The installed ``pycocoevalcap`` folder (a namespace package: no ``__init__``)."""
    import importlib.util

    spec = importlib.util.find_spec("pycocoevalcap")
    if spec is None or not spec.submodule_search_locations:
        raise JavaUnavailableError("the pycocoevalcap package (METEOR and PTB jars) is not installed")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def meteor_jar() -> Path:
    return _coco_dir() / "meteor" / "meteor-1.5.jar"


def _ptb_jar() -> Path:
    return _coco_dir() / "tokenizer" / "stanford-corenlp-3.4.1.jar"


def find_java() -> str | None:
    """Path of the ``java`` executable (``$JAVA_HOME/bin/java`` or on PATH), or None."""
    home = os.environ.get("JAVA_HOME")
    if home and Path(home, "bin", "java").is_file():
        return str(Path(home, "bin", "java"))
    return shutil.which("java")


def require_java(needed_for: Sequence[str], still_possible: Sequence[str]) -> str:
    """The java executable, or JavaUnavailableError naming what can still be computed.

    Args:
        needed_for: the requested metrics that need Java.
        still_possible: the metrics that can be computed without it.
    """
    java = find_java()
    if java is None:
        raise JavaUnavailableError(
            f"no Java runtime found (java on PATH or $JAVA_HOME): {', '.join(needed_for)} "
            f"need it (METEOR 1.5 and the CoreNLP PTB tokenizer are Java programs). "
            f"Install a JRE (e.g. apt-get install default-jre-headless) or ask only for "
            f"{', '.join(still_possible)} (--metrics {','.join(still_possible)})"
        )
    for jar in (meteor_jar(), _ptb_jar()):
        if not jar.is_file():
            raise JavaUnavailableError(f"{jar} is missing: reinstall the pycocoevalcap package")
    return java


class PtbRun:
    """coco-caption's PTB tokenisation of ``texts``, started now in the background.

    The texts go to the JVM from a temporary file and its output to another, so the
    run needs no Python thread (nothing competes with the caller for the GIL).

    Args:
        java: java executable.
        texts: one text per line (no line breaks inside).
    """

    def __init__(self, java: str, texts: Sequence[str]):
        self._n = len(texts)
        self._proc = None
        self._files = [tempfile.TemporaryFile() for _ in range(3)]  # stdin, stdout, stderr
        if not texts:
            return
        cmd = [
            java,
            *JAVA_OPTS,
            "-XX:TieredStopAtLevel=1",
            "-cp",
            str(_ptb_jar()),
            "edu.stanford.nlp.process.PTBTokenizer",
            "-preserveLines",
            "-lowerCase",
        ]
        stdin, stdout, stderr = self._files
        stdin.write("\n".join(t.translate(_PTB_BREAKS) for t in texts).encode("utf-8"))
        stdin.seek(0)
        self._proc = subprocess.Popen(cmd, stdin=stdin, stdout=stdout, stderr=stderr)

    def result(self) -> list[str]:
        """For each text, its kept tokens (lower-cased, punctuation dropped) joined by single spaces."""
        try:
            if self._proc is None:
                return []
            _, stdout, stderr = self._files
            if self._proc.wait() != 0:
                stderr.seek(0)
                err = stderr.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"PTBTokenizer failed ({self._proc.returncode}): {err}")
            stdout.seek(0)
            lines = stdout.read().decode("utf-8").split("\n")
            if len(lines) != self._n:
                raise RuntimeError(f"PTBTokenizer returned {len(lines)} lines for {self._n} inputs")
            return [" ".join(w for w in line.rstrip().split(" ") if w not in PTB_PUNCTUATION) for line in lines]
        finally:
            self.close()

    def close(self) -> None:
        """Stop the JVM if it still runs and drop the files (idempotent)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for fh in self._files:
            fh.close()


def ptb_tokenize(java: str, texts: Sequence[str]) -> list[str]:
    """coco-caption's PTB tokenisation: lowercased PTB tokens without punctuation.

    Args:
        java: java executable.
        texts: one text per line (no line breaks inside).

    Returns:
        For each text, its kept tokens joined by single spaces.
    """
    return PtbRun(java, texts).result()


def coco_score_line(hyp: str, refs: Sequence[str]) -> str:
    """coco-caption ``Meteor._stat``'s line: ``|||`` and double spaces cleaned from the hypothesis."""
    hyp = hyp.replace("|||", "").replace("  ", " ")
    return " ||| ".join(("SCORE", " ||| ".join(refs), hyp))
