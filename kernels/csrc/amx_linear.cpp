// y = x W^T + b for a few dozen rows of bf16 x (batched decode: one token of each of 5 to
// 32 requests) and a plain bf16 weight [N, K], by AMX tiles. At these row counts a
// decode step should cost what reading its weights costs; oneDNN's matmul on its packed
// copy often streamed them at half the machine's bandwidth or less (measured in the
// engine), and AVX512-BF16 dot products would be bound by arithmetic from ~16 rows on.
// One AMX tile product is 16 x 16 x 32 multiply-adds, so the arithmetic is no limit.
//
// The weight is the tiles' left operand, read in place: 16 weight rows x 32 inputs a tile,
// straight from the plain layout (a row stride of K), so no repacked copy is kept and the
// tied output head (the embedding matrix) takes the same path. x, a few dozen rows, is
// rearranged once per call into the right operand's layout (pairs of inputs side by side
// for 16 rows of x: VNNI), so each product gives y^T for 16 weight rows x 16 rows of x.
// Each thread streams its own band of weight rows, 32 at a time (two left tiles, four
// accumulators), the band's rows reread from L2 for every further 32 rows of x.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define VLMSERVE_AMX 1
#endif

#include "kernels.h"

namespace {

constexpr int64_t kMaxRows = 64;  // rows of x per call (kernels/linear.py uses it up to 32: measured)
constexpr int64_t kTile = 16;     // rows of a tile (weight rows or rows of x)
constexpr int64_t kDepth = 32;    // inputs per tile (64 bytes of bf16)
constexpr int64_t kBlock = 32;    // weight rows per inner step (two left tiles)
// The block's weight rows are asked for this many steps (64 bytes each) ahead, into L1.
// Measured on a 3B model's matrices (an AMX Xeon, 2 threads), the whole model's time
// at 8-32 rows: 2-4 steps ahead into L1 near the GEMV's bandwidth at 8-16 rows and 1.2x
// it at 32; 8-12 steps ahead 2-8% slower; no prefetch 5-10% slower; 8-16 steps ahead into
// L2 only (a row of 2048 bf16 is 4 KB, so a block's rows share one L1 set) 10-25% slower.
constexpr int64_t kPrefetchSteps = 4;

#ifdef VLMSERVE_AMX
// Linux gives a process the AMX register state only once it asks (once per process).
bool request_amx() {
  static const bool granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: accumulators y^T [16 weight rows][16 rows of x] fp32 (weight half i, x half j
// at 2i + j); 4-5: the weight's halves; 6-7: the two halves of x.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTile;
  }
  _tile_loadconfig(&cfg);
}

// y^T of one block: weight rows [n, n + 32) against XTiles tiles of 16 rows of x from tile
// m_tile0, into y as [weight half][x half][16][16] fp32; xb is x in the right operand's
// layout: [Mpad / 16][K / 32][16 input pairs][16 rows of x][2].
template <int XTiles>
void block_products(const uint16_t* w, int64_t K, const uint16_t* xb, int64_t m_tile0, int64_t n, float* y) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride = K * 2;  // bytes between weight rows
  const int64_t depth_tiles = K / kDepth;
  const uint16_t* x0 = xb + m_tile0 * depth_tiles * kTile * kDepth;
  const uint16_t* x1 = x0 + depth_tiles * kTile * kDepth;
  for (int64_t kt = 0; kt < depth_tiles; ++kt) {
    const uint16_t* wk = w + n * K + kt * kDepth;
    // near a row's end this fetches the next row's start (or past the weight): harmless
    const uint16_t* ahead = wk + kPrefetchSteps * kDepth;
    for (int r = 0; r < kBlock; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * K), _MM_HINT_T0);
    // Tiles are not renamed: a load waits until the products before it that read the
    // tile are done. So both products of the first weight half come first, and its next
    // load can start while the second half's run (with the x rows moved on both threads and
    // y written row by row: a 3B model's matrices at 32 rows 8-20% less time, 16 rows 0-11%)
    _tile_loadd(4, wk, stride);
    _tile_loadd(6, x0 + kt * kTile * kDepth, 64);
    if (XTiles == 2) _tile_loadd(7, x1 + kt * kTile * kDepth, 64);
    _tile_loadd(5, wk + kTile * K, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (XTiles == 2) _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    if (XTiles == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, y, 64);
  _tile_stored(2, y + 2 * kTile * kTile, 64);
  if (XTiles == 2) {
    _tile_stored(1, y + kTile * kTile, 64);
    _tile_stored(3, y + 3 * kTile * kTile, 64);
  }
}
#endif

bool supported(const at::Tensor& x, const at::Tensor& weight) {
#ifdef VLMSERVE_AMX
  return x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
         weight.is_contiguous() && weight.size(0) % kBlock == 0 && weight.size(1) % kDepth == 0 &&
         x.size(-1) == weight.size(1) && x.numel() / x.size(-1) <= kMaxRows && request_amx();
#else
  return false;
#endif
}

bool amx_ready() {
#ifdef VLMSERVE_AMX
  return request_amx();
#else
  return false;
#endif
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(x, weight), "amx_linear: bf16 x of at most 64 rows, a contiguous bf16 weight [N, K] with N "
              "and K multiples of 32, on a CPU with AMX-BF16 that Linux lets this process use");
  const int64_t K = weight.size(1), N = weight.size(0);
  const int64_t M = x.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
#ifdef VLMSERVE_AMX
  const int64_t x_tiles = (M + kTile - 1) / kTile, depth_tiles = K / kDepth;
  // x as the right operand: each 32-bit pair of inputs of row m goes to [m/16][k/32][pair][m%16].
  // The buffer is kept between calls (a fresh one costs page faults on every step); the
  // padding rows of the last tile are left as they are: they only reach outputs not stored.
  static thread_local std::vector<uint32_t> xb;
  xb.resize(std::max<size_t>(xb.size(), x_tiles * kTile * K / 2));
  const at::Tensor xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  // on both threads: at 32 rows of the down projection (K = 11008) it is 176K moves
  uint32_t* xbp32 = xb.data();
  at::parallel_for(0, K / 2, 512, [&](int64_t p0, int64_t p1) {
    for (int64_t m = 0; m < M; ++m) {
      uint32_t* dst = xbp32 + (m / kTile) * depth_tiles * kTile * kDepth / 2 + m % kTile;
      const uint32_t* src = xp + m * K / 2;
      for (int64_t pair = p0; pair < p1; ++pair) dst[pair * kTile] = src[pair];
    }
  });
  const auto* xbp = reinterpret_cast<const uint16_t*>(xb.data());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* out = y.data_ptr<at::BFloat16>();
  const float* bp = nullptr;
  at::Tensor bias_f;
  if (bias.has_value()) {
    bias_f = bias->to(at::kFloat).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  at::parallel_for(0, N / kBlock, 1, [&](int64_t b0, int64_t b1) {
    configure_tiles();
    alignas(64) float acc[4 * kTile * kTile];  // y^T of one block: [weight half][x half][16][16]
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kBlock;
      for (int64_t mt = 0; mt < x_tiles; mt += 2) {
        const int pair = mt + 1 < x_tiles;
        if (pair)
          block_products<2>(wp, K, xbp, mt, n, acc);
        else
          block_products<1>(wp, K, xbp, mt, n, acc);
        for (int wi = 0; wi < 2; ++wi)
          for (int xj = 0; xj <= pair; ++xj) {
            const float* tile = acc + (2 * wi + xj) * kTile * kTile;
            const int64_t m0 = (mt + xj) * kTile, rows = std::min(kTile, M - m0), n0 = n + wi * kTile;
            float b[kTile];
            for (int64_t i = 0; i < kTile; ++i) b[i] = bp ? bp[n0 + i] : 0.0f;
            for (int64_t j = 0; j < rows; ++j) {  // each row of y: 16 outputs side by side
              at::BFloat16* y_row = out + (m0 + j) * N + n0;
              for (int64_t i = 0; i < kTile; ++i) y_row[i] = at::BFloat16(tile[i * kTile + j] + b[i]);
            }
          }
      }
    }
    _tile_release();
  });
#endif
  return y;
}

}  // namespace

VLMSERVE_EXPORT(amx_linear);
VLMSERVE_EXPORT(amx_ready);
