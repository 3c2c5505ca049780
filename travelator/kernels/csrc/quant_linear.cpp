// y = x W^T for a few rows of x against int8 or int4 weights kept quantized
// (``--quantization int8|int4``): a decode step of one or a few requests, which only streams
// the weights. Widening each weight to float costs three vector instructions per 16 weights,
// more than this CPU can issue while the bytes stream in; integer dot products
// (vpdpbusd: 64 multiply-adds of unsigned bytes by signed bytes into int32) cost one per 64
// weights, so the kernel multiplies integers and scales once per block of inputs.
//
// x is written exactly enough in integers: per row and block of inputs (the int4 group, or
// 128 inputs for int8), x ~ xs * xi with xi = round(x / xs) a 16-bit integer
// (|xi| <= 32512, xs = max |x| / 32512, an error under 2^-16 of the block's largest |x|:
// finer than bf16's own rounding of that element). Weights are unsigned bytes u (int8:
// u = q + 128; int4: the code, 0..15), so sum_k u xi is an exact int32 per block (AVX-512
// takes it as 256 sum_k u hi + sum_k u lo over xi's signed bytes, xi = 256 hi + lo; AVX2
// multiplies xi itself), and the block adds to the float sum:
//   int8 (w = scale[n] q):                 xs (sum u xi - 128 sum xi), times scale[n] at the end
//   int4 (w = (u - 8) s + z, per group):   xs (s (sum u xi - 8 sum xi) + z sum xi)
// where for e2m1 int4 weights (MXFP4) u is the code's level (quant_common.h), not the code.
//
// Layout, made at load by travelator/model/quant.py: output rows in tiles of 64 (4 blocks of
// 16, one per vector lane), a lane's 32 bits holding consecutive inputs of its row, so each
// block of inputs streams front to back:
//   int8 [N/64][K/4][4][16 lanes][4 bytes]: the bytes of inputs k..k+3
//   int4 [N/64][K/8][4][16 lanes][4 bytes]: byte j holds input k+j in its low nibble and
//        k+4+j in its high one
// A row's sums run over k in the same order whatever M is and however the rows are split
// over threads, so a row's result does not depend on the other rows of x.
//
// Built where the compiler targets AVX512-VNNI and AVX512-BW, or AVX2 (the same sums from
// vpmaddwd, see quant_tiles_avx2.h); the Python side dequantizes and calls torch's matmul
// elsewhere (quant_dequantize.cpp).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "dynamic_split.h"
#include "quant_common.h"
#include "quant_tiles_avx2.h"
#include "quant_tiles_avx512.h"

namespace {

using namespace travelator::quant;

#if defined(TRAVELATOR_QUANT_KERNEL)
// Every tile against every row of x, kRowsPerTile rows at a time (the tile stays in cache
// between), then 2 and 1; for one row of x (kPairTiles), two tiles at a time:
// tile(rows, tiles, t, m, out, stride, tile_out) with rows and tiles std::integral_constants,
// tile t + j's sums at out + j * tile_out.
template <typename scalar_t, typename TileFn>
at::Tensor run_tiles(const at::Tensor& x, int64_t N, int64_t n_tiles, TileFn tile) {
  using one = std::integral_constant<int64_t, 1>;
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  auto* yp = y.data_ptr<scalar_t>();
  const int64_t tile_out = M * kTileRows;
  // Where one row takes two tiles side by side, pieces of whole pairs.
  travelator::dynamic_split(n_tiles, kPairTiles && M == 1 ? 2 : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out_rows(2 * tile_out);
    float* out = out_rows.data();
    for (int64_t t = begin; t < end;) {
      int64_t tiles = 1;
      if constexpr (kPairTiles) {
        if (M == 1 && t + 1 < end) {
          tile(one{}, std::integral_constant<int64_t, 2>{}, t, 0, out, kTileRows, tile_out);
          tiles = 2;
        }
      }
      if (tiles == 1) {
        int64_t m = 0;
        for (; m + kRowsPerTile <= M; m += kRowsPerTile)
          tile(std::integral_constant<int64_t, kRowsPerTile>{}, one{}, t, m, out + m * kTileRows, kTileRows, tile_out);
        if constexpr (kRowsPerTile > 2) {
          if (m + 2 <= M) {
            tile(std::integral_constant<int64_t, 2>{}, one{}, t, m, out + m * kTileRows, kTileRows, tile_out);
            m += 2;
          }
        }
        if (m < M) tile(one{}, one{}, t, m, out + m * kTileRows, kTileRows, tile_out);
      }
      for (int64_t j = 0; j < tiles; ++j, ++t) {
        const int64_t n0 = t * kTileRows, n1 = std::min(N, n0 + kTileRows);
        const float* sums = out + j * tile_out;
        for (int64_t mm = 0; mm < M; ++mm)
          for (int64_t n = n0; n < n1; ++n) yp[mm * N + n] = static_cast<scalar_t>(sums[mm * kTileRows + n - n0]);
      }
    }
  });
  return y;
}

void check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.is_contiguous(),
              name, ": x must be contiguous bf16 or float32 [M, K]");
}

// x [M, K] bf16; packed uint8 [N_padded / 64, K_padded / 4, 4, 64] (K_padded: K rounded up to
// 128); scales float32 [N_padded]. Returns bf16 [M, N].
at::Tensor quant_linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N) {
  check_x(x, "quant_linear_int8");
  check_packed(packed, "quant_linear_int8");
  const int64_t n_tiles = packed.size(0), K_padded = packed.size(1) * 4, K = x.size(1);
  TORCH_CHECK(K_padded % kInt8Block == 0 && K <= K_padded && K_padded - K < kInt8Block, "quant_linear_int8: K does not match");
  TORCH_CHECK(N <= n_tiles * kTileRows && N > (n_tiles - 1) * kTileRows, "quant_linear_int8: N does not match");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n_tiles * kTileRows,
              "quant_linear_int8: scales must be float32 [N_padded]");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const int64_t tile_bytes = K_padded * kTileRows;
  return with_float_type(x.scalar_type(), [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const IntegerX xi = integer_x(x.data_ptr<scalar_t>(), x.size(0), K, K_padded, kInt8Block);
    return run_tiles<scalar_t>(x, N, n_tiles, [&](auto rows, auto tiles, int64_t t, int64_t m, float* out,
                                                  int64_t stride, int64_t tile_out) {
      tiles_int8<rows(), tiles()>(xi, m, w + t * tile_bytes, tile_bytes, s + t * kTileRows, out, stride, tile_out);
    });
  });
}

// x [M, K] bf16; packed uint8 [N_padded / 64, K / 8, 4, 64]; scales_zeros 16-bit (quant_common.h)
// [N_padded / 64, K / group, 2, 64]; codebook: quant_common.h's. Returns bf16 [M, N].
at::Tensor quant_linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                             int64_t group, int64_t N, int64_t codebook) {
  check_x(x, "quant_linear_int4");
  check_packed(packed, "quant_linear_int4");
  const bool e2m1 = check_codebook(codebook, "quant_linear_int4") == Codebook::kE2M1;
  const int64_t n_tiles = packed.size(0), K = x.size(1);
  TORCH_CHECK(group > 0 && group % 8 == 0, "quant_linear_int4: group must be a positive multiple of 8");
  TORCH_CHECK(packed.size(1) * 8 == K && K % group == 0, "quant_linear_int4: K does not match");
  TORCH_CHECK(N <= n_tiles * kTileRows && N > (n_tiles - 1) * kTileRows, "quant_linear_int4: N does not match");
  check_scales_zeros(scales_zeros, e2m1 ? Codebook::kE2M1 : Codebook::kUniform, "quant_linear_int4");
  TORCH_CHECK(scales_zeros.is_contiguous() && scales_zeros.dim() == 4 && scales_zeros.size(0) == n_tiles &&
              scales_zeros.size(1) == K / group && scales_zeros.size(2) == 2 && scales_zeros.size(3) == kTileRows,
              "quant_linear_int4: bad scales_zeros");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const void* sz = scales_zeros.data_ptr();
  const int64_t tile_bytes = K / 2 * kTileRows, tile_sz = K / group * 2 * kTileRows;
  return with_float_type(x.scalar_type(), [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const IntegerX xi = integer_x(x.data_ptr<scalar_t>(), x.size(0), K, K, group);
    return run_tiles<scalar_t>(x, N, n_tiles, [&](auto rows, auto tiles, int64_t t, int64_t m, float* out,
                                                  int64_t stride, int64_t tile_out) {
      if (e2m1)
        tiles_int4<rows(), tiles(), true>(xi, m, w + t * tile_bytes, tile_bytes,
                                          static_cast<const GroupParam<true>*>(sz) + t * tile_sz, tile_sz, out,
                                          stride, tile_out);
      else
        tiles_int4<rows(), tiles(), false>(xi, m, w + t * tile_bytes, tile_bytes,
                                           static_cast<const GroupParam<false>*>(sz) + t * tile_sz, tile_sz, out,
                                           stride, tile_out);
    });
  });
}

#endif  // TRAVELATOR_QUANT_KERNEL

}  // namespace

TORCH_LIBRARY_FRAGMENT(travelator, m) {
#if defined(TRAVELATOR_QUANT_KERNEL)
  m.def("quant_linear_int8(Tensor x, Tensor packed, Tensor scales, int N) -> Tensor");
  m.impl("quant_linear_int8", c10::DispatchKey::CPU, &quant_linear_int8);
  m.def("quant_linear_int4(Tensor x, Tensor packed, Tensor scales_zeros, int group, int N, int codebook=0) -> Tensor");
  m.impl("quant_linear_int4", c10::DispatchKey::CPU, &quant_linear_int4);
#endif
}
