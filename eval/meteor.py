"""METEOR 1.5 (``-l en -norm``), driven the way coco-caption's ``meteor.py`` does.

``-stdio`` protocol: one ``SCORE ||| ref ||| ... ||| hyp`` line per segment
answers that segment's sufficient statistics; one ``EVAL ||| stats ||| ...``
line answers the score of every segment, then the corpus score computed from
the aggregated statistics (what file mode prints as "Final score"; checked
equal on the WebNLG example).

Speed, with the same numbers: METEOR's start is dominated by loading its
paraphrase table, so it is given the subset of the table that the texts can use
(:mod:`eval.paraphrase`: entries with one phrase in a reference and the other in a
hypothesis) and runs with the C1 JIT and the serial collector. Segments can be scored
by several JVMs in parallel (``LORA_EVAL_METEOR_JVMS``; the statistics of a
segment do not depend on the others, and the ``EVAL`` line goes to one of
them); on 2 cores one is faster. Without the paraphrase cache, one JVM loads
the full table.
Texts containing ``|||`` (the field separator) are scored in file mode, as
WebNLG's GenerationEval runs METEOR.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .java import JAVA_OPTS, meteor_jar
from .paraphrase import subset_table

__all__ = ["MeteorProcess", "MeteorRun", "meteor_stdio", "meteor_files"]


class MeteorProcess:
    """One METEOR JVM in ``-stdio`` mode.

    Args:
        java: java executable.
        table: paraphrase table to load instead of the jar's default (``-a``).
    """

    def __init__(self, java: str, table: Path | None = None):
        # With the small subset table the run is short: the C1 compiler alone is faster
        # (C2 compile threads cost more than they save) and so is the serial collector
        # (about 1 s of CPU less than the parallel one on 2 cores); the full table loads
        # faster with C2 and the default collector.
        jit = ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"] if table is not None else []
        cmd = [java, *JAVA_OPTS, *jit, "-Xmx2G", "-jar", str(meteor_jar()), "-", "-", "-stdio", "-l", "en", "-norm"]
        if table is not None:
            cmd += ["-a", str(table)]
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            cmd, cwd=str(meteor_jar().parent), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr
        )

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

    def _write_all(self, lines: list[bytes]) -> None:
        try:
            for line in lines:
                self._proc.stdin.write(line)
            self._proc.stdin.flush()
        except OSError:  # the reader reports the failure
            pass

    def stats(self, score_lines: Sequence[str]) -> list[str]:
        """Sufficient statistics of each ``SCORE`` line (written by a thread while read)."""
        payload = [(line + "\n").encode("utf-8") for line in score_lines]
        writer = threading.Thread(target=self._write_all, args=(payload,), daemon=True)
        writer.start()
        out = [self._readline() for _ in score_lines]
        writer.join()
        return out

    def evaluate(self, stats: Sequence[str]) -> tuple[float, list[float]]:
        """``(corpus_score, segment_scores)`` of the aggregated statistics."""
        self._proc.stdin.write(("EVAL ||| " + " ||| ".join(stats) + "\n").encode("utf-8"))
        self._proc.stdin.flush()
        seg = [float(self._readline()) for _ in stats]
        return float(self._readline()), seg

    def close(self) -> None:
        """Stop the JVM (idempotent)."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()


def _workers() -> int:
    env = os.environ.get("LORA_EVAL_METEOR_JVMS")
    return max(1, int(env)) if env else 1  # more only pays off with free cores


def _fields(line: str) -> list[str]:
    """``line.split("\\|\\|\\|")`` as Java computes it (trailing empty strings dropped),
    the fields METEOR's ``-stdio`` mode reads (and trims)."""
    fields = line.split("|||")
    while len(fields) > 1 and not fields[-1]:
        fields.pop()
    return fields


def _texts(score_lines: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(references, hypotheses)`` of ``SCORE ||| ref ||| ... ||| hyp`` lines, as METEOR
    splits them (all references of a line joined by a space)."""
    refs, hyps = [], []
    for line in score_lines:
        fields = _fields(line)
        refs.append(" ".join(fields[1:-1]))
        hyps.append(fields[-1])
    return refs, hyps


class MeteorRun:
    """Corpus and segment METEOR of ``SCORE`` lines, started now, collected by :meth:`result`.

    The paraphrase subset is made in the calling thread; the JVMs then load and score
    in the background while the caller computes other metrics.

    Args:
        java: java executable.
        score_lines: one ``SCORE ||| ref ||| ... ||| hyp`` line per segment.
    """

    def __init__(self, java: str, score_lines: Sequence[str]):
        self._tmp = tempfile.TemporaryDirectory()
        table = Path(self._tmp.name, "paraphrase-subset.gz")
        data = meteor_jar().parent / "data" / "paraphrase-en.gz"
        refs, hyps = _texts(score_lines)
        table = table if subset_table(data, refs, table, hyps=hyps) else None
        n = _workers() if table is not None else 1
        self._procs = [MeteorProcess(java, table) for _ in range(n)]
        size = -(-len(score_lines) // n)
        parts = [score_lines[i * size : (i + 1) * size] for i in range(n)]
        self._pool = ThreadPoolExecutor(max_workers=n)
        self._futures = [self._pool.submit(p.stats, part) for p, part in zip(self._procs, parts, strict=True)]

    def result(self) -> tuple[float, list[float]]:
        """``(corpus_score, segment_scores)``; stops the JVMs."""
        try:
            stats = [s for f in self._futures for s in f.result()]
            return self._procs[0].evaluate(stats)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the JVMs and remove the subset table (idempotent)."""
        for p in self._procs:
            p.close()
        self._pool.shutdown(wait=True)
        self._tmp.cleanup()


def meteor_stdio(java: str, score_lines: Sequence[str]) -> tuple[float, list[float]]:
    """Corpus and segment METEOR of ``SCORE`` lines (see :class:`MeteorRun`)."""
    return MeteorRun(java, score_lines).result()


def meteor_files(java: str, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> tuple[float, list[float]]:
    """METEOR in file mode (``hyp ref -l en -norm -r N``), as GenerationEval runs it.

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
        cmd = [
            java,
            *JAVA_OPTS,
            "-Xmx2G",
            "-jar",
            str(meteor_jar()),
            str(hyp_file),
            str(ref_file),
            "-l",
            "en",
            "-norm",
            "-r",
            str(nref),
        ]
        proc = subprocess.run(cmd, cwd=str(meteor_jar().parent), capture_output=True, check=False)
    lines = proc.stdout.decode("utf-8", "replace").splitlines()
    seg = [float(line.split()[-1]) for line in lines if line.startswith("Segment ")]
    final = [float(line.split()[-1]) for line in lines if line.startswith("Final score:")]
    if proc.returncode != 0 or not final or len(seg) != len(hyps):
        raise RuntimeError(f"METEOR failed ({proc.returncode}): {proc.stderr.decode(errors='replace')[-2000:]}")
    return final[0], seg
