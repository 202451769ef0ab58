// LOOM_WIRE_TRY(expr): return the Status of expr from the enclosing function
// when it is not ok (internal to wire/; a function returning Status or Result).
#pragma once
#include "common/status.h"

#define LOOM_WIRE_TRY(expr)        \
  do {                             \
    ::loom::Status _st = (expr);   \
    if (!_st.ok()) return _st;     \
  } while (0)
