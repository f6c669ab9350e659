// FP4RowToFP8Col in CUDA C++: MXFP4 rows [M, K] -> per expert FP8 [K, Mp_e] (tokens contiguous), one power-of-two
// scale per (128 tokens, channel). The same conversion as fp4moe_kernels.triton_kernels.col (both equal
// fp4moe_kernels.reference.fp4_row_to_fp8_col bit for bit), written where Triton cannot place the data: Triton keeps
// one token per thread, so every per-channel maximum over 128 tokens is a cross-thread reduction; here each thread
// owns one packed byte column (two channels) of 32 tokens in registers, after a transpose through shared memory.
//
// Grid (K / 64, tiles / T); one block of 128 threads per T tiles of 128 tokens x 64 channels, one after the other
// (T = 1, or kTilesPerBlock for variants 3 and 5). The tile table (int32
// [tiles, 5]) is launchers.py's: first input row, valid rows (<= 128), the expert's padded offset P_e and padded
// length Mp_e (multiples of 128), the tile's first token inside the expert. Rows past the valid ones are zeros.
//
// Per element (E2M1 magnitude code c, sign, block code e): a nonzero element of a finite block (e < 255) has the
// key e + (c>>1) + 1; a channel's FP8 exponent is k = max(key) - 137 clamped to [-126, 127] (0 without nonzero
// finite elements). General path: the scaled value's float32 bits t << 22, t = c + 2e - 2 - 2k (- 1 for c = 1),
// exact, +-0 below 2**-12 (E4M3 rounds those to zero), NaN for e = 255, rounded by cvt.rn.satfinite.e4m3x2.
// Fast path (variants 1-5; every nonzero element of the channel lands on an E4M3 normal, d = e - 127 - k >= -5, and
// no block is NaN; variants 2-5 also need every block code <= 251): the E4M3 byte is 4c + 8(d + 6) for c >= 2,
// 8(d + 6) for c = 1, 0 for c = 0, plus the sign; variant 1 in 16-bit lanes, variants 2-5 by prmt lookups.
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kTok = 128;             // tokens per tile (one FP8 scale group)
constexpr int kCh = 64;               // channels per tile
constexpr int kBytes = kCh / 2;       // packed bytes per token row
constexpr int kPitch = kTok / 4 + 1;  // shared-memory row pitch in 32-bit words (4 tokens each), +1 against conflicts
constexpr int kTilesPerBlock = 4;     // variants 3, 5: tiles per block, the next one's loads in flight

__device__ __forceinline__ float scaled(uint32_t nib, int e, int k) {
  const int c = nib & 7;
  const int t = c + 2 * e - 2 - 2 * k - (c == 1);
  uint32_t bits = (nib & 8u) << 28;
  if (c != 0 && t >= 230) bits |= static_cast<uint32_t>(t) << 22;
  if (e == 255) bits = 0x7FC00000u;
  return __uint_as_float(bits);
}

__host__ __device__ __forceinline__ int key_of(uint32_t c, int e) {
  return (c != 0 && e != 255) ? e + static_cast<int>(c >> 1) + 1 : 0;
}

__host__ __device__ __forceinline__ int exp_of(int key) { return key > 0 ? min(max(key - 137, -126), 127) : 0; }

__device__ __forceinline__ int col_max(int v) {  // over the four threads of a byte column (neighbouring lanes)
  v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  return max(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
}

__device__ __forceinline__ int col_min(int v) {
  v = min(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  return min(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
}

// Byte permute and unsigned 16-bit-lane max / min, on the host too (fp4_row_to_fp8_col_check.cu runs the fast path
// of variant 2 on the CPU). Selector nibbles here never set bit 3 (prmt's sign-replicate mode).
__host__ __device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, sel);
#else
  const uint64_t x = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((x >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#endif
}

__host__ __device__ __forceinline__ uint32_t max16x2(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return __vmaxu2(a, b);
#else
  const uint32_t lo = (a & 0xFFFF) > (b & 0xFFFF) ? a & 0xFFFF : b & 0xFFFF;
  return lo | ((a >> 16) > (b >> 16) ? a >> 16 : b >> 16) << 16;
#endif
}

__host__ __device__ __forceinline__ uint32_t min16x2(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return __vminu2(a, b);
#else
  return ~max16x2(~a, ~b);
#endif
}

// Fast path, variant 2. One 16-bit half of a packed word (tokens a, b) with its sign bits cleared is a prmt
// selector [c lo a, c hi a, c lo b, c hi b]: one prmt looks a byte up for both channels of two tokens ("pair
// layout", bytes 0 and 2 channel 2j, bytes 1 and 3 channel 2j+1). Tables, byte c of (low word, high word):
constexpr uint32_t kNz0 = 0xFFFFFF00u, kNz1 = 0xFFFFFFFFu;  // 0xFF where c != 0
constexpr uint32_t kG0 = 0x02020100u, kG1 = 0x04040303u;    // key - e = (c >> 1) + 1, 0 for c = 0
constexpr uint32_t kT0 = 0x14100800u, kT1 = 0x24201C18u;    // the E4M3 byte of E2M1(c) * 2**-5, 0 for c = 0
constexpr int kTopFast = 251;                               // e + (c >> 1) + 1 fits a byte on the fast path

// One thread's 32 tokens x 2 channels, as 16-bit lanes (channel 2j, channel 2j+1): st[0] the largest key, st[1] the
// smallest block code holding a nonzero element (255 if none); st[2] the largest block code (both lanes e * 257).
// The keys are exact where the largest code is <= kTopFast (no carry between bytes); otherwise the fast path is
// not taken and they are not used. Combined over a column's four threads by max16x2 / min16x2.
__host__ __device__ __forceinline__ void stats_v2(const uint32_t* pw, const uint32_t* cw, uint32_t* st) {
  uint32_t klo = 0, khi = 0, mlo = 0xFFFFFFFFu, mhi = 0xFFFFFFFFu, top = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t m = pw[i] & 0x77777777u;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t sel = h ? m >> 16 : m;
      const uint32_t e2 = prmt(cw[i], 0, h ? 0x3322 : 0x1100);  // the two tokens' block codes, pair layout
      const uint32_t nz = prmt(kNz0, kNz1, sel);
      const uint32_t key = e2 + prmt(kG0, kG1, sel);
      // lanes (token a, token b); channel 2j+1 is the high byte of each lane, whose max / min the lanes' max / min
      // give whatever the low byte holds; channel 2j's bytes alone in their lanes
      klo = max16x2(klo, key & nz & 0x00FF00FFu);
      khi = max16x2(khi, key & nz);
      mlo = min16x2(mlo, (e2 | ~nz) & 0x00FF00FFu);
      mhi = min16x2(mhi, e2 | ~nz);
      top = max16x2(top, e2);
    }
  }
  // lanes (token a, token b) -> lanes (channel 2j, channel 2j+1): bytes 0, 2 of klo / mlo (bytes 1, 3 are 0), bytes
  // 1, 3 of khi / mhi
  st[0] = max16x2(prmt(klo, khi, 0x1510), prmt(klo, khi, 0x3732));
  st[1] = min16x2(prmt(mlo, mhi, 0x1510), prmt(mlo, mhi, 0x3732));
  st[2] = top;
}

// Per channel, 8 (-(k + 122) mod 16), in the pair layout's bytes.
__host__ __device__ __forceinline__ uint32_t fast_offsets_v2(int kl, int kh) {
  const uint32_t ol = static_cast<uint32_t>(-(kl + 122)) & 15, oh = static_cast<uint32_t>(-(kh + 122)) & 15;
  return ((ol << 3) | (oh << 11)) * 0x00010001u;
}

// The fast path's E4M3 bytes of one packed word (4 tokens x 2 channels) -> lo, hi (4 tokens of channel 2j, 2j+1):
// E4M3(E2M1(c) * 2**-5) + 8 (e - 122 - k), the sum <= 124, with 0 <= e - 122 - k <= 14 (taken mod 16) for every
// nonzero element of a channel on the fast path; zero elements give 0; then the sign bits (packed bits 3 and 7 of
// each byte) move to bit 7 of the output bytes.
__host__ __device__ __forceinline__ void encode_v2(uint32_t pw, uint32_t cw, uint32_t offs, uint32_t& lo,
                                                   uint32_t& hi) {
  const uint32_t m = pw & 0x77777777u, y8 = (cw << 3) & 0x78787878u;
  uint32_t r[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t sel = h ? m >> 16 : m;
    const uint32_t x = (prmt(y8, 0, h ? 0x3322 : 0x1100) + offs) & prmt(kNz0, kNz1, sel) & 0x78787878u;
    r[h] = x + prmt(kT0, kT1, sel);
  }
  lo = prmt(r[0], r[1], 0x6420) | ((pw << 4) & 0x80808080u);
  hi = prmt(r[0], r[1], 0x7531) | (pw & 0x80808080u);
}

// General path for one thread's 32 tokens x 2 channels -> so rows 2j, 2j+1; returns the exponents through kl, kh.
__device__ __forceinline__ void general(const uint32_t* pw, const uint32_t* cw, uint32_t (*so)[kPitch], int j, int tq,
                                        int& kl, int& kh) {
  int klo = 0, khi = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const uint32_t byte = (pw[i] >> (8 * t)) & 0xFF;
      const int e = (cw[i] >> (8 * t)) & 0xFF;
      klo = max(klo, key_of(byte & 7, e));
      khi = max(khi, key_of((byte >> 4) & 7, e));
    }
  }
  kl = exp_of(col_max(klo));
  kh = exp_of(col_max(khi));
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int t = 0; t < 4; t += 2) {
      const uint32_t b0 = (pw[i] >> (8 * t)) & 0xFF, b1 = (pw[i] >> (8 * t + 8)) & 0xFF;
      const int e0 = (cw[i] >> (8 * t)) & 0xFF, e1 = (cw[i] >> (8 * t + 8)) & 0xFF;
      // .x = the earlier token = the low byte of the pair
      const uint32_t pl = __nv_cvt_float2_to_fp8x2(make_float2(scaled(b0, e0, kl), scaled(b1, e1, kl)),
                                                    __NV_SATFINITE, __NV_E4M3);
      const uint32_t ph = __nv_cvt_float2_to_fp8x2(make_float2(scaled(b0 >> 4, e0, kh), scaled(b1 >> 4, e1, kh)),
                                                    __NV_SATFINITE, __NV_E4M3);
      lo |= pl << (8 * t);
      hi |= ph << (8 * t);
    }
    so[2 * j][tq * 8 + i] = lo;
    so[2 * j + 1][tq * 8 + i] = hi;
  }
}

// One token row per thread: 32 packed bytes (two 16-byte loads) and two codes; zeros past the tile's valid rows.
__device__ __forceinline__ void load_row(const uint8_t* q, const uint8_t* s, const int* tile, int tid, int K,
                                         int64_t ch0, uint4& a, uint4& b, uint32_t& cd) {
  a = b = make_uint4(0, 0, 0, 0);
  cd = 0;
  if (tid < tile[1]) {
    const int64_t row = tile[0] + tid;
    const uint8_t* src = q + row * (K / 2) + ch0 / 2;
    a = __ldg(reinterpret_cast<const uint4*>(src));
    b = __ldg(reinterpret_cast<const uint4*>(src + 16));
    cd = __ldg(reinterpret_cast<const uint16_t*>(s + row * (K / 32) + ch0 / 32));
  }
}

template <typename X>
__host__ __device__ __forceinline__ X ldg(const X* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

// Variants 2, 3: four token rows per thread (tokens 4g .. 4g + 3, g = tid / 4), bytes 8q .. 8q + 7 of each (byte
// columns, q = tid % 4; 8-byte loads, a warp's load reads 8 whole 32-byte rows), and the two codes of token tid.
__host__ __device__ __forceinline__ void load_rows4(const uint8_t* q, const uint8_t* s, const int* tile, int tid,
                                                    int K, int64_t ch0, uint2* r, uint32_t& cd) {
  const int g = tid >> 2, qq = tid & 3;
  const uint8_t* src = q + static_cast<int64_t>(tile[0] + 4 * g) * (K / 2) + ch0 / 2 + 8 * qq;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    r[t] = make_uint2(0, 0);
    if (4 * g + t < tile[1]) r[t] = ldg(reinterpret_cast<const uint2*>(src + t * (K / 2)));
  }
  cd = 0;  // int32 offset: col_input_problem keeps the scales under 2**31 bytes (64-bit math here spilled at B = 5)
  if (tid < tile[1]) cd = ldg(reinterpret_cast<const uint16_t*>(s + (tile[0] + tid) * (K / 32) + ch0 / 32));
}

// ... into shared memory as load_row + the byte stores of variants 0, 1 put them: two 4 x 4 byte transposes (prmt)
// give the words [byte column 8q + jj][tokens 4g .. 4g + 3]; with the pitch of 33 words a warp's stores hit 32
// different banks.
__host__ __device__ __forceinline__ void stage_rows4(const uint2* r, uint32_t cd, int tid, uint32_t (*sp)[kPitch],
                                                     uint8_t* scb) {
  const int g = tid >> 2, qq = tid & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t w0 = h ? r[0].y : r[0].x, w1 = h ? r[1].y : r[1].x, w2 = h ? r[2].y : r[2].x,
                   w3 = h ? r[3].y : r[3].x;
    const uint32_t a_lo = prmt(w0, w1, 0x5140), a_hi = prmt(w0, w1, 0x7362);  // [w0.0 w1.0 w0.1 w1.1], bytes 2, 3
    const uint32_t b_lo = prmt(w2, w3, 0x5140), b_hi = prmt(w2, w3, 0x7362);
    sp[8 * qq + 4 * h + 0][g] = prmt(a_lo, b_lo, 0x5410);
    sp[8 * qq + 4 * h + 1][g] = prmt(a_lo, b_lo, 0x7632);
    sp[8 * qq + 4 * h + 2][g] = prmt(a_hi, b_hi, 0x5410);
    sp[8 * qq + 4 * h + 3][g] = prmt(a_hi, b_hi, 0x7632);
  }
  scb[tid] = cd & 0xFF;
  scb[kPitch * 4 + tid] = cd >> 8;
}

// V 0: general path only, 1: SWAR fast path (16-bit lanes), 2: prmt fast path (pair layout). T tiles (rows
// blockIdx.y * T ...) per block, one after the other; with T > 1 the next tile's loads are issued before this tile's
// conversion, so that they are in flight while it computes and stores. B: blocks per SM that ptxas must allow
// (registers <= 65536 / (128 B)); 0 leaves the registers to ptxas (77 to 128 here: 4 blocks per SM).
template <int V, int T, int B>
__global__ void __launch_bounds__(128, B)
    fp4_row_to_fp8_col(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s, uint8_t* __restrict__ o,
                       float* __restrict__ os, const int* __restrict__ tiles, int n_tiles, int K) {
  __shared__ uint32_t sp[kBytes][kPitch];    // packed bytes, transposed: [byte column][tokens / 4]
  __shared__ uint32_t sc[kCh / 32][kPitch];  // UE8M0 codes, transposed: [block][tokens / 4]
  __shared__ uint32_t so[kCh][kPitch];       // E4M3 output: [channel][tokens / 4]
  const int tid = threadIdx.x;
  const int64_t ch0 = static_cast<int64_t>(blockIdx.x) * kCh;
  int y = blockIdx.y * T;
  const int y_end = min(y + T, n_tiles);
  int tile[5], next[5];
#pragma unroll
  for (int f = 0; f < 5; ++f) tile[f] = __ldg(tiles + 5 * y + f);
  uint4 a, b;  // variants 0, 1
  uint2 r4[4];  // variants 2, 3
  uint32_t cd;
  if (V < 2) load_row(q, s, tile, tid, K, ch0, a, b, cd);
  else load_rows4(q, s, tile, tid, K, ch0, r4, cd);
  for (bool more = true; more;) {
    more = T > 1 && y + 1 < y_end;
    if (more) {
#pragma unroll
      for (int f = 0; f < 5; ++f) next[f] = __ldg(tiles + 5 * (y + 1) + f);
    }
    const int64_t p_e = tile[2], mp_e = tile[3], tok0 = tile[4];

    // 1. the loaded rows into shared memory, transposed
    uint8_t* scb = reinterpret_cast<uint8_t*>(sc);
    if (V < 2) {
      uint8_t* spb = reinterpret_cast<uint8_t*>(sp);
      const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int j = 0; j < kBytes; ++j) spb[j * kPitch * 4 + tid] = (w[j / 4] >> (8 * (j % 4))) & 0xFF;
      scb[tid] = cd & 0xFF;
      scb[kPitch * 4 + tid] = cd >> 8;
    } else {
      stage_rows4(r4, cd, tid, sp, scb);
    }
    __syncthreads();
    if (more) {  // the next tile's rows: in flight during 2. and 3.
      if (V < 2) load_row(q, s, next, tid, K, ch0, a, b, cd);
      else load_rows4(q, s, next, tid, K, ch0, r4, cd);
    }

    // 2. thread (byte column j, token quarter tq): channels 2j, 2j+1 of tokens 32 tq .. 32 tq + 31
    const int j = tid >> 2, tq = tid & 3;
    uint32_t pw[8], cw[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      pw[i] = sp[j][tq * 8 + i];
      cw[i] = sc[j >> 4][tq * 8 + i];
    }
    int kl, kh;
    if (V == 0) {
      general(pw, cw, so, j, tq, kl, kh);
    } else if (V == 2) {
      uint32_t st[3];
      stats_v2(pw, cw, st);
#pragma unroll
      for (int f = 0; f < 3; ++f) {  // over the four threads of the column, both channels at once
#pragma unroll
        for (int lane = 1; lane <= 2; lane *= 2) {
          const uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, st[f], lane);
          st[f] = f == 1 ? min16x2(st[f], other) : max16x2(st[f], other);
        }
      }
      kl = exp_of(st[0] & 0xFFFF);
      kh = exp_of(st[0] >> 16);
      const int mlo = st[1] & 0xFFFF, mhi = st[1] >> 16, top = max(st[2] & 0xFFFF, st[2] >> 16) >> 8;
      if (__all_sync(0xFFFFFFFFu, top <= kTopFast && mlo >= kl + 122 && mhi >= kh + 122)) {  // warp-uniform
        const uint32_t offs = fast_offsets_v2(kl, kh);
#pragma unroll
        for (int i = 0; i < 8; ++i) encode_v2(pw[i], cw[i], offs, so[2 * j][tq * 8 + i], so[2 * j + 1][tq * 8 + i]);
      } else {
        general(pw, cw, so, j, tq, kl, kh);
      }
    } else {
      // keys and the smallest block code holding a nonzero element, per channel: two tokens per 16-bit lane
      // (VIMNMX.U16x2 is one instruction); a lane's key e + (c>>1) + 1 <= 259 fits
      uint32_t kmax_lo = 0, kmax_hi = 0, emin_lo = 0xFFFFFFFFu, emin_hi = 0xFFFFFFFFu, emax = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t p = (pw[i] >> (8 * half)) & 0x00FF00FFu, e = (cw[i] >> (8 * half)) & 0x00FF00FFu;
          emax = __vmaxu2(emax, e);
#pragma unroll
          for (int nib = 0; nib < 2; ++nib) {
            const uint32_t c = (p >> (4 * nib)) & 0x00070007u;
            const uint32_t nzm = (((c + 0x7FFF7FFFu) & 0x80008000u) >> 15) * 0xFFFFu;  // 0xFFFF where c != 0
            const uint32_t key = (e + ((c >> 1) & 0x00030003u) + 0x00010001u) & nzm;
            if (nib == 0) {
              kmax_lo = __vmaxu2(kmax_lo, key);
              emin_lo = __vminu2(emin_lo, e | ~nzm);
            } else {
              kmax_hi = __vmaxu2(kmax_hi, key);
              emin_hi = __vminu2(emin_hi, e | ~nzm);
            }
          }
        }
      }
      kl = exp_of(col_max(max(kmax_lo & 0xFFFF, kmax_lo >> 16)));
      kh = exp_of(col_max(max(kmax_hi & 0xFFFF, kmax_hi >> 16)));
      const int mlo = col_min(min(emin_lo & 0xFFFF, emin_lo >> 16));
      const int mhi = col_min(min(emin_hi & 0xFFFF, emin_hi >> 16));
      const int top = col_max(max(emax & 0xFFFF, emax >> 16));
      // warp-uniform (general() shuffles across the whole warp): the fast path where all eight columns of the warp
      // qualify
      if (__all_sync(0xFFFFFFFFu, top < 255 && mlo >= kl + 122 && mhi >= kh + 122)) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const uint32_t ce = cw[i] & 0x00FF00FFu, co = (cw[i] >> 8) & 0x00FF00FFu;
#pragma unroll
          for (int nib = 0; nib < 2; ++nib) {
            const uint32_t kk = static_cast<uint32_t>(121 + (nib ? kh : kl)) * 0x00010001u;
            // 8(e - 121 - k) = 8(d + 6) per token, in 16-bit lanes kept from borrowing by 256; zeros are masked below
            const uint32_t be = ((ce + 0x01000100u - kk) << 3) & 0x00FF00FFu;
            const uint32_t bo = ((co + 0x01000100u - kk) << 3) & 0x00FF00FFu;
            const uint32_t c4 = (pw[i] >> (4 * nib)) & 0x07070707u;
            const uint32_t sel = __byte_perm(c4 | (c4 >> 4), 0, 0x4420);      // the four codes as selector nibbles
            const uint32_t m4c = __byte_perm(0x0C080000u, 0x1C181410u, sel);  // 4c for c >= 2, else 0
            const uint32_t nzm = __byte_perm(0xFFFFFF00u, 0xFFFFFFFFu, sel);  // 0xFF where c != 0
            const uint32_t sign = nib ? (pw[i] & 0x80808080u) : ((pw[i] & 0x08080808u) << 4);
            so[2 * j + nib][tq * 8 + i] = (m4c + ((be | (bo << 8)) & nzm)) | sign;
          }
        }
      } else {
        general(pw, cw, so, j, tq, kl, kh);
      }
    }
    if (tq == 0) {
      float* dst = os + ((p_e + tok0) / kTok) * K + ch0 + 2 * j;
      dst[0] = __uint_as_float(static_cast<uint32_t>(kl + 127) << 23);
      dst[1] = __uint_as_float(static_cast<uint32_t>(kh + 127) << 23);
    }
    __syncthreads();

    // 3. 64 channel rows of 128 bytes, 16 bytes per thread: 8 threads per row, 16 rows per pass
    uint8_t* dst = o + K * p_e + tok0;
#pragma unroll
    for (int pass = 0; pass < kCh / 16; ++pass) {
      const int r = pass * 16 + (tid >> 3), part = tid & 7;
      const uint32_t* src = &so[r][part * 4];
      *reinterpret_cast<uint4*>(dst + (ch0 + r) * mp_e + part * 16) = make_uint4(src[0], src[1], src[2], src[3]);
    }
    if (more) {
#pragma unroll
      for (int f = 0; f < 5; ++f) tile[f] = next[f];
      ++y;
    }
  }
}

}  // namespace

// Launch on ``stream``: q [M, K/2] uint8, s [M, K/32] uint8, o (FP8 bytes, K x sum Mp_e), os float32
// [sum Mp_e / 128, K], tiles int32 [n_tiles, 5] (device pointers); K a multiple of 128. ``variant`` 0: general path
// only, 1: SWAR fast path with the general path for the columns that need it, 2: the same split with the prmt fast
// path (fewer instructions), 3: variant 2 with kTilesPerBlock tiles per block (loads of the next tile in flight
// during the conversion of this one), 4 and 5: variants 2 and 3 held to 96 registers (5 blocks per SM instead of
// 4). Returns the launch's cudaError_t.
extern "C" int fp4moe_fp4_row_to_fp8_col(const void* q, const void* s, void* o, void* os, const void* tiles,
                                         int n_tiles, int K, int variant, void* stream) {
  if (n_tiles == 0) return 0;
  auto launch = [&](auto kernel, int per_block) {
    const dim3 grid(K / kCh, (n_tiles + per_block - 1) / per_block);
    kernel<<<grid, 128, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const uint8_t*>(q), static_cast<const uint8_t*>(s), static_cast<uint8_t*>(o),
        static_cast<float*>(os), static_cast<const int*>(tiles), n_tiles, K);
  };
  switch (variant) {
    case 0: launch(fp4_row_to_fp8_col<0, 1, 0>, 1); break;
    case 1: launch(fp4_row_to_fp8_col<1, 1, 0>, 1); break;
    case 2: launch(fp4_row_to_fp8_col<2, 1, 0>, 1); break;
    case 3: launch(fp4_row_to_fp8_col<2, kTilesPerBlock, 0>, kTilesPerBlock); break;
    case 4: launch(fp4_row_to_fp8_col<2, 1, 5>, 1); break;
    default: launch(fp4_row_to_fp8_col<2, kTilesPerBlock, 5>, kTilesPerBlock); break;
  }
  return static_cast<int>(cudaGetLastError());
}
