// Work split over threads as it is done, not in equal shares up front: where one core runs
// slower than another (a virtual machine's cores shared with its neighbours, a core also
// taking interrupts), equal shares make every call wait for the slowest one's share.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace travelator {

// fn(begin, end) over [0, n) in pieces, each taken by whichever thread is free: about 8
// pieces a thread (enough to even out a slower core, few enough that taking one costs
// nothing next to its work), a multiple of min_step items each (a kernel that takes items
// side by side asks for whole groups of them). Which thread takes an item never changes its
// result: every kernel that uses this computes an output whole, in one piece. It runs on
// at::parallel_for, which carries an exception out of the parallel region.
template <typename Fn>
void dynamic_split(int64_t n, int64_t min_step, const Fn& fn) {
  const int64_t threads = at::get_num_threads();
  const int64_t step = (std::max<int64_t>(min_step, n / (8 * threads)) + min_step - 1) / min_step * min_step;
  if (threads == 1 || n <= step) {
    if (n > 0) fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker)
      for (int64_t i = next.fetch_add(step); i < n; i = next.fetch_add(step)) fn(i, std::min(n, i + step));
  });
}

}  // namespace travelator
