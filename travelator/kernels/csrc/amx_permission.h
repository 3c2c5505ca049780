// Whether this process may use AMX's tiles: the one check blocked_linear.cpp's tile kernel
// and attention_flash.h's route (oneDNN's AMX kernels) share.
#pragma once

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

}  // namespace travelator
