#!/bin/sh
# jittor's kernel compile command: without its assembly pass where a kernel has nothing for it,
# and with jittor's common headers precompiled.
#
# jittor (jit_compiler.cc) compiles each CPU kernel as
#     <python_path> <jittor>/utils/asm_tuner.py --cc_path=<c++> <kernel>.cc <flags> -o <kernel>.so
# where asm_tuner.py compiles to assembly with -g, rewrites the lines between the kernel's
# "@begin replace" / "@end" markers (jittor's use_movnt pass: non-temporal stores), then
# assembles and links: two compiler runs and a Python start for every kernel. A kernel without
# those markers (about 3 in 4) gets the same code from one compiler run (-g does not change the
# generated code), 28% less time per kernel here (1.49 vs 2.07 s). backends/jittor/_env.py points
# jittor's python_path at this script; everything else (kernels with markers, CUDA's
# dlink_compiler.py) goes to the real interpreter, LORA_JITTOR_PYTHON, unchanged.
#
# Most of such a compile is parsing jittor's headers (var.h, op.h, the C++ library: about 75,000
# lines before a kernel's own code; g++ -fsyntax-only takes 1.65 of a 1.88 s compile). So a
# kernel compiled here first includes pch/jt_kernel.h, which includes the headers every CPU
# kernel of jittor starts with, precompiled once per compiler and flags into the kernel cache
# (<cache>/lora_pch/<key>/, a few seconds; a kernel with markers gets one built with -g, which
# the tuner's compile to assembly adds); the kernel's own #includes of them are then no-ops
# (#pragma once, include guards). Only a kernel whose source starts as jittor writes its CPU
# kernels ("#define JIT 1", "#define JIT_cpu 1") takes it, and the machine code is the same
# (tests/test_jit_cc.py compiles kernels both ways and compares it). A header that fails to
# build is not tried again (lora_pch/<key>/failed, its log beside it): kernels then compile
# without it. LORA_JITTOR_PCH=0 (or off, false, no) turns it off.
here=$(dirname "$0")

# pch_on: whether LORA_JITTOR_PCH is on: 0/off/false/no (any case, blanks around ignored) turn it
# off; anything else, unset included, keeps it on (backends/jittor/_env.py's switch refuses
# another value when the backend is set up, before jittor compiles anything)
pch_on() {
    v=${LORA_JITTOR_PCH-}
    v=${v#"${v%%[![:space:]]*}"}
    v=${v%"${v##*[![:space:]]}"}
    case $v in
    0 | [Oo][Ff][Ff] | [Ff][Aa][Ll][Ss][Ee] | [Nn][Oo]) return 1 ;;
    esac
    return 0
}

# pch CC SRC OUT KERNEL-ARGS...: prints the header to -include (its .gch beside it), or nothing
pch() {
    cc=$1 src=$2 out=$3
    shift 3
    pch_on || return 0
    [ -f "$here/pch/jt_kernel.h" ] || return 0
    [ "$(awk 'NF { print; if (++n == 2) exit }' "$src")" = "$(printf '#define JIT 1\n#define JIT_cpu 1')" ] || return 0
    # the kernel's compile flags, less its source, output and link options
    skip=
    for a do
        shift
        if [ -n "$skip" ]; then skip=; continue; fi
        case $a in
        -o) skip=1; continue ;;
        "$src" | -shared | -l* | -L* | -Wl,*) continue ;;
        esac
        set -- "$@" "$a"
    done
    jsrc=
    for a do
        case $a in -I*/jittor/src) jsrc=${a#-I} ;; esac
    done
    [ -n "$jsrc" ] || return 0
    # a new precompiled header for another compiler, flags, header list or jittor install
    key=$({ printf '%s\n' "$cc" "$@"; cat "$here/pch/jt_kernel.h"; ls -l --time-style=+%s "$jsrc"/*.h; } | cksum | tr ' ' _)
    dir=$(dirname "$(dirname "$out")")/lora_pch/$key
    if [ ! -f "$dir/jt_kernel.h.gch" ]; then
        [ -f "$dir/failed" ] && return 0
        mkdir -p "$dir" || return 0
        tmp=$dir/tmp.$$
        cp "$here/pch/jt_kernel.h" "$tmp.h" || return 0
        if "$cc" "$@" -x c++-header "$tmp.h" -o "$tmp.h.gch" > "$dir/build.log" 2>&1; then
            mv -f "$tmp.h" "$dir/jt_kernel.h" && mv -f "$tmp.h.gch" "$dir/jt_kernel.h.gch"
        else
            : > "$dir/failed"  # its log beside it; kernels compile without it
        fi
        rm -f "$tmp.h" "$tmp.h.gch"
        [ -f "$dir/jt_kernel.h.gch" ] || return 0
    fi
    printf '%s\n' "$dir/jt_kernel.h"
}

case "$1" in
*/asm_tuner.py)
    cc=${2#--cc_path=} src=$3 out= prev=
    for a in "$@"; do
        [ "$prev" = "-o" ] && out=$a
        prev=$a
    done
    case "$src:$out" in
    *_op.cc:*_op.so)  # a kernel compiled to a library (not one of the tuner's other forms)
        tuner=$1
        shift 2
        if ! grep -q "@begin" "$src"; then
            h=$(pch "$cc" "$src" "$out" "$@")
            if [ -n "$h" ]; then
                exec "$cc" -include "$h" "$@"
            fi
            exec "$cc" "$@"
        fi
        # the tuner's compile to assembly adds -g: a header precompiled with -g (g++ uses one
        # only with the same debug information); its assembly-to-library step ignores -include
        h=$(pch "$cc" "$src" "$out" "$@" -g)
        shift
        if [ -n "$h" ]; then
            set -- "$src" -include "$h" "$@"
        else
            set -- "$src" "$@"
        fi
        set -- "$tuner" "--cc_path=$cc" "$@"
        ;;
    esac
    ;;
esac
exec "${LORA_JITTOR_PYTHON:?backends/jittor/jit_cc.sh: LORA_JITTOR_PYTHON is not set}" "$@"
