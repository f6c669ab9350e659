// CPU check of fp4_row_to_fp8_col.cu's variant-2 fast path (no GPU needed): its per-thread code (stats_v2,
// encode_v2; prmt and the 16-bit-lane min / max have host versions) runs on whole byte columns (128 tokens, two
// channels, four threads of 32 tokens as on the device) and is compared with the scalar rule: the channel exponent
// from key_of / exp_of, the fast-path test of variant 1 (largest block code <= kTopFast instead of < 255), and
// every output byte equal to the exact scaled value (so E4M3 of it) wherever the fast path is taken; and the
// shared-memory staging of variants 2, 3 (load_rows4, stage_rows4) against that of variants 0, 1.
// Build and run: nvcc -std=c++17 -O2 -o check fp4_row_to_fp8_col_check.cu && ./check [columns]
#include "fp4_row_to_fp8_col.cu"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

namespace {

double e4m3_value(uint32_t b) {
  const int ef = (b >> 3) & 15, mt = b & 7;
  if (ef == 15 && mt == 7) return NAN;
  const double v = ef ? std::ldexp(1.0 + mt / 8.0, ef - 7) : std::ldexp(mt / 8.0, -6);
  return (b & 0x80) ? -v : v;
}

const double kE2M1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
long long g_fast = 0, g_general = 0, g_bad = 0;

// bytes[t]: packed byte of token t (low nibble channel 0, high nibble channel 1); codes[t]: its block code
void check_column(const uint8_t* bytes, const uint8_t* codes) {
  uint32_t pw[4][8], cw[4][8];
  for (int tq = 0; tq < 4; ++tq)
    for (int i = 0; i < 8; ++i) {
      pw[tq][i] = cw[tq][i] = 0;
      for (int t = 0; t < 4; ++t) {
        pw[tq][i] |= static_cast<uint32_t>(bytes[32 * tq + 4 * i + t]) << (8 * t);
        cw[tq][i] |= static_cast<uint32_t>(codes[32 * tq + 4 * i + t]) << (8 * t);
      }
    }
  uint32_t st[4][3];
  for (int tq = 0; tq < 4; ++tq) stats_v2(pw[tq], cw[tq], st[tq]);
  for (int lane = 1; lane <= 2; lane *= 2) {  // the kernel's butterfly over the four threads
    uint32_t nx[4][3];
    for (int tq = 0; tq < 4; ++tq)
      for (int f = 0; f < 3; ++f) {
        const uint32_t other = st[tq ^ lane][f];
        nx[tq][f] = f == 1 ? min16x2(st[tq][f], other) : max16x2(st[tq][f], other);
      }
    std::memcpy(st, nx, sizeof st);
  }
  for (int tq = 1; tq < 4; ++tq)
    if (std::memcmp(st[tq], st[0], sizeof st[0])) ++g_bad;  // every thread of the column holds the same
  const int kyl = st[0][0] & 0xFFFF, kyh = st[0][0] >> 16, mlo = st[0][1] & 0xFFFF, mhi = st[0][1] >> 16;
  const int top = std::max(st[0][2] & 0xFFFF, st[0][2] >> 16) >> 8;
  // the scalar rule (variant 1 / the general path)
  int rkl = 0, rkh = 0, rmlo = 0xFFFF, rmhi = 0xFFFF, rtop = 0;
  for (int t = 0; t < 128; ++t) {
    const int e = codes[t], cl = bytes[t] & 7, ch = (bytes[t] >> 4) & 7;
    rkl = std::max(rkl, key_of(cl, e));
    rkh = std::max(rkh, key_of(ch, e));
    if (cl) rmlo = std::min(rmlo, e);
    if (ch) rmhi = std::min(rmhi, e);
    rtop = std::max(rtop, e);
  }
  const int kl = exp_of(kyl), kh = exp_of(kyh), rl = exp_of(rkl), rh = exp_of(rkh);
  bool bad = top != rtop;
  const bool fast = top <= kTopFast && mlo >= kl + 122 && mhi >= kh + 122;
  const bool rfast = rtop < 255 && rmlo >= rl + 122 && rmhi >= rh + 122;
  if (rtop <= kTopFast) bad |= kl != rl || kh != rh || fast != rfast;
  if (fast) {
    bad |= !rfast;
    const uint32_t offs = fast_offsets_v2(kl, kh);
    for (int tq = 0; tq < 4; ++tq)
      for (int i = 0; i < 8; ++i) {
        uint32_t lo, hi;
        encode_v2(pw[tq][i], cw[tq][i], offs, lo, hi);
        for (int t = 0; t < 4; ++t) {
          const int tok = 32 * tq + 4 * i + t, e = codes[tok];
          for (int nib = 0; nib < 2; ++nib) {
            const uint32_t code = (bytes[tok] >> (4 * nib)) & 15, got = ((nib ? hi : lo) >> (8 * t)) & 0xFF;
            const double want = (code & 8 ? -1 : 1) * std::ldexp(kE2M1[code & 7], e - 127 - (nib ? kh : kl));
            const double v = e4m3_value(got);
            if (!(v == want) || std::signbit(v) != std::signbit(want)) bad = true;
          }
        }
      }
    ++g_fast;
  } else {
    ++g_general;
  }
  if (bad && g_bad++ < 5) {
    std::printf("mismatch: top %d/%d keys %d %d / %d %d mins %d %d / %d %d fast %d/%d\n", top, rtop, kyl, kyh, rkl,
                rkh, mlo, mhi, rmlo, rmhi, fast, rfast);
  }
}

// load_rows4 + stage_rows4 (variants 2, 3) against the one-row-per-thread staging of variants 0, 1
bool check_staging(std::mt19937_64& rng) {
  const int K = 256, rows = 300;
  static uint8_t q[rows * K / 2], sc[rows * K / 32];
  for (auto& b : q) b = static_cast<uint8_t>(rng());
  for (auto& b : sc) b = static_cast<uint8_t>(rng());
  bool ok = true;
  for (int n = 0; n < 2000; ++n) {
    const int valid = n % 3 ? 128 : static_cast<int>(rng() % 129), row0 = static_cast<int>(rng() % (rows - 127));
    const int tile[5] = {row0, valid, 0, 128, 0};
    const int64_t ch0 = 64 * static_cast<int64_t>(rng() % (K / 64));
    uint32_t sp_old[kBytes][kPitch] = {}, sp_new[kBytes][kPitch] = {}, sc_old[2][kPitch] = {}, sc_new[2][kPitch] = {};
    uint8_t* spb = reinterpret_cast<uint8_t*>(sp_old);
    uint8_t* scb = reinterpret_cast<uint8_t*>(sc_old);
    for (int tid = 0; tid < 128; ++tid) {
      for (int j = 0; j < kBytes; ++j)  // the byte stores of variants 0, 1
        spb[j * kPitch * 4 + tid] = tid < valid ? q[(row0 + tid) * (K / 2) + ch0 / 2 + j] : 0;
      for (int b = 0; b < 2; ++b)
        scb[b * kPitch * 4 + tid] = tid < valid ? sc[(row0 + tid) * (K / 32) + ch0 / 32 + b] : 0;
      uint2 r[4];
      uint32_t cd;
      load_rows4(q, sc, tile, tid, K, ch0, r, cd);
      stage_rows4(r, cd, tid, sp_new, reinterpret_cast<uint8_t*>(sc_new));
    }
    ok &= !std::memcmp(sp_old, sp_new, sizeof sp_old) && !std::memcmp(sc_old, sc_new, sizeof sc_old);
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const long long columns = argc > 1 ? std::atoll(argv[1]) : 200000;
  std::mt19937_64 rng(12345);
  uint8_t bytes[128], codes[128];
  // every packed byte under every block code, one token of a column whose other tokens vary
  for (int e0 = 0; e0 < 256; ++e0)
    for (int b0 = 0; b0 < 256; ++b0) {
      const int base = static_cast<int>(rng() % 255);
      for (int t = 0; t < 128; ++t) {
        bytes[t] = static_cast<uint8_t>(rng());
        codes[t] = static_cast<uint8_t>(std::min(254, std::max(0, base + static_cast<int>(rng() % 9) - 4)));
      }
      const int t0 = static_cast<int>(rng() % 128);
      bytes[t0] = static_cast<uint8_t>(b0);
      codes[t0] = static_cast<uint8_t>(e0);
      check_column(bytes, codes);
    }
  // random columns: a base code with a spread, zero nibbles, padding rows, rare special codes
  for (long long n = 0; n < columns; ++n) {
    const int base = static_cast<int>(rng() % 256), spread = static_cast<int>(rng() % 3 ? rng() % 6 : rng() % 24);
    const int pzero = static_cast<int>(rng() % 5), valid = rng() % 3 ? 128 : static_cast<int>(rng() % 129);
    const int special = static_cast<int>(rng() % 4);
    for (int t = 0; t < 128; ++t) {
      int e = base + static_cast<int>(rng() % (2 * spread + 1)) - spread;
      e = std::min(255, std::max(0, e));
      if (special == 0 && rng() % 64 == 0) e = static_cast<int>(rng() % 256);
      if (special == 1 && rng() % 128 == 0) e = 255;
      uint8_t b = static_cast<uint8_t>(rng());
      for (int nib = 0; nib < 2; ++nib)
        if (static_cast<int>(rng() % 4) < pzero) b &= nib ? 0x8F : 0xF8;  // zero magnitude, sign kept
      bytes[t] = t < valid ? b : 0;
      codes[t] = static_cast<uint8_t>(t < valid ? e : 0);
    }
    check_column(bytes, codes);
  }
  if (!check_staging(rng)) {
    std::printf("staging: load_rows4 + stage_rows4 differ from the byte stores\n");
    ++g_bad;
  }
  std::printf("columns: %lld fast, %lld general, %lld mismatches\n", g_fast, g_general, g_bad);
  return g_bad ? 1 : 0;
}
