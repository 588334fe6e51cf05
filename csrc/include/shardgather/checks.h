// Argument checks that name the op and the argument, so a bad call is a
// RuntimeError a user can act on, never a segfault or silent corruption.
#pragma once

#include <c10/util/Exception.h>

#define SG_CHECK(op, cond, ...) TORCH_CHECK((cond), "shardgather::", op, ": ", __VA_ARGS__)

#define SG_CHECK_CONTIGUOUS(op, t) \
  SG_CHECK(op, (t).is_contiguous(), "argument '", #t, "' must be contiguous")

#define SG_CHECK_DTYPE(op, t, dt)                                                 \
  SG_CHECK(op, (t).scalar_type() == (dt), "argument '", #t, "' must have dtype ", \
           c10::toString(dt), ", got ", c10::toString((t).scalar_type()))

#define SG_CHECK_DIM(op, t, d) \
  SG_CHECK(op, (t).dim() == (d), "argument '", #t, "' must be ", (d), "-D, got ", (t).dim(), "-D")
