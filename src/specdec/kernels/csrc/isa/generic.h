// Portable form of the 32-byte vectors (isa/vec.h): each operation lane by lane, the values of the AVX2 form.
#pragma once
#include "../common.h"

namespace SPECDEC_QLIB {
namespace {

union VI {
  uint8_t u[32];
  int8_t b[32];
  int16_t h[16];
  int32_t w[8];
};
struct VF {
  float f[8];
};
inline VI load(const void* p) { VI v; std::memcpy(v.u, p, 32); return v; }
inline VI zero() { VI v; std::memset(v.u, 0, 32); return v; }
inline VI set8(int8_t x) { VI v; for (int i = 0; i < 32; ++i) v.b[i] = x; return v; }
inline VI set16(int16_t x) { VI v; for (int i = 0; i < 16; ++i) v.h[i] = x; return v; }
inline VI and_(VI a, VI b) { for (int i = 0; i < 32; ++i) a.u[i] &= b.u[i]; return a; }
inline VI or_(VI a, VI b) { for (int i = 0; i < 32; ++i) a.u[i] |= b.u[i]; return a; }
inline VI shr_mask(VI b, int s, int8_t mask) {
  for (int i = 0; i < 32; ++i) b.u[i] = static_cast<uint8_t>((b.u[i] >> s) & static_cast<uint8_t>(mask));
  return b;
}
inline VI shl4(VI b) { for (int i = 0; i < 32; ++i) b.u[i] = static_cast<uint8_t>(b.u[i] << 4); return b; }
inline VI sub8(VI a, VI b) { for (int i = 0; i < 32; ++i) a.u[i] = static_cast<uint8_t>(a.u[i] - b.u[i]); return a; }
inline VI abs8(VI a) {
  for (int i = 0; i < 32; ++i) a.u[i] = static_cast<uint8_t>(a.b[i] < 0 ? -static_cast<int>(a.b[i]) : a.b[i]);
  return a;
}
inline VI sign8(VI a, VI b) {
  for (int i = 0; i < 32; ++i)
    a.b[i] = static_cast<int8_t>(b.b[i] < 0 ? -static_cast<int>(a.b[i]) : (b.b[i] == 0 ? 0 : a.b[i]));
  return a;
}
inline VI sub32(VI a, VI b) { for (int i = 0; i < 8; ++i) a.w[i] -= b.w[i]; return a; }
inline VI add32(VI a, VI b) { for (int i = 0; i < 8; ++i) a.w[i] += b.w[i]; return a; }
inline VF fadd(VF a, VF b) { for (int i = 0; i < 8; ++i) a.f[i] += b.f[i]; return a; }
inline VF fmul_i(VI v, float s) { VF r; for (int i = 0; i < 8; ++i) r.f[i] = static_cast<float>(v.w[i]) * s; return r; }
inline VF fmsub_i(VI v, float s, VF m) {
  VF r;
  for (int i = 0; i < 8; ++i) r.f[i] = std::fma(static_cast<float>(v.w[i]), s, -m.f[i]);
  return r;
}
inline VI shl32(VI a, int s) { for (int i = 0; i < 8; ++i) a.w[i] = static_cast<int32_t>(static_cast<uint32_t>(a.w[i]) << s); return a; }
inline VI maddubs(VI u, VI s) {
  VI r;
  for (int i = 0; i < 16; ++i) {
    int v = u.u[2 * i] * s.b[2 * i] + u.u[2 * i + 1] * s.b[2 * i + 1];
    r.h[i] = static_cast<int16_t>(std::min(32767, std::max(-32768, v)));
  }
  return r;
}
inline VI madd(VI a, VI b) {
  VI r;
  for (int i = 0; i < 8; ++i) r.w[i] = a.h[2 * i] * b.h[2 * i] + a.h[2 * i + 1] * b.h[2 * i + 1];
  return r;
}
inline VI dot4(VI u, VI s) {
  VI r;
  for (int i = 0; i < 8; ++i) {
    int32_t t = 0;
    for (int j = 0; j < 4; ++j) t += u.u[4 * i + j] * s.b[4 * i + j];
    r.w[i] = t;
  }
  return r;
}
inline VI nibbles16(const uint8_t* p) {
  VI v;
  for (int i = 0; i < 16; ++i) {
    v.u[i] = p[i] & 0x0F;
    v.u[16 + i] = p[i] >> 4;
  }
  return v;
}
inline VI bit4_from_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  VI v;
  for (int i = 0; i < 32; ++i) v.u[i] = ((bits >> i) & 1) ? 0x10 : 0;
  return v;
}
inline VF fzero() { VF v; for (int i = 0; i < 8; ++i) v.f[i] = 0.f; return v; }
inline VF fmadd_i(VI v, float s, VF acc) {
  for (int i = 0; i < 8; ++i) acc.f[i] = std::fma(static_cast<float>(v.w[i]), s, acc.f[i]);
  return acc;
}
inline float hsum(VF v) {
  const float* l = v.f;
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
inline VI scales16(const int8_t* sc) { VI v; for (int i = 0; i < 16; ++i) v.h[i] = sc[i]; return v; }
inline VI pair16(int16_t a, int16_t b) { VI v; for (int i = 0; i < 16; ++i) v.h[i] = i < 8 ? a : b; return v; }
inline VI widen32(uint64_t v) { VI r; for (int i = 0; i < 8; ++i) r.w[i] = static_cast<uint8_t>(v >> (8 * i)); return r; }

}  // namespace
}  // namespace SPECDEC_QLIB
