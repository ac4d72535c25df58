// The packed GGUF kernels (engine/execution/csrc/gguf_kernels.h) alone, without torch, so a test can build them
// with any CPU tier's flags, or for ARM64 with a cross compiler, and run them (under qemu on an x86 machine).
//
// gguf_kernel_driver IN OUT: IN holds cases one after another, each int32 qtype, rows, K, M, then the packed weight
// (rows x row_bytes) and the activations (M x K float32). For each, OUT gets y = x @ W^T through the decode path
// (M x rows float32), then every block dequantized (rows x K float32). The kernel's ISA name goes to stdout.

#include <cstdint>
#include <cstdio>
#include <vector>

#include "gguf_kernels.h"

using namespace shoal_gguf;

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
    return 2;
  }
  std::FILE* in = std::fopen(argv[1], "rb");
  std::FILE* out = std::fopen(argv[2], "wb");
  if (!in || !out) return 2;
  int32_t head[4];
  while (std::fread(head, sizeof head, 1, in) == 1) {
    const int qtype = head[0];
    const int64_t rows = head[1], K = head[2], M = head[3];
    const Format f = format_of(qtype);
    if (!f.block || K % f.block) return 3;
    const int64_t row_bytes = K / f.block * f.bytes, ng = K / 32;
    std::vector<uint8_t> w(rows * row_bytes);
    std::vector<float> x(M * K);
    if (std::fread(w.data(), 1, w.size(), in) != w.size() || std::fread(x.data(), 4, x.size(), in) != x.size())
      return 2;
    std::vector<QAct> q(M * K);
    std::vector<float> ds(M * ng * 2), y(M * rows), deq(rows * K);
    for (int64_t m = 0; m < M; ++m) quantize_row(&x[m * K], K, &q[m * K], &ds[m * ng * 2]);
    dot_rows(qtype, w.data(), row_bytes, 0, rows, QRows{q.data(), ds.data(), ng}, M, K, y.data(), rows);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < K / f.block; ++b)
        dequantize_block(qtype, &w[r * row_bytes + b * f.bytes], &deq[r * K + b * f.block]);
    std::fwrite(y.data(), 4, y.size(), out);
    std::fwrite(deq.data(), 4, deq.size(), out);
  }
  std::fclose(in);
  std::fclose(out);
  std::printf("%s\n", kIsa);
  return 0;
}
