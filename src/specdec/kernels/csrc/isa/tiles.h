// The AMX tile unit's set-up, shared by the AMX kernel set's k-quant tiles
// (amx/k_quants.h) and attention tiles (amx/attention.h).
#pragma once
#include "../common.h"

#if defined(SPECDEC_AMX)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace SPECDEC_QLIB {
namespace {

bool amx_ok() {
  // the kernel lets a process use the tile registers once it asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace
}  // namespace SPECDEC_QLIB
#endif
