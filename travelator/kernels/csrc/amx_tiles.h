// What every user of AMX's tiles shares (blocked_linear.cpp's GEMM, attention_tiles_amx.h's
// attention products, attention_flash.h's route to oneDNN's AMX kernels): whether this
// process may use them, and the layout of the configuration that shapes them.
#pragma once

#include <cstdint>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace travelator {

// Built for AMX, and granted the tiles' state: Linux lends it to a process only once asked
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); asked once, the answer kept.
inline bool amx_tiles_permitted() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

// The layout _tile_loadconfig reads (palette 1): tile t is rows[t] rows of colsb[t] bytes.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace travelator
