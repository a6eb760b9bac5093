// The table of block formats: every type qmm reads, one line each. A new type: its file (quant/, with its
// block layout, its dot products and its `Format` entry), a line below, and its GGML id in qgemm.py.
#pragma once
#include "quant/q32.h"
#include "quant/q45_k.h"
#include "quant/q6_k.h"
#include "repack/q32_x16.h"
#include "repack/q4_k_x16.h"
#include "repack/q6_k_x16.h"

namespace SPECDEC_QLIB {
namespace {

constexpr const Format* kFormats[] = {
    &kFormatQ4_0, &kFormatQ5_0, &kFormatQ8_0, &kFormatQ4_K, &kFormatQ5_K, &kFormatQ6_K,
    &kFormatQ4_0X16, &kFormatQ5_0X16, &kFormatQ4_KX16, &kFormatQ6_KX16,
};

inline const Format* find_format(int64_t type) {  // nullptr: not a type of the table
  for (const Format* f : kFormats)
    if (f->type == type) return f;
  return nullptr;
}

}  // namespace
}  // namespace SPECDEC_QLIB
