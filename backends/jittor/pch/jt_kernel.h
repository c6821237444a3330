// The headers jittor's CPU kernels start with, precompiled by backends/jittor/jit_cc.sh into the
// kernel cache and included before a kernel's own source (whose #includes of them are then
// no-ops: jittor's headers are #pragma once, the C++ library's guarded). The two macros are the
// first lines of every CPU kernel jittor writes, so the headers see what they see there.
#define JIT 1
#define JIT_cpu 1
#include <cmath>
#include <algorithm>
#include <limits>
#include "var.h"
#include "ops/op_register.h"
#include "executor.h"
#include "fused_op.h"
