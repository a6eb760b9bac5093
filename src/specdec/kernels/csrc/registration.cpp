// The library of one build: torch.ops.<SPECDEC_QLIB>.<op>, each op defined where ops.h says.
#include "ops.h"

TORCH_LIBRARY(SPECDEC_QLIB, m) {
  using namespace SPECDEC_QLIB;
  m.def("uses_tiles() -> bool", &uses_tiles);
  m.def("set_pair_rows(int mask) -> ()", &set_pair_rows);
  m.def("pair_rows() -> int", &pair_rows);
  m.def("set_wide_rows(int rows) -> ()", &set_wide_rows);
  m.def("wide_rows() -> int", &wide_rows);
  m.def("formats() -> int[]", &formats);
  m.def("qmm(Tensor x, Tensor[] ws, int[] types, Tensor? bias, ScalarType? out_dtype=None) -> Tensor", &qmm);
  m.def("repack_q4k_x16(Tensor w) -> Tensor", &repack_q4k_x16);
  m.def("repack_q6k_x16(Tensor w) -> Tensor", &repack_q6k_x16);
  m.def("repack_q40_x16(Tensor w) -> Tensor", &repack_q40_x16);
  m.def("repack_q50_x16(Tensor w) -> Tensor", &repack_q50_x16);
  m.def("widen_q50_q80(Tensor w) -> Tensor", &widen_q50_q80);
  m.def("requantize_q4_0(Tensor w, int type) -> Tensor", &requantize_q4_0);
  m.def("quantize_acts(Tensor x, int bs) -> Tensor[]", &quantize_acts);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rope);
  m.def("attention(Tensor q, Tensor keys, Tensor values, Tensor visible, Tensor? key_index, Tensor? pages=None) -> Tensor",
        &attention);
  m.def("attention_tiles(int head_dim) -> bool", &attention_tiles);
  m.def("quantize_kv(Tensor x) -> Tensor", &quantize_kv);
  m.def("decoder_layer(Tensor x, Tensor[] norms, float eps, Tensor[] qkv, int[] qkv_types, Tensor? qkv_bias, "
        "Tensor[] o, int[] o_types, Tensor[] gate_up, int[] gate_up_types, Tensor[] down, int[] down_types, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor visible, "
        "Tensor? key_index, int num_heads, int num_kv_heads, Tensor? pages=None, Tensor? q_norm=None, "
        "Tensor? k_norm=None, bool gelu=False, float q_factor=1.0) -> Tensor", &decoder_layer);
}
