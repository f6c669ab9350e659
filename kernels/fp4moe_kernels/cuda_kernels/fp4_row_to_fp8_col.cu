// FP4RowToFP8Col in CUDA C++: MXFP4 rows [M, K] -> per expert FP8 [K, Mp_e] (tokens contiguous), one power-of-two
// scale per (128 tokens, channel). The same conversion as fp4moe_kernels.triton_kernels.col (both equal
// fp4moe_kernels.reference.fp4_row_to_fp8_col bit for bit), written where Triton cannot place the data: Triton keeps
// one token per thread, so every per-channel maximum over 128 tokens is a cross-thread reduction; here each thread
// owns one packed byte column (two channels) of 32 tokens in registers, after a transpose through shared memory.
//
// Grid (K / 64, tiles); one block of 128 threads per tile of 128 tokens x 64 channels. The tile table (int32
// [tiles, 5]) is launchers.py's: first input row, valid rows (<= 128), the expert's padded offset P_e and padded
// length Mp_e (multiples of 128), the tile's first token inside the expert. Rows past the valid ones are zeros.
//
// Per element (E2M1 magnitude code c, sign, block code e): a nonzero element of a finite block (e < 255) has the
// key e + (c>>1) + 1; a channel's FP8 exponent is k = max(key) - 137 clamped to [-126, 127] (0 without nonzero
// finite elements). General path: the scaled value's float32 bits t << 22, t = c + 2e - 2 - 2k (- 1 for c = 1),
// exact, +-0 below 2**-12 (E4M3 rounds those to zero), NaN for e = 255, rounded by cvt.rn.satfinite.e4m3x2.
// Fast path (SWAR=true; every nonzero element of the channel lands on an E4M3 normal, d = e - 127 - k >= -5, and no
// block is NaN): the E4M3 byte is 4c + 8(d + 6) for c >= 2, 8(d + 6) for c = 1, 0 for c = 0, plus the sign, four
// tokens per 32-bit register.
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kTok = 128;             // tokens per tile (one FP8 scale group)
constexpr int kCh = 64;               // channels per tile
constexpr int kBytes = kCh / 2;       // packed bytes per token row
constexpr int kPitch = kTok / 4 + 1;  // shared-memory row pitch in 32-bit words (4 tokens each), +1 against conflicts

__device__ __forceinline__ float scaled(uint32_t nib, int e, int k) {
  const int c = nib & 7;
  const int t = c + 2 * e - 2 - 2 * k - (c == 1);
  uint32_t bits = (nib & 8u) << 28;
  if (c != 0 && t >= 230) bits |= static_cast<uint32_t>(t) << 22;
  if (e == 255) bits = 0x7FC00000u;
  return __uint_as_float(bits);
}

__device__ __forceinline__ int key_of(uint32_t c, int e) {
  return (c != 0 && e != 255) ? e + static_cast<int>(c >> 1) + 1 : 0;
}

__device__ __forceinline__ int exp_of(int key) { return key > 0 ? min(max(key - 137, -126), 127) : 0; }

__device__ __forceinline__ int col_max(int v) {  // over the four threads of a byte column (neighbouring lanes)
  v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  return max(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
}

__device__ __forceinline__ int col_min(int v) {
  v = min(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  return min(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
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

template <bool SWAR>
__global__ void __launch_bounds__(128) fp4_row_to_fp8_col(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                                                          uint8_t* __restrict__ o, float* __restrict__ os,
                                                          const int* __restrict__ tiles, int K) {
  __shared__ uint32_t sp[kBytes][kPitch];    // packed bytes, transposed: [byte column][tokens / 4]
  __shared__ uint32_t sc[kCh / 32][kPitch];  // UE8M0 codes, transposed: [block][tokens / 4]
  __shared__ uint32_t so[kCh][kPitch];       // E4M3 output: [channel][tokens / 4]
  const int tid = threadIdx.x;
  const int* tile = tiles + 5 * blockIdx.y;
  const int64_t row0 = tile[0], p_e = tile[2], mp_e = tile[3], tok0 = tile[4];
  const int valid = tile[1];
  const int64_t ch0 = static_cast<int64_t>(blockIdx.x) * kCh;

  // 1. one token row per thread: 32 packed bytes (two 16-byte loads) and two codes, into shared memory transposed
  uint4 a = make_uint4(0, 0, 0, 0), b = make_uint4(0, 0, 0, 0);
  uint32_t cd = 0;
  if (tid < valid) {
    const uint8_t* src = q + (row0 + tid) * (K / 2) + ch0 / 2;
    a = __ldg(reinterpret_cast<const uint4*>(src));
    b = __ldg(reinterpret_cast<const uint4*>(src + 16));
    cd = __ldg(reinterpret_cast<const uint16_t*>(s + (row0 + tid) * (K / 32) + ch0 / 32));
  }
  uint8_t* spb = reinterpret_cast<uint8_t*>(sp);
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int j = 0; j < kBytes; ++j) spb[j * kPitch * 4 + tid] = (w[j / 4] >> (8 * (j % 4))) & 0xFF;
  uint8_t* scb = reinterpret_cast<uint8_t*>(sc);
  scb[tid] = cd & 0xFF;
  scb[kPitch * 4 + tid] = cd >> 8;
  __syncthreads();

  // 2. thread (byte column j, token quarter tq): channels 2j, 2j+1 of tokens 32 tq .. 32 tq + 31
  const int j = tid >> 2, tq = tid & 3;
  uint32_t pw[8], cw[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    pw[i] = sp[j][tq * 8 + i];
    cw[i] = sc[j >> 4][tq * 8 + i];
  }
  int kl, kh;
  if (!SWAR) {
    general(pw, cw, so, j, tq, kl, kh);
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
    const int mlo = col_min(min(emin_lo & 0xFFFF, emin_lo >> 16)), mhi = col_min(min(emin_hi & 0xFFFF, emin_hi >> 16));
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
}

}  // namespace

// Launch on ``stream``: q [M, K/2] uint8, s [M, K/32] uint8, o (FP8 bytes, K x sum Mp_e), os float32
// [sum Mp_e / 128, K], tiles int32 [n_tiles, 5] (device pointers); K a multiple of 128. ``variant`` 0: general path
// only, 1: SWAR fast path with the general path for the columns that need it. Returns the launch's cudaError_t.
extern "C" int fp4moe_fp4_row_to_fp8_col(const void* q, const void* s, void* o, void* os, const void* tiles,
                                         int n_tiles, int K, int variant, void* stream) {
  if (n_tiles == 0) return 0;
  const dim3 grid(K / kCh, n_tiles);
  auto args = [&](auto kernel) {
    kernel<<<grid, 128, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const uint8_t*>(q), static_cast<const uint8_t*>(s), static_cast<uint8_t*>(o),
        static_cast<float*>(os), static_cast<const int*>(tiles), K);
  };
  if (variant == 0) args(fp4_row_to_fp8_col<false>); else args(fp4_row_to_fp8_col<true>);
  return static_cast<int>(cudaGetLastError());
}
