// Matmul against GGUF-quantized weights kept in their block format: y[M, N] = x[M, K] @ W[N, K]^T, where each
// row of W is K/block consecutive GGUF blocks (Q8_0, Q4_0, Q4_1: 32 weights; Q4_K, Q6_K: 256 weights).
//
// Decode-sized batches (M <= kSmallBatch) run one pass over the packed weight: each block is dequantized in
// registers (AVX2+FMA tier) or into a small L1 buffer (portable code the compiler vectorises) and multiplied
// into up to four activation rows at once, so the weight streams from memory once per four rows. The Q4_0/Q4_1
// paths factor the block offset out of the dot product: sum_j (q_j d + c) x_j = d sum_j q_j x_j + c sum_j x_j,
// with sum_j x_j computed once per activation block. Larger batches (prefill) dequantize a tile of rows at a
// time into float32 and use torch's GEMM, which is compute-bound there anyway.
//
// Block layouts (ggml's, little-endian; d/dmin/m are IEEE fp16):
//   Q8_0 (34 B): d, int8 q[32]                                  w = d q
//   Q4_0 (18 B): d, q[16] (low nibbles: weights 0-15, high: 16-31)  w = d (q - 8)
//   Q4_1 (20 B): d, m, q[16] (same nibble order)               w = d q + m
//   Q4_K (144 B): d, dmin, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32, q[128]; each 32 bytes of q
//                 hold two sub-blocks (low nibbles, then high)  w = d sc q - dmin mn
//   Q6_K (210 B): ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16] (one per 16 weights), d
//                                                               w = d sc (q - 32)

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHOAL_GGUF_AVX2 1
#endif

namespace {

constexpr int Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14;  // ggml's type ids
constexpr int64_t kSmallBatch = 16;  // above this, dequantize tiles and use torch's GEMM
constexpr int64_t kTileRows = 256;

struct Format {
  int block;  // weights per block
  int bytes;  // bytes per block
};

Format format_of(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "gguf kernel: unsupported GGML type id ", qtype, " (supported: Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q6_K=14)");
}

inline float half_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(v);
#else
  return c10::detail::fp16_ieee_to_fp32_value(v);
#endif
}

// The 6-bit scale and min of Q4_K sub-block j (0..7) from the 12 packed bytes.
inline void q4k_scale_min(int j, const uint8_t* s, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Dequantize one block into out[block].
void dequantize_block(int qtype, const uint8_t* b, float* out) {
  switch (qtype) {
    case Q8_0: {
      const float d = half_at(b);
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int j = 0; j < 32; ++j) out[j] = d * q[j];
      return;
    }
    case Q4_0:
    case Q4_1: {
      const float d = half_at(b);
      const float c = qtype == Q4_1 ? half_at(b + 2) : -8.0f * d;
      const uint8_t* q = b + (qtype == Q4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        out[j] = d * (q[j] & 0x0F) + c;
        out[j + 16] = d * (q[j] >> 4) + c;
      }
      return;
    }
    case Q4_K: {
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* q = b + 16;
      for (int j = 0; j < 8; j += 2) {
        int sc0, mn0, sc1, mn1;
        q4k_scale_min(j, scales, &sc0, &mn0);
        q4k_scale_min(j + 1, scales, &sc1, &mn1);
        const float d0 = d * sc0, m0 = dmin * mn0, d1 = d * sc1, m1 = dmin * mn1;
        for (int l = 0; l < 32; ++l) {
          out[j * 32 + l] = d0 * (q[l] & 0x0F) - m0;
          out[j * 32 + 32 + l] = d1 * (q[l] >> 4) - m1;
        }
        q += 32;
      }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int half = 0; half < 2; ++half) {
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          out[l] = d * sc[is] * q1;
          out[l + 32] = d * sc[is + 2] * q2;
          out[l + 64] = d * sc[is + 4] * q3;
          out[l + 96] = d * sc[is + 6] * q4;
        }
        out += 128;
        ql += 64;
        qh += 32;
        sc += 8;
      }
      return;
    }
  }
}

void dequantize_rows(int qtype, const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K, float* out) {
  const Format f = format_of(qtype);
  const int64_t nb = K / f.block;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b)
        dequantize_block(qtype, w + r * row_bytes + b * f.bytes, out + r * K + b * f.block);
  });
}

// ---------------------------------------------------------------------------------------------- portable path

// out[r] = dot(W row, x row r) for MR activation rows; each block dequantized once into an L1 buffer.
template <int MR>
void row_dot_portable(int qtype, Format f, const uint8_t* row, int64_t nb, const float* x, int64_t ldx, float* out) {
  alignas(64) float buf[256];
  float acc[MR] = {};
  for (int64_t b = 0; b < nb; ++b) {
    dequantize_block(qtype, row + b * f.bytes, buf);
    for (int r = 0; r < MR; ++r) {
      const float* xr = x + r * ldx + b * f.block;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int j = 0; j < f.block; ++j) s += buf[j] * xr[j];
      acc[r] += s;
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = acc[r];
}

// ------------------------------------------------------------------------------------------------ AVX2 path

#ifdef SHOAL_GGUF_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 bytes_to_float(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

// Blocks of 32 (Q8_0, Q4_0, Q4_1) dequantized in registers; xsum[r * nb + b] = sum of activation block b of row r.
template <int MR, int QT>
void row_dot_avx2(const uint8_t* row, int64_t nb, const float* x, int64_t ldx, const float* xsum, float* out) {
  constexpr int kBytes = QT == Q8_0 ? 34 : QT == Q4_1 ? 20 : 18;
  __m256 acc[MR];
  float offset[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm256_setzero_ps();
    offset[r] = 0.0f;
  }
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kBytes;
    const __m256 d = _mm256_set1_ps(half_at(blk));
    __m256 w0, w1, w2, w3;
    if constexpr (QT == Q8_0) {
      const uint8_t* q = blk + 2;
      w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
      w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8))));
      w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16))));
      w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 24))));
    } else {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == Q4_1 ? 4 : 2)));
      const __m128i lo = _mm_and_si128(raw, low4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
      w0 = bytes_to_float(lo);
      w1 = bytes_to_float(_mm_srli_si128(lo, 8));
      w2 = bytes_to_float(hi);
      w3 = bytes_to_float(_mm_srli_si128(hi, 8));
    }
    for (int r = 0; r < MR; ++r) {
      const float* xr = x + r * ldx + b * 32;
      __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xr));
      t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), t);
      t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), t);
      t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), t);
      acc[r] = _mm256_fmadd_ps(d, t, acc[r]);
    }
    if constexpr (QT != Q8_0) {
      const float c = QT == Q4_1 ? half_at(blk + 2) : -8.0f * half_at(blk);
      for (int r = 0; r < MR; ++r) offset[r] += c * xsum[r * nb + b];
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = hsum(acc[r]) + offset[r];
}
#endif

template <int MR>
void row_dot(int qtype, Format f, const uint8_t* row, int64_t nb, const float* x, int64_t ldx, const float* xsum,
             float* out) {
#ifdef SHOAL_GGUF_AVX2
  switch (qtype) {
    case Q8_0: return row_dot_avx2<MR, Q8_0>(row, nb, x, ldx, xsum, out);
    case Q4_0: return row_dot_avx2<MR, Q4_0>(row, nb, x, ldx, xsum, out);
    case Q4_1: return row_dot_avx2<MR, Q4_1>(row, nb, x, ldx, xsum, out);
  }
#endif
  (void)xsum;
  row_dot_portable<MR>(qtype, f, row, nb, x, ldx, out);
}

void check_weight(const torch::Tensor& w, int64_t qtype, int64_t K) {
  const Format f = format_of(qtype);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "gguf kernel: the packed weight must be a contiguous uint8 CPU tensor [rows, row_bytes]");
  TORCH_CHECK(K % f.block == 0, "gguf kernel: K=", K, " is not a multiple of the block size ", f.block);
  TORCH_CHECK(w.size(1) == K / f.block * f.bytes, "gguf kernel: rows of ", w.size(1), " bytes, but K=", K,
              " needs ", K / f.block * f.bytes);
}

torch::Tensor gguf_dequantize(const torch::Tensor& w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  auto out = torch::empty({w.size(0), K}, torch::kFloat32);
  dequantize_rows(static_cast<int>(qtype), w.data_ptr<uint8_t>(), w.size(1), w.size(0), K, out.data_ptr<float>());
  return out;
}

torch::Tensor gguf_matmul(const torch::Tensor& x_in, const torch::Tensor& w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 && x_in.size(1) == K,
              "gguf kernel: x must be a CPU tensor [M, ", K, "]");
  const auto x = x_in.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0), N = w.size(0), row_bytes = w.size(1);
  const int qt = static_cast<int>(qtype);
  const Format f = format_of(qtype);
  const int64_t nb = K / f.block;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (M > kSmallBatch) {  // prefill: tile-wise dequantize + GEMM; yt[N, M] so each tile's rows are contiguous
    auto yt = torch::empty({N, M}, torch::kFloat32);
    auto tile = torch::empty({std::min(kTileRows, N), K}, torch::kFloat32);
    for (int64_t n0 = 0; n0 < N; n0 += kTileRows) {
      const int64_t n = std::min(kTileRows, N - n0);
      auto t = tile.narrow(0, 0, n);
      dequantize_rows(qt, wp + n0 * row_bytes, row_bytes, n, K, t.data_ptr<float>());
      auto out = yt.narrow(0, n0, n);
      at::mm_out(out, t, x.t());
    }
    return yt.t().contiguous();
  }
  auto y = torch::empty({M, N}, torch::kFloat32);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> xsum(M * nb);  // activation block sums (the Q4_0/Q4_1 offset term)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.0f;
      for (int j = 0; j < f.block; ++j) s += xp[m * K + b * f.block + j];
      xsum[m * nb + b] = s;
    }
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    float out[4];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = wp + n * row_bytes;
      for (int64_t m = 0; m < M; m += 4) {
        const float* xm = xp + m * K;
        const float* sm = xsum.data() + m * nb;
        const int64_t mr = std::min<int64_t>(4, M - m);
        switch (mr) {
          case 4: row_dot<4>(qt, f, row, nb, xm, K, sm, out); break;
          case 3: row_dot<3>(qt, f, row, nb, xm, K, sm, out); break;
          case 2: row_dot<2>(qt, f, row, nb, xm, K, sm, out); break;
          default: row_dot<1>(qt, f, row, nb, xm, K, sm, out); break;
        }
        for (int64_t r = 0; r < mr; ++r) yp[(m + r) * N + n] = out[r];
      }
    }
  });
  return y;
}

std::string gguf_kernel_isa() {
#ifdef SHOAL_GGUF_AVX2
  return "avx2+fma (Q8_0/Q4_0/Q4_1 dequantized in registers; Q4_K/Q6_K through the portable block path)";
#else
  return "portable (blocks dequantized into L1, compiler-vectorised dot products)";
#endif
}

}  // namespace

TORCH_LIBRARY(shoal_cpu_gguf, m) {
  m.def("matmul(Tensor x, Tensor w, int qtype, int K) -> Tensor", &gguf_matmul);
  m.def("dequantize(Tensor w, int qtype, int K) -> Tensor", &gguf_dequantize);
  m.def("kernel_isa() -> str", &gguf_kernel_isa);
}
