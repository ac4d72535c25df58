// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) against GGUF-quantized weights kept in their block format, W one or more
// row segments (a fused QKV or gate/up projection is several GGUF tensors, maybe of different types), each
// [rows, K / block * bytes] uint8 as stored; rows past the segments (a vocabulary-parallel head's padding) are zero
// weights. The dot products are gguf_kernels.h, built for the process's CPU tier. Shared by the matmul op
// (layers/csrc/cpu_gguf.cpp) and the packed mixture-of-experts op (layers/csrc/cpu_moe.cpp).
//
// Decode-sized batches (M <= kSmallBatch) make one pass over the packed weight, the rows split across threads:
// the activations are quantized to 8-bit groups once (gguf_kernels.h says why and what it costs), each weight group
// is unpacked in registers once for up to four activation rows, and the rows ahead are prefetched. Larger batches
// (prefill) dequantize a tile of rows at a time into float32 and use torch's GEMM: exact up to summation order, and
// compute-bound there anyway. Scratch is thread-local and reused: a decode step allocates nothing here.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gguf_kernels.h"

namespace shoal_gguf {

constexpr int64_t kSmallBatch = 16;  // above this, dequantize tiles and use torch's GEMM
constexpr int64_t kTileRows = 256;
constexpr int64_t kChunkRows = 64;               // rows a thread computes before storing them
constexpr int64_t kMinBytesPerThread = 1 << 15;  // below this a thread's fork/join costs more than its rows

// One row segment of a weight.
struct Segment {
  const uint8_t* data;
  int64_t row_bytes, rows, first;  // first: its first row in the output
  int qtype;
};

// out[r] = block-by-block dequantization of row ids[r] (or r), float32 [rows, K].
inline void dequantize_rows(int qtype, const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K, float* out,
                            const int64_t* ids = nullptr) {
  const Format f = format_of(qtype);
  const int64_t nb = K / f.block;
  at::parallel_for(0, rows, std::max<int64_t>(1, kMinBytesPerThread / row_bytes), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = w + (ids ? ids[r] : r) * row_bytes;
      for (int64_t b = 0; b < nb; ++b) dequantize_block(qtype, row + b * f.bytes, out + r * K + b * f.block);
    }
  });
}

namespace detail {

// Columns [n0, n0 + n) of y from float results acc [M, n], plus the bias, in y's type.
template <typename T>
void store(const float* acc, int64_t M, int64_t n, int64_t n0, const float* bias, T* y, int64_t N) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < n; ++j) y[m * N + n0 + j] = static_cast<T>(acc[m * n + j] + (bias ? bias[n0 + j] : 0.0f));
}

// The decode path for rows [r0, r1) of the concatenated segments, kChunkRows at a time.
template <typename T>
void decode_rows(const std::vector<Segment>& segs, int64_t r0, int64_t r1, const QRows& a, int64_t M, int64_t K,
                 const float* bias, T* y, int64_t N) {
  float acc[kChunkRows * kSmallBatch];
  for (const Segment& s : segs) {
    const int64_t lo = std::max(r0, s.first), hi = std::min(r1, s.first + s.rows);
    for (int64_t n0 = lo; n0 < hi; n0 += kChunkRows) {
      const int64_t n = std::min(kChunkRows, hi - n0);
      dot_rows(s.qtype, s.data, s.row_bytes, n0 - s.first, n0 - s.first + n, a, M, K, acc, n);
      store(acc, M, n, n0, bias, y, N);
    }
  }
}

}  // namespace detail

// y [M, N] (T: float, at::BFloat16 or at::Half) = x [M, K] (float32, row-major) @ segments^T + bias (float [N] or
// null); rows [sum of segment rows, N) get the bias alone.
template <typename T>
void packed_matmul(const float* x, int64_t M, int64_t K, const std::vector<Segment>& segs, int64_t N,
                   const float* bias, T* y) {
  int64_t rows = 0;
  for (const Segment& s : segs) rows = std::max(rows, s.first + s.rows);
  if (M <= kSmallBatch) {
    thread_local std::vector<QAct> q;
    thread_local std::vector<float> ds;
    const int64_t ng = K / 32;
    q.resize(M * K);
    ds.resize(M * ng * 2);
    for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, &q[m * K], &ds[m * ng * 2]);
    const QRows a{q.data(), ds.data(), ng};
    const int64_t grain = std::max<int64_t>(4, kMinBytesPerThread / segs[0].row_bytes);
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      detail::decode_rows(segs, r0, r1, a, M, K, bias, y, N);
    });
  } else {
    thread_local at::Tensor tile;
    if (!tile.defined() || tile.numel() < kTileRows * K) tile = at::empty({kTileRows * K}, at::kFloat);
    const at::Tensor xf = at::from_blob(const_cast<float*>(x), {M, K}, at::kFloat);
    for (const Segment& s : segs)
      for (int64_t n0 = 0; n0 < s.rows; n0 += kTileRows) {
        const int64_t n = std::min(kTileRows, s.rows - n0);
        dequantize_rows(s.qtype, s.data + n0 * s.row_bytes, s.row_bytes, n, K, tile.data_ptr<float>());
        const at::Tensor part = at::mm(xf, tile.narrow(0, 0, n * K).view({n, K}).t());
        detail::store(part.data_ptr<float>(), M, n, s.first + n0, bias, y, N);
      }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = rows; n < N; ++n) y[m * N + n] = static_cast<T>(bias ? bias[n] : 0.0f);
}

}  // namespace shoal_gguf
