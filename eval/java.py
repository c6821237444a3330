"""The two Java tools the official scorers use, one JVM per tool per run.

- the Stanford CoreNLP 3.4.1 ``PTBTokenizer`` (``-preserveLines -lowerCase``), as
  coco-caption's ``ptbtokenizer.py`` runs it, followed by its punctuation filter;
- METEOR 1.5 (``-l en -norm``) with its English paraphrase table, driven through
  ``-stdio``: one ``SCORE`` line per segment, then one ``EVAL`` line aggregating
  the statistics of all segments (coco-caption's ``meteor.py`` protocol).

Both jars and the paraphrase table come with the PyPI package ``pycocoevalcap``.
METEOR spends several seconds loading the paraphrase table, so
:class:`MeteorProcess` is started first and fed later, while other metrics run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from .inputs import JavaUnavailableError

__all__ = ["find_java", "require_java", "ptb_tokenize", "MeteorProcess", "meteor_files", "coco_score_line", "PTB_PUNCTUATION"]

# coco-caption's PUNCTUATIONS: tokens dropped after PTB tokenisation.
PTB_PUNCTUATION = frozenset(
    ["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-", ".", "?", "!", ",", ":", "-", "--", "...", ";"]
)
_JAVA_OPTS = ["-Dfile.encoding=UTF-8"]


@lru_cache(maxsize=1)
def _coco_dir() -> Path:
    """The installed ``pycocoevalcap`` folder (a namespace package: no ``__init__``)."""
    import importlib.util

    spec = importlib.util.find_spec("pycocoevalcap")
    if spec is None or not spec.submodule_search_locations:
        raise JavaUnavailableError("the pycocoevalcap package (METEOR and PTB jars) is not installed")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def _meteor_jar() -> Path:
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
    for jar in (_meteor_jar(), _ptb_jar()):
        if not jar.is_file():
            raise JavaUnavailableError(f"{jar} is missing: reinstall the pycocoevalcap package")
    return java


def ptb_tokenize(java: str, texts: Sequence[str]) -> list[str]:
    """coco-caption's PTB tokenisation: lowercased PTB tokens without punctuation.

    Args:
        java: java executable.
        texts: one text per line (no line breaks inside).

    Returns:
        For each text, its kept tokens joined by single spaces.
    """
    if not texts:
        return []
    cmd = [java, *_JAVA_OPTS, "-cp", str(_ptb_jar()), "edu.stanford.nlp.process.PTBTokenizer",
           "-preserveLines", "-lowerCase"]
    data = "\n".join(t.replace("\n", " ") for t in texts).encode("utf-8")
    proc = subprocess.run(cmd, input=data, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"PTBTokenizer failed ({proc.returncode}): {proc.stderr.decode(errors='replace')[-2000:]}")
    lines = proc.stdout.decode("utf-8").split("\n")
    if len(lines) != len(texts):
        raise RuntimeError(f"PTBTokenizer returned {len(lines)} lines for {len(texts)} inputs")
    return [" ".join(w for w in line.rstrip().split(" ") if w not in PTB_PUNCTUATION) for line in lines]


class MeteorProcess:
    """A METEOR 1.5 JVM in ``-stdio`` mode; start early, then call :meth:`score` once.

    Args:
        java: java executable.
    """

    def __init__(self, java: str):
        cmd = [java, *_JAVA_OPTS, "-Xmx2G", "-jar", str(_meteor_jar()), "-", "-", "-stdio", "-l", "en", "-norm"]
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(cmd, cwd=str(_meteor_jar().parent), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr)

    def _fail(self, what: str) -> RuntimeError:
        self._proc.kill()
        self._proc.wait()
        self._stderr.seek(0)
        err = self._stderr.read().decode("utf-8", "replace")[-2000:]
        return RuntimeError(f"METEOR {what} (exit {self._proc.returncode}): {err}")

    def _readline(self) -> str:
        line = self._proc.stdout.readline()
        if not line:
            raise self._fail("stopped early")
        return line.decode("utf-8").strip()

    def _write_all(self, lines: list[bytes], errors: list) -> None:
        try:
            for line in lines:
                self._proc.stdin.write(line)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:  # the reader reports the failure
            errors.append(exc)

    def score(self, score_lines: Sequence[str]) -> tuple[float, list[float]]:
        """Send ``SCORE`` lines, aggregate their statistics with one ``EVAL`` line.

        Args:
            score_lines: ``SCORE ||| ref ||| ... ||| hyp`` lines (no newline).

        Returns:
            ``(corpus_score, segment_scores)``.
        """
        try:
            payload = [(line + "\n").encode("utf-8") for line in score_lines]
            errors: list = []
            writer = threading.Thread(target=self._write_all, args=(payload, errors), daemon=True)
            writer.start()
            stats = [self._readline() for _ in score_lines]
            writer.join()
            self._proc.stdin.write(("EVAL ||| " + " ||| ".join(stats) + "\n").encode("utf-8"))
            self._proc.stdin.flush()
            seg = [float(self._readline()) for _ in score_lines]
            final = float(self._readline())
            return final, seg
        finally:
            self.close()

    def close(self) -> None:
        """Stop the JVM (idempotent)."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()


def coco_score_line(hyp: str, refs: Sequence[str]) -> str:
    """coco-caption ``Meteor._stat``'s line: ``|||`` and double spaces cleaned from the hypothesis."""
    hyp = hyp.replace("|||", "").replace("  ", " ")
    return " ||| ".join(("SCORE", " ||| ".join(refs), hyp))


def meteor_files(java: str, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> tuple[float, list[float]]:
    """METEOR 1.5 in file mode (``hyp ref -l en -norm -r N``), as GenerationEval runs it.

    Used where a text contains ``|||``, which ``-stdio`` cannot carry.

    Args:
        java: java executable.
        hyps: one tokenised hypothesis per instance.
        refs: the references of each instance (padded with ``""`` to the same N).

    Returns:
        ``(final_score, segment_scores)``.
    """
    nref = max(len(rs) for rs in refs)
    flat = [r for rs in refs for r in list(rs) + [""] * (nref - len(rs))]
    with tempfile.TemporaryDirectory() as tmp:
        hyp_file, ref_file = Path(tmp, "hyp"), Path(tmp, "ref")
        hyp_file.write_text("\n".join(hyps), encoding="utf-8")
        ref_file.write_text("\n".join(flat), encoding="utf-8")
        cmd = [java, *_JAVA_OPTS, "-Xmx2G", "-jar", str(_meteor_jar()), str(hyp_file), str(ref_file),
               "-l", "en", "-norm", "-r", str(nref)]
        proc = subprocess.run(cmd, cwd=str(_meteor_jar().parent), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, check=False)
    out = proc.stdout.decode("utf-8", "replace")
    seg = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("Segment ")]
    final = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("Final score:")]
    if proc.returncode != 0 or not final or len(seg) != len(hyps):
        raise RuntimeError(f"METEOR failed ({proc.returncode}): {proc.stderr.decode(errors='replace')[-2000:]}")
    return final[0], seg
