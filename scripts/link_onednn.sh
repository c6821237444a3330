#!/usr/bin/env bash
# Present the oneDNN 2.6 library from PyPI (onednn-cpu-gomp + onednn-devel-cpu-gomp,
# installed into the venv) in the layout jittor's compile_extern.setup_mkl expects:
#   $JITTOR_HOME/.cache/jittor/mkl/dnnl_lnx_2.2.0_cpu_gomp/{lib/libmkldnn.so,include/}
# Without it jittor falls back to its own matmul (~7x slower on CPU) or tries a download.
set -euo pipefail
venv=${1:?usage: link_onednn.sh VENV}
venv=$(cd "$venv" && pwd)
lib=$(ls "$venv"/lib/libdnnl.so.2.* 2>/dev/null | head -n1 || true)
[ -n "$lib" ] || { echo "link_onednn.sh: no libdnnl.so.2.* in $venv/lib (pip install onednn-cpu-gomp)" >&2; exit 1; }
[ -f "$venv/include/dnnl.hpp" ] || { echo "link_onednn.sh: no dnnl.hpp in $venv/include (pip install onednn-devel-cpu-gomp)" >&2; exit 1; }
dst="${JITTOR_HOME:-$HOME}/.cache/jittor/mkl/dnnl_lnx_2.2.0_cpu_gomp"
mkdir -p "$dst/lib"
ln -sfn "$lib" "$dst/lib/libmkldnn.so"
ln -sfn "$lib" "$dst/lib/libdnnl.so.2"
ln -sfn "$lib" "$dst/lib/libdnnl.so"
ln -sfn "$venv/include" "$dst/include"
echo "oneDNN $(basename "$lib") linked into $dst"
