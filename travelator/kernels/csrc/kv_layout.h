// Where a row of the KV cache lies: the one statement of its layout on the C++ side
// (model/kv_layout.py is the Python one). A layer's K or V cache is [blocks, kv_heads,
// block_size, row]: each head's rows of a block together, so that attention, reading one
// head's keys in order of position, reads a block front to back.
#pragma once

#include <cstdint>

namespace travelator {

// Index, in rows, of (block, KV head, position within the block).
inline int64_t kv_row(int64_t block, int64_t head, int64_t position, int64_t kv_heads, int64_t block_size) {
  return (block * kv_heads + head) * block_size + position;
}

}  // namespace travelator
