#!/usr/bin/env bash
# One entry point for set-up and the main jobs. Each command installs what is missing first
# (a venv in .venv with torch CPU, jittor + oneDNN, transformers, peft, the evaluator's
# dependencies, a headless Java for METEOR, Open MPI for jittor's mpirun), so on a fresh
# Debian/Ubuntu machine with Python 3.10+ one command is enough:
#   bash scripts/lora.sh demo [ARGS]   # embedded demo: both backends, train -> beam -> decode -> eval
#   bash scripts/lora.sh demo-cls [ARGS]  # SST-2 demo (data in ../shared/data or --data-dir): DistilBERT
#                                      # pre-trained here, LoRA in both backends, dev accuracy
#   bash scripts/lora.sh test [ARGS]   # the whole test suite (pytest ARGS; LORA_TEST_WORKERS, default
#                                      # the CPUs up to 4, processes with pytest-xdist)
#   bash scripts/lora.sh setup         # only install
#   bash scripts/lora.sh bench [ARGS]  # speed/memory benchmark (examples/nlg/bench.py)
# Environment: PYTHON (default python3), LORA_VENV (default .venv), TORCH_SPEC (default
# torch==2.13.0), PIP_INDEX_FOR_TORCH (e.g. the PyTorch CPU wheel index, if reachable),
# JITTOR_HOME (where jittor keeps its kernel cache; default $HOME).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${LORA_VENV:-$root/.venv}
py=${PYTHON:-python3}
stamp="$venv/.lora_setup_done"

need_java() {
  command -v java >/dev/null 2>&1 && return 0
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing a headless Java runtime (METEOR 1.5 and the PTB tokenizer need it)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq default-jre-headless >/dev/null
  else
    echo "[setup] warning: no java; install a JRE (e.g. apt-get install default-jre-headless) for METEOR" >&2
  fi
}

need_mpi() {
  # Open MPI: jittor's data parallelism (mpirun) and its MPI ops, compiled by jittor at import
  command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 && return 0
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing Open MPI (mpirun for jittor's data parallelism)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
  else
    echo "[setup] warning: no Open MPI; install it (e.g. apt-get install openmpi-bin libopenmpi-dev) for mpirun with jittor" >&2
  fi
}

need_tcmalloc() {
  # tcmalloc: the torch backend's Llama runs re-execute under it (lora_core.train.allocator): a
  # lower peak than glibc's malloc, and faster activation checkpointing and 4-bit steps
  local f
  for f in /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4; do
    [ -f "$f" ] && return 0
  done
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing tcmalloc (the torch backend's allocator for Llama training)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
  else
    echo "[setup] warning: no tcmalloc; install it (e.g. apt-get install libtcmalloc-minimal4): torch Llama runs keep glibc's malloc" >&2
  fi
}

setup() {
  "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python 3.10+ is required")'
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
  "${pip[@]}" --upgrade pip setuptools wheel
  # jittor first: its first import compiles its core for minutes on all CPUs, while torch,
  # transformers and the rest download and unpack beside it (mostly waiting on disk and network)
  need_mpi  # jittor's MPI ops compile at that import
  "${pip[@]}" -e ".[jittor]"
  bash scripts/link_onednn.sh "$venv"
  echo "[setup] compiling jittor's kernels in the background (first time: a few minutes)"
  local jlog="$venv/.jittor_compile.log" jpid
  "$venv/bin/python" -c 'import lora_core as lc; b = lc.get_backend("jittor"); import jittor as jt; from jittor import compile_extern as ce; print("[setup] jittor", jt.__version__, "oneDNN:", ce.mkl_ops is not None, "MPI:", ce.mpi is not None); assert ce.mkl_ops is not None, "jittor did not load oneDNN"' >"$jlog" 2>&1 &
  jpid=$!
  if [ -n "${PIP_INDEX_FOR_TORCH:-}" ]; then
    "${pip[@]}" --index-url "$PIP_INDEX_FOR_TORCH" "${TORCH_SPEC:-torch==2.13.0}"
  else
    "${pip[@]}" "${TORCH_SPEC:-torch==2.13.0}"
  fi
  "${pip[@]}" -e ".[all]"
  need_java
  need_tcmalloc
  if ! wait "$jpid"; then
    tail -n 40 "$jlog" >&2
    echo "[setup] jittor's first import failed (log: $jlog)" >&2
    exit 1
  fi
  grep '^\[setup\] jittor' "$jlog"
  touch "$stamp"
}

test_workers() {
  # pytest-xdist's options for the suite: LORA_TEST_WORKERS processes (default: the CPUs this
  # process may use, at most 4; 1 = one process, no xdist), each test file on one worker (its
  # module fixtures built once). Most tests wait on child processes or run one thread, so 2
  # workers on 2 cores take about half the time of one; a third worker on 2 cores was slower on a
  # fresh kernel cache (clean clones: 36 min 9 s of tests vs 31-34 min with 2), though it left no CPU idle. Nothing is
  # added when ARGS choose workers themselves (-n, --numprocesses, -p no:xdist) or debug (--pdb,
  # --trace).
  local a n=${LORA_TEST_WORKERS:-}
  for a in "$@"; do
    case "$a" in -n|-n*|--numprocesses*|no:xdist|--pdb|--trace) return 0 ;; esac
  done
  if [ -z "$n" ]; then
    n=$("$venv/bin/python" -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')
  fi
  case "$n" in ''|*[!0-9]*) echo "LORA_TEST_WORKERS=$n: not a number of processes" >&2; exit 2 ;; esac
  [ "$n" -gt 1 ] || return 0
  if ! "$venv/bin/python" -c 'import xdist' 2>/dev/null; then  # a venv set up before xdist was a dependency
    "$venv/bin/python" -m pip install --disable-pip-version-check -q 'pytest-xdist>=3.5' >&2 \
      || { echo "[test] no pytest-xdist: running in one process" >&2; return 0; }
  fi
  echo "-n $n --dist loadfile --no-loadscope-reorder"
  return 0
}

cmd=${1:-help}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  test)
    [ -f "$stamp" ] || setup
    xdist_opts=$(test_workers "$@")
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pytest $xdist_opts "$@" ;;
  demo)
    [ -f "$stamp" ] || setup
    "$venv/bin/python" -m examples.nlg.demo "$@" ;;
  demo-cls)
    [ -f "$stamp" ] || setup
    "$venv/bin/python" -m examples.cls.demo "$@" ;;
  bench)
    [ -f "$stamp" ] || setup
    "$venv/bin/python" -m examples.nlg.bench "$@" ;;
  *) sed -n '2,15p' "$0"; exit 2 ;;
esac
