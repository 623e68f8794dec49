/* Native block-quantized matmul for streamed target layers.
 *
 * Why this exists: stock ONNX Runtime runs int4 fast only on prepacked
 * initializers, so a streamed layer costs a session build (a prepack) per pass.
 * These kernels compute straight from the GGUF block bytes as they arrive from
 * flash: no repack, no copy, and the bytes read equal the GGUF layer bytes.
 *
 * Numerics are batch- and thread-invariant by construction: output (i, j) is
 * computed by the same instruction sequence whatever the number of rows N or the
 * thread split (threads split the weight rows j, never the reduction), integer
 * partial sums are exact, and the float combination follows llama.cpp's AVX2
 * lanes in every path (SIMD and portable give the same bits). Build with
 * -ffp-contract=off so no FMA contraction changes the float order behind our back;
 * the fused multiply-adds llama.cpp's compiler makes are written out as fmaf.
 * One type has numerics of its own: Q4_0T, lever's requantized draft in strips for AMX tiles, sums
 * each 32-block's products as one integer and keeps one chain of fused adds per output (the AMX and
 * portable paths give the same bits; the draft only proposes, so no other path need match it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LEVER_AVX2 1
#endif
#if defined(LEVER_AVX2) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LEVER_AVX512 1
#endif
#if defined(LEVER_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define LEVER_AMX 1
#endif

enum { T_Q4_K = 0, T_Q6_K = 1, T_Q8_0 = 2, T_F32 = 3, T_Q5_0 = 4, T_Q5_0R = 5, T_Q4_0 = 6, T_Q4_0R = 7, T_Q4_0T = 8 };
/* T_Q5_0R: Q5_0 rows whose block pairs a resident model rearranged in place (q5_0_pair_repack).
 * T_Q4_0: the draft's matrices requantized at load (requantize_q4_0), never the target's; T_Q4_0R: those rows
 * with their block pairs rearranged like Q5_0R (AVX-512 builds, q32_pairs) */
/* T_Q4_0T: the draft's Q4_0 matrices in strips of 16 rows laid out for AMX tiles (see tile_q4_0) */
#define T_LAST T_Q4_0T
#define QK 256
#define KLANES 16 /* floats each K-quant output keeps per activation row until its final sum */
/* Activation rows the K-quant row kernels (AVX2 and AVX-512) take at once; more go KQ_MAX at a time over slices of
 * KQ_SLICE weight rows that stay in cache from one batch to the next. 4 held the integer lanes in
 * registers but doubled a fifth row's cost; 8 or 12 ran 5 to 8 rows 10-20% faster than the kernel
 * before, and 12 kept 9 to 16 rows level with it (8 lost 5% there). */
#define KQ_MAX 12
/* The AVX-512 row kernel takes a call whose activation rows (min(n, KQ_MAX) x k bytes) fit in L1 with
 * room; larger ones go through the grouped per-block loop. The target's ffn_down (k = 8960, one
 * thread, weights from DRAM): six rows 1.04-1.19x faster by the row kernel than grouped, eight 0.95-0.97x,
 * twelve 0.78-0.88x, 24 0.81-0.84x (its 1536-wide matrices gain at every row count: 1.15-1.59x). */
#define KQ_ROW_BYTES (64 * 1024)
_Static_assert(KQ_MAX == 12, "few_rows_kq has a case for each row count up to KQ_MAX");
/* Weight rows read ahead by software prefetch when a few activation rows stream each weight row:
 * the loops' long chains of fused adds leave the out-of-order core few loads in flight, and the
 * hardware prefetcher alone kept a 1-row matmul at a third of the memory bandwidth. */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 4
#endif

/* Activations carry one scale per group of QK columns. Rows of the 32-block types (Q8_0,
 * Q5_0, F32) need only be a multiple of 32 (the 0.5B draft's rows are 896 wide): their
 * last group is then partial, group_len() columns long. K-quant rows are whole groups. */
static inline int64_t n_groups(int64_t k) { return (k + QK - 1) / QK; }
static inline int64_t group_len(int64_t k, int64_t s) { return k - s * QK < QK ? k - s * QK : QK; }
static inline int is_kquant(int type) { return type == T_Q4_K || type == T_Q6_K; }
/* the 32-block types: one f16 scale per 32 weights */
static inline int is_q32(int type) { return type == T_Q8_0 || type == T_Q5_0 || type == T_Q5_0R || type == T_Q4_0 || type == T_Q4_0R; }
static inline int q32_block_bytes(int type) { return type == T_Q8_0 ? 34 : type == T_Q4_0 || type == T_Q4_0R ? 18 : 22; }

static float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#ifdef __F16C__
    return _cvtsh_ss(h); /* exact, like the portable code below */
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal: renormalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static size_t row_bytes(int type, int64_t k) {
    switch (type) {
    case T_Q4_K: return (size_t)(k / QK) * 144;
    case T_Q6_K: return (size_t)(k / QK) * 210;
    case T_Q8_0: return (size_t)(k / 32) * 34;
    case T_Q5_0:
    case T_Q5_0R: return (size_t)(k / 32) * 22;
    case T_Q4_0:
    case T_Q4_0R:
    case T_Q4_0T: return (size_t)(k / 32) * 18;
    default: return (size_t)k * 4;
    }
}

/* Bytes of one QK-column group of a weight row (eight 32-blocks for Q8_0 / Q5_0). */
static size_t group_bytes(int type) {
    return type == T_Q4_K ? 144 : type == T_Q6_K ? 210 : is_q32(type) ? 8 * q32_block_bytes(type) : QK * 4;
}

/* Q5_0R: each whole pair of blocks (2c, 2c + 1) of a QK-column group, 44 bytes, holds the same codes
 * and scales as the two Q5_0 blocks it replaces, laid out the way the SIMD kernels use them: 32 bytes
 * of low code nibbles in element order (block 2c's in the low nibbles, 2c + 1's in the high), the two
 * blocks' 64 fifth bits in 8 bytes, then the two f16 scales. Unpacking a pair then takes a handful of
 * instructions where the GGUF layout needs about a dozen a block (the draft's Q5_0 matmuls were half
 * its time, bound by that unpacking). A group's odd last block keeps its GGUF layout. The products and
 * sums are the same integers and floats: the same bits. The fifth bits' order is the build's:
 * - AVX-512: one 64-bit byte mask, bit e of block 2c's qh word at bit e (block 2c + 1's at bit 32 + e);
 * - AVX2: byte t holds the fifth bits of elements t, 8 + t, 16 + t, 24 + t of block 2c in bits 0-3 and
 *   of block 2c + 1 in bits 4-7, so the 8 bytes broadcast to every quadword and shifted per quadword
 *   (by 4 - Q left, or Q right, in quadword Q) bring each element's bit to bit 4 of its own byte.
 * Q5_0R lives only in memory (resident weights), so the two orders never meet. */
static inline uint64_t fifth_bits_pack(uint32_t h0, uint32_t h1) {
#ifdef LEVER_AVX512
    return (uint64_t)h0 | (uint64_t)h1 << 32;
#else
    uint64_t m = 0;
    for (int t = 0; t < 8; t++)
        for (int Q = 0; Q < 4; Q++)
            m |= (uint64_t)((h0 >> (8 * Q + t)) & 1) << (8 * t + Q) | (uint64_t)((h1 >> (8 * Q + t)) & 1) << (8 * t + 4 + Q);
    return m;
#endif
}

/* fifth_bits_pack undone: block 2c's qh word (h == 0) or block 2c + 1's (h == 1) */
static inline uint32_t fifth_bits_unpack(uint64_t m, int h) {
#ifdef LEVER_AVX512
    return (uint32_t)(m >> 32 * h);
#else
    uint32_t w = 0;
    for (int t = 0; t < 8; t++)
        for (int Q = 0; Q < 4; Q++) w |= (uint32_t)((m >> (8 * t + 4 * h + Q)) & 1) << (8 * Q + t);
    return w;
#endif
}

static void q5_0_pair_repack(uint8_t *p) {
    uint8_t t[44];
    const uint8_t *b0 = p, *b1 = p + 22;
    for (int j = 0; j < 32; j++) { /* element j < 16: low nibble of qs[j]; j >= 16: high nibble of qs[j - 16] */
        const int lo0 = j < 16 ? b0[6 + j] & 0xF : b0[6 + j - 16] >> 4;
        const int lo1 = j < 16 ? b1[6 + j] & 0xF : b1[6 + j - 16] >> 4;
        t[j] = (uint8_t)(lo0 | lo1 << 4);
    }
    uint32_t h0, h1;
    memcpy(&h0, b0 + 2, 4);
    memcpy(&h1, b1 + 2, 4);
    const uint64_t m = fifth_bits_pack(h0, h1);
    memcpy(t + 32, &m, 8);
    memcpy(t + 40, b0, 2);
    memcpy(t + 42, b1, 2);
    memcpy(p, t, 44);
}

/* The two GGUF Q5_0 blocks (44 bytes into b) of a repacked pair p: q5_0_pair_repack undone. */
static void q5_0_pair_unpack(const uint8_t *p, uint8_t *b) {
    uint64_t m;
    memcpy(&m, p + 32, 8);
    for (int h = 0; h < 2; h++) {
        uint8_t *o = b + 22 * h;
        const uint32_t qh = fifth_bits_unpack(m, h);
        memcpy(o, p + 40 + 2 * h, 2);
        memcpy(o + 2, &qh, 4);
        for (int j = 0; j < 16; j++)
            o[6 + j] = (uint8_t)(((p[j] >> 4 * h) & 0xF) | ((p[16 + j] >> 4 * h) & 0xF) << 4);
    }
}

/* Q4_0R: Q5_0R without fifth bits: a whole pair of a group's Q4_0 blocks, 36 bytes, is 32 bytes of
 * code nibbles in element order (block 2c's in the low nibbles, 2c + 1's in the high) and the two f16
 * scales, so a pair unpacks in three instructions (q4_0r_codes_512) instead of the GGUF layout's
 * eight. A group's odd last block keeps its GGUF layout. */
static void q4_0_pair_repack(uint8_t *p) {
    uint8_t t[36];
    const uint8_t *b0 = p, *b1 = p + 18;
    for (int j = 0; j < 32; j++) {
        const int lo0 = j < 16 ? b0[2 + j] & 0xF : b0[2 + j - 16] >> 4;
        const int lo1 = j < 16 ? b1[2 + j] & 0xF : b1[2 + j - 16] >> 4;
        t[j] = (uint8_t)(lo0 | lo1 << 4);
    }
    memcpy(t + 32, b0, 2);
    memcpy(t + 34, b1, 2);
    memcpy(p, t, 36);
}

static void q4_0_pair_unpack(const uint8_t *p, uint8_t *b) {
    for (int h = 0; h < 2; h++) {
        uint8_t *o = b + 18 * h;
        memcpy(o, p + 32 + 2 * h, 2);
        for (int j = 0; j < 16; j++)
            o[2 + j] = (uint8_t)(((p[j] >> 4 * h) & 0xF) | ((p[16 + j] >> 4 * h) & 0xF) << 4);
    }
}

/* Every whole block pair of n Q5_0 (Q4_0) rows of k columns, to Q5_0R (Q4_0R) in place, or back */
static void q32_pairs(int type, uint8_t *w, int64_t n, int64_t k, int to_repacked) {
    const size_t rb = row_bytes(type, k), bs = (size_t)q32_block_bytes(type);
    for (int64_t i = 0; i < n; i++)
        for (int64_t s = 0; s < n_groups(k); s++) {
            const int nb = (int)(group_len(k, s) / 32);
            for (int c = 0; c + 1 < nb; c += 2) {
                uint8_t *p = w + (size_t)i * rb + (size_t)s * 8 * bs + bs * (size_t)c;
                uint8_t b[44];
                if (to_repacked) {
                    if (type == T_Q4_0) q4_0_pair_repack(p);
                    else q5_0_pair_repack(p);
                } else {
                    if (type == T_Q4_0) q4_0_pair_unpack(p, b);
                    else q5_0_pair_unpack(p, b);
                    memcpy(p, b, 2 * bs);
                }
            }
        }
}

/* The 6-bit scales and mins of the eight 32-element sub-blocks of a Q4_K block. Scale j is the low 6 bits of s[j] (j < 4) or s[j + 4]'s low nibble under s[j - 4]'s top two bits;
 * mins likewise from s[4..7] and s[8..11]'s high nibbles. Computed four at a time in 32-bit words
 * (llama.cpp's kmask form): out holds the eight scales, then the eight mins. */
static inline void q4k_scales_mins16(const uint8_t *s, uint8_t *out) {
    uint32_t u[4];
    memcpy(u, s, 12);
    u[3] = ((u[2] >> 4) & 0x0F0F0F0Fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t mins_lo = u[1] & 0x3F3F3F3Fu;
    u[1] = (u[2] & 0x0F0F0F0Fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3F3F3F3Fu;
    memcpy(out, u, 16);
}

static void q4k_scale_min(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    uint8_t t[16];
    q4k_scales_mins16(s, t);
    memcpy(sc, t, 8);
    memcpy(mn, t + 8, 8);
}

/* ---------------------------------------------------------------- activations */

static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, int32_t *bsums) {
    for (int64_t s = 0; s < n_groups(k); s++) {
        const float *xs = x + s * QK;
        const int gl = (int)group_len(k, s);
        float amax = 0.0f;
        for (int e = 0; e < gl; e++) { float a = fabsf(xs[e]); if (a > amax) amax = a; }
        int8_t *qs = q + s * QK;
        if (amax == 0.0f) {
            memset(qs, 0, gl);
            d[s] = 0.0f;
        } else {
            float iscale = 127.0f / amax;
            for (int e = 0; e < gl; e++) {
                float v = nearbyintf(xs[e] * iscale);
                if (v > 127.0f) v = 127.0f;
                if (v < -127.0f) v = -127.0f;
                qs[e] = (int8_t)v;
            }
            d[s] = 1.0f / iscale; /* llama.cpp's q8_K: the scale is the reciprocal of the one applied */
        }
        for (int j = 0; j < QK / 16; j++) {
            int32_t t = 0;
            for (int e = 0; e < 16 && j * 16 + e < gl; e++) t += qs[j * 16 + e];
            bsums[s * (QK / 16) + j] = t;
        }
    }
}

/* ------------------------------------------------- int8 activation dot products
 * Each returns the exact integer part of one 256-block; the caller combines. */

/* The integer part of one K-quant block against 256 int8 activations, split in eight lanes
 * the way llama.cpp's AVX2 vec_dot splits it: lane l holds bytes 4l..4l+3 of every 32-element
 * run. Its float accumulation then follows those lanes, which is what keeps our greedy
 * output on llama.cpp's near-ties. The SIMD builds compute them in row_q4k_avx2 /
 * row_q6k_avx2 (and the AVX-512 kernels); lanes_q4k / lanes_q6k below are the portable build's. */
#if defined(LEVER_AVX2) && !defined(LEVER_AVX512)
/* Run c (32 bytes) of a Q4_K block's codes: its low nibbles and its high nibbles, 32 each. */
static inline void unpack_q4k_run_avx2(const uint8_t *qs, int c, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
}

/* Half h (128 codes) of a Q6_K block as four registers of 6-bit codes, before the -32 offset. */
static inline void unpack_q6k_half_avx2(const uint8_t *ql, const uint8_t *qh, int h, __m256i *q) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    const uint8_t *l = ql + 64 * h;
    const __m256i vl0 = _mm256_loadu_si256((const __m256i *)l), vl1 = _mm256_loadu_si256((const __m256i *)(l + 32));
    const __m256i vh = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(vl0, m4), _mm256_slli_epi16(_mm256_and_si256(vh, m2), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(vl1, m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(vh, 2), m2), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(vl0, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(vh, 4), m2), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(vl1, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(vh, 6), m2), 4));
}

/* The two Q6_K scales of register r of half h, one per 128-bit lane. */
static inline __m256i q6k_scales_avx2(const int8_t *sc, int h, int r) {
    const int j = 8 * h + 2 * r;
    return _mm256_set_m128i(_mm_set1_epi16(sc[j + 1]), _mm_set1_epi16(sc[j]));
}
#endif

static inline void lanes_q4k(const uint8_t *qs, const uint8_t *sc, const int8_t *a, int32_t *lane) {
    for (int l = 0; l < 8; l++) lane[l] = 0;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 8; l++) {
            int32_t lo = 0, hi = 0;
            for (int b = 4 * l; b < 4 * l + 4; b++) {
                lo += (qs[32 * c + b] & 0x0F) * a[64 * c + b];
                hi += (qs[32 * c + b] >> 4) * a[64 * c + 32 + b];
            }
            lane[l] += sc[2 * c] * lo + sc[2 * c + 1] * hi;
        }
}

/* As lanes_q4k for Q6_K, before the -32 offset (the caller subtracts it per lane pair) */
static inline void lanes_q6k(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const int8_t *a, int32_t *lane) {
    for (int l = 0; l < 8; l++) lane[l] = 0;
    for (int h = 0; h < 2; h++) {
        const uint8_t *l = ql + 64 * h, *hh = qh + 32 * h;
        const int8_t *ah = a + 128 * h;
        for (int i = 0; i < 32; i++) {
            const int half = i / 16, ln = i / 4;
            int q0 = (l[i] & 0xF) | ((hh[i] & 3) << 4), q1 = (l[32 + i] & 0xF) | (((hh[i] >> 2) & 3) << 4);
            int q2 = (l[i] >> 4) | (((hh[i] >> 4) & 3) << 4), q3 = (l[32 + i] >> 4) | (((hh[i] >> 6) & 3) << 4);
            lane[ln] += sc[8 * h + 0 + half] * q0 * ah[i] + sc[8 * h + 2 + half] * q1 * ah[32 + i] +
                        sc[8 * h + 4 + half] * q2 * ah[64 + i] + sc[8 * h + 6 + half] * q3 * ah[96 + i];
        }
    }
}

/* Q5_0 block: fp16 d, 32 high bits, 16 bytes of low nibbles; value e is d * (q_e - 16) */
static inline void unpack_q5_0(const uint8_t *b, int8_t *w, float *d) {
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    *d = f16_to_f32(b);
    for (int e = 0; e < 16; e++) {
        w[e] = (int8_t)(((qs[e] & 0x0F) | (((qh >> e) & 1) << 4)) - 16);
        w[e + 16] = (int8_t)(((qs[e] >> 4) | (((qh >> (e + 16)) & 1) << 4)) - 16);
    }
}

static inline void unpack_q4_0(const uint8_t *b, int8_t *w, float *d) {
    const uint8_t *qs = b + 2;
    *d = f16_to_f32(b);
    for (int e = 0; e < 16; e++) {
        w[e] = (int8_t)((qs[e] & 0x0F) - 8);
        w[e + 16] = (int8_t)((qs[e] >> 4) - 8);
    }
}

/* Lane sums of activation rows for the few-row 32-block kernels (rows_q32_512, rows_q5r_avx2): corr[i * k/4 + l] = -off * (a[4l] + ... + a[4l+3]),
 * off the bias of the type's unsigned weight codes (Q5_0's q is already q - 16 + 16, Q4_0's q - 8 + 8; Q8_0's w + 128). */
static void q32_corrections(int type, const int8_t *q, int64_t k, int64_t n, int32_t *corr) {
    const int32_t off = type == T_Q8_0 ? 128 : type == T_Q4_0 || type == T_Q4_0R ? 8 : 16;
    for (int64_t i = 0; i < n; i++)
        for (int64_t l = 0; l < k / 4; l++) {
            const int8_t *a = q + i * k + 4 * l;
            corr[i * (k / 4) + l] = -off * (a[0] + a[1] + a[2] + a[3]);
        }
}

#if defined(LEVER_AVX2) && !defined(LEVER_AVX512) /* the AVX-512 build has rows_q32_512 */
/* The same block's 32 unsigned codes (0..31, the value is q - 16) in one register: nibbles plus the
 * fifth bit expanded from qh. */
static inline __m256i q5_0_codes_avx2(const uint8_t *b) {
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 6));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    /* byte e of the result holds bit e of qh: bytes of qh spread 8 apiece, then one bit per byte */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i hi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nib, hi);
}

/* The same block as 32 int8 weights */
static inline __m256i q5_0_avx2(const uint8_t *b) { return _mm256_sub_epi8(q5_0_codes_avx2(b), _mm256_set1_epi8(16)); }

/* A Q4_0 block as 32 int8 weights (its nibbles less 8) */
static inline __m256i q4_0_avx2(const uint8_t *b) {
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 2));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
    return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
}

/* Q8_0 / Q5_0 against activation rows [0, n) for one group: eight float lanes per output
 * (acc + 8*i), each block's exact integer dot scaled and added lane-wise in block order, so
 * a row's result depends on nothing but its own operands (batch- and thread-invariant). */
static void block_q32_avx2(int type, const uint8_t *b, int64_t s, int64_t k, int64_t n, const int8_t *q,
                           const float *d, float *acc) {
    const int64_t nsb = n_groups(k);
    const int nb = (int)(group_len(k, s) / 32), bs = q32_block_bytes(type);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i w[8], aw[8];
    float dw[8];
    for (int c = 0; c < nb; c++) { /* unpack the group once, reuse it for every row */
        const uint8_t *blk = b + bs * c;
        w[c] = type == T_Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2)) : type == T_Q4_0 ? q4_0_avx2(blk) : q5_0_avx2(blk);
        aw[c] = _mm256_sign_epi8(w[c], w[c]);
        dw[c] = f16_to_f32(blk);
    }
    for (int64_t i = 0; i < n; i++) {
        const int8_t *a = q + i * k + s * QK;
        const float da = d[i * nsb + s];
        /* even and odd blocks in two register chains, joined once: a fixed order for every row */
        __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
        for (int c = 0; c < nb; c++) {
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a + 32 * c));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[c], _mm256_sign_epi8(av, w[c])), ones);
            if (c & 1) v1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw[c] * da), v1);
            else v0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw[c] * da), v0);
        }
        _mm256_storeu_ps(acc + 8 * i, _mm256_add_ps(_mm256_loadu_ps(acc + 8 * i), _mm256_add_ps(v0, v1)));
    }
}
#endif

/* The final sum of a 32-block type's eight float lanes (every path adds them in this order). */
static inline float hsum8(const float *a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

#if defined(LEVER_AVX2) && !defined(LEVER_AVX512) /* the AVX-512 build has rows_q32_512 */
/* A repacked pair's 64 unsigned codes as two registers, block 2c's in *u0 and 2c + 1's in *u1: the
 * nibbles by an and and a shift, the fifth bits by one shift per quadword (see q5_0_pair_repack). */
static inline void q5_0r_codes_avx2(const uint8_t *p, __m256i *u0, __m256i *u1) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), m4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
    int64_t h;
    memcpy(&h, p + 32, 8);
    const __m256i hb = _mm256_set1_epi64x(h);
    *u0 = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_sllv_epi64(hb, _mm256_setr_epi64x(4, 3, 2, 1)), b4));
    *u1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                          _mm256_and_si256(_mm256_srlv_epi64(hb, _mm256_setr_epi64x(0, 1, 2, 3)), b4));
}

/* One block's exact integer lanes from unsigned codes u (0..31): four adjacent products each, less
 * the activations' lane sums times the bias 16 (corr). The codes stay under 32, so maddubs's
 * pairwise 16-bit sums never saturate: the integers block_q32_avx2 computes by the sign trick. */
static inline __m256 q5_lanes_avx2(__m256i u, const int8_t *a, const int32_t *corr) {
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)a)), _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(p, _mm256_loadu_si256((const __m256i *)corr)));
}

/* R whole Q5_0R weight rows (rb bytes apart) against N <= 4 activation rows. Each output keeps
 * block_q32_avx2's float order: per group an even-block and an odd-block chain of fused adds from
 * zero, joined and added to the output's eight lanes, which stay in a register across groups, then
 * hsum8. The same bits as the GGUF layout's kernels, at about half the instructions a block: the
 * pair layout unpacks cheaply, the unsigned codes need no sign instructions, and the R x N chains
 * interleave. */
static inline __attribute__((always_inline)) void rows_q5r_avx2(
        const uint8_t *b, size_t rb, int64_t k, const int R, const int N, const int8_t *q,
        const float *d, const int32_t *corr, float *out, int64_t stride) {
    const int64_t nsb = n_groups(k);
    __m256 acc[8];
    for (int o = 0; o < R * N; o++) acc[o] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const int nb = (int)(group_len(k, s) / 32);
        __m256 v0[8], v1[8];
        float da[4];
        for (int o = 0; o < R * N; o++) v0[o] = v1[o] = _mm256_setzero_ps();
        for (int i = 0; i < N; i++) da[i] = d[i * nsb + s];
        for (int c = 0; c + 1 < nb; c += 2) {
            for (int r = 0; r < R; r++) {
                const uint8_t *p = b + r * rb + (size_t)s * 176 + 22 * c;
                __m256i u0, u1;
                q5_0r_codes_avx2(p, &u0, &u1);
                const float d0 = f16_to_f32(p + 40), d1 = f16_to_f32(p + 42);
                for (int i = 0; i < N; i++) {
                    const int8_t *a = q + i * k + s * QK + 32 * c;
                    const int32_t *ci = corr + i * (k / 4) + s * (QK / 4) + 8 * c;
                    v0[r * N + i] = _mm256_fmadd_ps(q5_lanes_avx2(u0, a, ci), _mm256_set1_ps(d0 * da[i]), v0[r * N + i]);
                    v1[r * N + i] = _mm256_fmadd_ps(q5_lanes_avx2(u1, a + 32, ci + 8), _mm256_set1_ps(d1 * da[i]), v1[r * N + i]);
                }
            }
        }
        if (nb & 1) /* a group's odd last block keeps the GGUF layout; it is an even block */
            for (int r = 0; r < R; r++) {
                const uint8_t *p = b + r * rb + (size_t)s * 176 + 22 * (nb - 1);
                const __m256i u = q5_0_codes_avx2(p);
                const float dw = f16_to_f32(p);
                for (int i = 0; i < N; i++)
                    v0[r * N + i] = _mm256_fmadd_ps(q5_lanes_avx2(u, q + i * k + s * QK + 32 * (nb - 1), corr + i * (k / 4) + s * (QK / 4) + 8 * (nb - 1)),
                                                    _mm256_set1_ps(dw * da[i]), v0[r * N + i]);
            }
        for (int o = 0; o < R * N; o++) acc[o] = _mm256_add_ps(acc[o], _mm256_add_ps(v0[o], v1[o]));
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < N; i++) {
            float l[8];
            _mm256_storeu_ps(l, acc[r * N + i]);
            out[i * stride + r] = hsum8(l);
        }
}

/* rows_q5r_avx2 on the weight rows from j: R1 of them for one activation row, R2 for more (literal
 * shapes, so each call is compiled for its own) */
#define Q5R_ROWS(R1, R2)                                                                              \
    do {                                                                                              \
        const uint8_t *b = w + (size_t)j * rb;                                                        \
        switch (n) {                                                                                  \
        case 1: rows_q5r_avx2(b, rb, k, R1, 1, q, d, corr, out + j, stride); break;                   \
        case 2: rows_q5r_avx2(b, rb, k, R2, 2, q, d, corr, out + j, stride); break;                   \
        case 3: rows_q5r_avx2(b, rb, k, R2, 3, q, d, corr, out + j, stride); break;                   \
        default: rows_q5r_avx2(b, rb, k, R2, 4, q, d, corr, out + j, stride); break;                  \
        }                                                                                             \
    } while (0)

/* Q5_0R weight rows [j0, j1) against n <= 4 activation rows, by rows_q5r_avx2 with constant shapes */
static void few_rows_q5r_avx2(const uint8_t *w, size_t rb, int64_t j0, int64_t j1, int64_t k, int64_t n,
                              const int8_t *q, const float *d, const int32_t *corr, float *out, int64_t stride) {
    const int R = n == 1 ? 2 : 1; /* 1, 2 or 4 rows for one activation row, 1 or 2 for more: all within noise */
    int64_t j = j0;
    for (; j + R <= j1; j += R) {
        if (j + R + PREFETCH_ROWS <= j1) {
            const char *ahead = (const char *)w + (size_t)(j + PREFETCH_ROWS) * rb;
            for (size_t o = 0; o < (size_t)R * rb; o += 64) __builtin_prefetch(ahead + o, 0, 3);
        }
        Q5R_ROWS(2, 1);
    }
    for (; j < j1; j++) Q5R_ROWS(1, 1);
}
#undef Q5R_ROWS
#endif

/* The final sum of a K-quant output's lanes, in llama.cpp's order: hsum_float_8 of the eight
 * scale lanes plus the two-step sum of the four min lanes (zero for Q6_K). */
static inline float ksum(const float *a) {
    const float r0 = a[4] + a[0], r1 = a[5] + a[1], r2 = a[6] + a[2], r3 = a[7] + a[3];
    return ((r0 + r2) + (r1 + r3)) + ((a[8] + a[10]) + (a[9] + a[11]));
}

#ifdef LEVER_AVX512
/* 256 unsigned weight codes (w, four registers of 64) times 256 int8 activations, each
 * 16-bit pair product scaled by its sub-block's scale (scl): 16 int32 lane sums */
static inline __m512i dot256_512(const __m512i *w, const __m512i *scl, const int8_t *a) {
    __m512i t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();
    t0 = _mm512_dpwssd_epi32(t0, _mm512_maddubs_epi16(w[0], _mm512_loadu_si512(a)), scl[0]);
    t1 = _mm512_dpwssd_epi32(t1, _mm512_maddubs_epi16(w[1], _mm512_loadu_si512(a + 64)), scl[1]);
    t0 = _mm512_dpwssd_epi32(t0, _mm512_maddubs_epi16(w[2], _mm512_loadu_si512(a + 128)), scl[2]);
    t1 = _mm512_dpwssd_epi32(t1, _mm512_maddubs_epi16(w[3], _mm512_loadu_si512(a + 192)), scl[3]);
    return _mm512_add_epi32(t0, t1);
}

/* A Q4_K block's 256 codes as four registers of 64 (w[c] holds chunk c, one 32-byte run of nibbles:
 * its low nibbles, sub-block 2c, in the lower 256 bits and its high nibbles, 2c+1, above, so it lines
 * up with 64 contiguous activations) and each int16 lane's sub-block scale (scl); returns its eight
 * scales and eight mins widened to int16 (lanes 0-7 and 8-15). */
static inline __m512i unpack_q4k_512(const uint8_t *b, __m512i *w, __m512i *scl) {
    static const int16_t SUB[4][32] = {
        {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
        {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
        {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5},
        {6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}};
    uint8_t scmn[16];
    q4k_scales_mins16(b + 4, scmn);
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)scmn)));
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    for (int c = 0; c < 4; c++) {
        __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c)));
        w[c] = _mm512_and_si512(_mm512_srlv_epi16(v, shift), m4);
        scl[c] = _mm512_permutexvar_epi16(_mm512_loadu_si512(SUB[c]), sc16);
    }
    return sc16;
}

/* Which sub-block each int16 lane of a Q6_K block's four code registers belongs to (lane l of w[2h+r]:
 * 8h + 4r + l/8), for unpack_q6k_512's scale permutes: a constant table, not rebuilt per block */
static inline void q6k_sub_index_512(__m512i *idx) {
    static const int16_t SUB6[4][32] = {
        {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
        {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
        {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
        {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};
    for (int j = 0; j < 4; j++) idx[j] = _mm512_loadu_si512(SUB6[j]);
}

/* A Q6_K block's 256 codes (0..63, the value is code - 32) as four registers of 64 contiguous elements */
static inline void q6k_codes_512(const uint8_t *b, __m512i *w) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const uint8_t *l = b + 64 * h;
        __m256i vl0 = _mm256_loadu_si256((const __m256i *)l), vl1 = _mm256_loadu_si256((const __m256i *)(l + 32));
        __m256i vh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        __m256i q0 = _mm256_or_si256(_mm256_and_si256(vl0, m4), _mm256_slli_epi16(_mm256_and_si256(vh, m2), 4));
        __m256i q1 = _mm256_or_si256(_mm256_and_si256(vl1, m4),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(vh, 2), m2), 4));
        __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(vl0, 4), m4),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(vh, 4), m2), 4));
        __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(vl1, 4), m4),
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(vh, 6), m2), 4));
        w[2 * h] = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);     /* elements 128h + 0..63 */
        w[2 * h + 1] = _mm512_inserti64x4(_mm512_castsi256_si512(q2), q3, 1); /* elements 128h + 64..127 */
    }
}

/* q6k_codes_512 plus each int16 lane's sub-block scale (scl); returns the 16 scales widened to int16 */
static inline __m256i unpack_q6k_512(const uint8_t *b, const __m512i *idx, __m512i *w, __m512i *scl) {
    const __m256i sc16w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    const __m512i sc16 = _mm512_castsi256_si512(sc16w);
    q6k_codes_512(b, w);
    for (int c = 0; c < 4; c++) scl[c] = _mm512_permutexvar_epi16(idx[c], sc16);
    return sc16w;
}

/* Per-block Q4_K / Q6_K kernels for the grouped loop in run_job: one block of a weight row against
 * every activation row, each output's 16 float lanes in acc + 16 * i. They take the calls whose
 * activation rows do not fit in L1 (see KQ_ROW_BYTES): each block's slice of them stays in L1 while
 * a group of 16 weight rows uses it. */
static void block_q4k_512(const uint8_t *b, int64_t s, int64_t k, int64_t n, const int8_t *q, const float *d,
                          const int16_t *bs16, float *acc) {
    const int64_t nsb = k / QK;
    float dw = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    __m512i w[4], scl[4];
    const __m128i mins16 = _mm512_extracti32x4_epi32(unpack_q4k_512(b, w, scl), 1);
    /* llama.cpp's lanes: eight scale lanes (our lane l plus lane l + 8) and four min lanes
     * (pair sums of the 16-element activation sums against the eight mins) */
    for (int64_t i = 0; i < n; i++) {
        const int8_t *a = q + i * k + s * QK;
        const __m512i t = dot256_512(w, scl, a);
        const float dx = d[i * nsb + s];
        const __m256i sumi = _mm256_add_epi32(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64(t, 1));
        const __m128i q8s = _mm_loadu_si128((const __m128i *)(bs16 + (i * nsb + s) * 8)); /* pair sums (py_matmul) */
        float *ai = acc + KLANES * i;
        _mm256_storeu_ps(ai, _mm256_fmadd_ps(_mm256_set1_ps(dx * dw), _mm256_cvtepi32_ps(sumi), _mm256_loadu_ps(ai)));
        _mm_storeu_ps(ai + 8, _mm_fmadd_ps(_mm_set1_ps(-(dx * dmin)), _mm_cvtepi32_ps(_mm_madd_epi16(mins16, q8s)),
                                           _mm_loadu_ps(ai + 8)));
    }
}

static void block_q6k_512(const uint8_t *b, int64_t s, int64_t k, int64_t n, const int8_t *q, const float *d,
                          const int16_t *bs16, float *acc) {
    const int64_t nsb = k / QK;
    const float dw = f16_to_f32(b + 208);
    __m512i idx[4], w[4], scl[4];
    q6k_sub_index_512(idx);
    const __m256i sc16w = unpack_q6k_512(b, idx, w, scl);
    for (int64_t i = 0; i < n; i++) { /* llama.cpp's eight lanes, each less its pair of -32 offsets */
        const int8_t *a = q + i * k + s * QK;
        const __m512i t = dot256_512(w, scl, a);
        const __m256i sumi = _mm256_add_epi32(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64(t, 1));
        const __m256i off = _mm256_slli_epi32(
            _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bs16 + (i * nsb + s) * 16)), sc16w), 5);
        float *ai = acc + KLANES * i;
        _mm256_storeu_ps(ai, _mm256_fmadd_ps(_mm256_set1_ps(d[i * nsb + s] * dw),
                                             _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, off)), _mm256_loadu_ps(ai)));
    }
}

/* Two activation rows' eight folded lanes at once (lanes 0-7 row 0's, 8-15 row 1's: what dot256_512
 * gives each row after its upper eight lanes are added to its lower eight). Per code register, one
 * two-source word permute puts each folded lane's two four-sums side by side as an int16 pair and one
 * multiply-add scales and adds them, so the fold costs nothing of its own. A four-sum (vpdpbusd) is at
 * most 4 x 63 x 128 = 32256 in magnitude, an int16. fs[c]: the scale pairs. */
static inline __m512i dot_pair_q6k_512(const __m512i *w, const __m512i *fs, const int8_t *a0, const int8_t *a1) {
    static const int16_t FOLD[32] = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30,
                                     32, 48, 34, 50, 36, 52, 38, 54, 40, 56, 42, 58, 44, 60, 46, 62};
    const __m512i z = _mm512_setzero_si512(), fold = _mm512_loadu_si512(FOLD);
    __m512i v = z;
    for (int c = 0; c < 4; c++) {
        const __m512i s0 = _mm512_dpbusd_epi32(z, w[c], _mm512_loadu_si512(a0 + 64 * c));
        const __m512i s1 = _mm512_dpbusd_epi32(z, w[c], _mm512_loadu_si512(a1 + 64 * c));
        v = _mm512_dpwssd_epi32(v, _mm512_permutex2var_epi16(s0, fold, s1), fs[c]);
    }
    return v;
}

/* dot_pair_q6k_512's scales: word 2L of fs[c] the sub-block of lane L % 8 of code register c, word 2L + 1
 * that of lane L % 8 + 8 */
static inline void q6k_fold_scales_512(__m256i sc16, __m512i *fs) {
    static const int16_t LANE[32] = {0, 2, 0, 2, 0, 2, 0, 2, 1, 3, 1, 3, 1, 3, 1, 3,
                                     0, 2, 0, 2, 0, 2, 0, 2, 1, 3, 1, 3, 1, 3, 1, 3};
    const __m512i lane = _mm512_loadu_si512(LANE), sc = _mm512_castsi256_si512(sc16);
    for (int c = 0; c < 4; c++)
        fs[c] = _mm512_permutexvar_epi16(_mm512_add_epi16(lane, _mm512_set1_epi16((short)(4 * c))), sc);
}

/* One K-quant weight row through all its blocks against N <= KQ_MAX activation rows (the AVX2
 * row kernels' shape). A block's codes and scales are unpacked once for every activation row, and
 * each row's float lanes live in one register for the whole row: lanes 0-7 llama.cpp's eight scale
 * lanes, 8-11 Q4_K's four min lanes, 12-15 zero, exactly the acc layout ksum reads. The per-block
 * kernels these replaced (one call per block over a group of 16 weight rows) kept them in memory and
 * finished each (row, block) with two fused adds, two loads, two stores and a scalar product: more
 * instructions than the block's eight multiply-adds. Here the integer
 * lanes are folded and joined with the min lanes in one vector, and one fused add takes all twelve;
 * its multiplier is dx * [dw x8, -dmin x4, 0 x4] (dx * -dmin is -(dx * dmin) exactly), so every lane
 * gets the fused add it got before, in block order: the same bits. */
static inline __attribute__((always_inline)) void row_q4k_512(
        const uint8_t *w, int64_t nsb, int64_t k, const int N, const int8_t *q, const float *d,
        const int16_t *bs16, float *out, int64_t stride, const uint8_t *pf) {
    /* int16 lanes 16-23 take the mins (sc16's lanes 8-15), so madd puts their sums in int32 lanes 8-11 */
    static const int16_t MINS[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                     8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0};
    __m512 fa[KQ_MAX];
    for (int i = 0; i < N; i++) fa[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *b = w + (size_t)s * 144;
        if (pf) for (int o = 0; o < 144; o += 64) __builtin_prefetch(pf + (size_t)s * 144 + o, 0, 3);
        __m512i wq[4], scl[4];
        const __m512i sc16 = unpack_q4k_512(b, wq, scl);
        const __m512i mins = _mm512_maskz_permutexvar_epi16(0x00FF0000u, _mm512_loadu_si512(MINS), sc16);
        const __m512 wd = _mm512_maskz_mov_ps(0x0FFF, _mm512_mask_blend_ps(0x0F00, _mm512_set1_ps(f16_to_f32(b)),
                                                                          _mm512_set1_ps(-f16_to_f32(b + 2))));
        for (int i = 0; i < N; i++) {
            const __m512i t = dot256_512(wq, scl, q + i * k + s * QK);
            const __m512i m = _mm512_madd_epi16(
                mins, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(bs16 + (i * nsb + s) * 8))));
            const __m512i v = _mm512_mask_add_epi32(m, 0x00FF, t, _mm512_shuffle_i64x2(t, t, 0x4E));
            fa[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(d[i * nsb + s]), wd), _mm512_cvtepi32_ps(v), fa[i]);
        }
    }
    for (int i = 0; i < N; i++) {
        float a[16];
        _mm512_storeu_ps(a, fa[i]);
        out[i * stride] = ksum(a);
    }
}

/* Q6_K likewise, two activation rows to a float register: lanes 0-7 row i's eight scale lanes, 8-15
 * row i + 1's (dot_pair_q6k_512; an odd last row is paired with itself and its copy never read). Each
 * row's -32 offsets enter its integer sum as one more multiply-add (its sub-block sums against the
 * scales times -32) rather than a multiply, shift and subtract of their own, and one conversion and
 * fused add serve both rows. Integer sums in any order are the same integer and every lane gets the
 * fused add it got before (d_i x dw, in block order), so the bits are the ones of the one-row-per-register
 * kernel this replaced. */
static inline __attribute__((always_inline)) void row_q6k_512(
        const uint8_t *w, int64_t nsb, int64_t k, const int N, const int8_t *q, const float *d,
        const int16_t *bs16, float *out, int64_t stride, const uint8_t *pf) {
    __m512 fa[KQ_MAX / 2];
    for (int p = 0; p < (N + 1) / 2; p++) fa[p] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *b = w + (size_t)s * 210;
        if (pf) for (int o = 0; o < 210; o += 64) __builtin_prefetch(pf + (size_t)s * 210 + o, 0, 3);
        __m512i wq[4], fs[4];
        q6k_codes_512(b, wq);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        q6k_fold_scales_512(sc16, fs);
        /* -32 x a scale fits int16 (at most 4096 in magnitude), in both halves: a pair's offsets go into
         * its folded lanes (row i's sub-block sums below, row i + 1's above) in one multiply-add */
        const __m512i off = _mm512_broadcast_i64x4(_mm256_mullo_epi16(sc16, _mm256_set1_epi16(-32)));
        const __m512 dw = _mm512_set1_ps(f16_to_f32(b + 208));
#pragma GCC unroll 12 /* fa must stay in registers: a loop left rolled kept it on the stack */
        for (int i = 0; i < N; i += 2) {
            const int i1 = i + 1 < N ? i + 1 : i;
            const __m512i bs = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(bs16 + (i * nsb + s) * 16))),
                _mm256_loadu_si256((const __m256i *)(bs16 + (i1 * nsb + s) * 16)), 1);
            const __m512i v = _mm512_dpwssd_epi32(dot_pair_q6k_512(wq, fs, q + i * k + s * QK, q + i1 * k + s * QK), bs, off);
            const __m512 dd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d[i * nsb + s]), _mm512_set1_ps(d[i1 * nsb + s]));
            fa[i / 2] = _mm512_fmadd_ps(_mm512_mul_ps(dd, dw), _mm512_cvtepi32_ps(v), fa[i / 2]);
        }
    }
    for (int i = 0; i < N; i++) { /* ksum over a row's eight lanes and four zero min lanes, as before */
        float a[16] = {0};
        _mm256_storeu_ps(a, i % 2 ? _mm512_extractf32x8_ps(fa[i / 2], 1) : _mm512_castps512_ps256(fa[i / 2]));
        out[i * stride] = ksum(a);
    }
}

/* Two Q5_0 blocks as 64 unsigned codes q (0..31; the value is q - 16): the fifth bits of both
 * straight from their qh words as one 64-bit byte mask (bit e of qh is element e). */
static inline __m512i q5_0_codes_512(const uint8_t *b0, const uint8_t *b1) {
    const __m512i qs = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + 6)))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b1 + 6))), 1);
    /* the second 16 of each block's 32 elements are its high nibbles (qwords 2-3 and 6-7) */
    const __m512i nib = _mm512_and_si512(_mm512_mask_blend_epi64(0xCC, qs, _mm512_srli_epi16(qs, 4)),
                                         _mm512_set1_epi8(0x0F));
    uint32_t h0, h1;
    memcpy(&h0, b0 + 2, 4);
    memcpy(&h1, b1 + 2, 4);
    return _mm512_or_si512(nib, _mm512_maskz_mov_epi8((__mmask64)h0 | ((__mmask64)h1 << 32), _mm512_set1_epi8(0x10)));
}

/* Two Q4_0 blocks as 64 unsigned codes (0..15; the value is q - 8), as q5_0_codes_512 without a fifth bit */
static inline __m512i q4_0_codes_512(const uint8_t *b0, const uint8_t *b1) {
    const __m512i qs = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + 2)))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b1 + 2))), 1);
    return _mm512_and_si512(_mm512_mask_blend_epi64(0xCC, qs, _mm512_srli_epi16(qs, 4)), _mm512_set1_epi8(0x0F));
}

/* Two Q8_0 blocks' 64 int8 weights, and two 32-blocks' scales (block b0 in the low eight lanes) */
static inline __m512i q8_0_pair_512(const uint8_t *b0, const uint8_t *b1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                              _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
}

static inline __m512 scale_pair_512(const uint8_t *b0, const uint8_t *b1) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(f16_to_f32(b0))),
                                               _mm256_castps_pd(_mm256_set1_ps(f16_to_f32(b1))), 1));
}

/* q5_0_codes_512 of a repacked pair (Q5_0R, see q5_0_pair_repack): the same 64 codes */
static inline __m512i q5_0r_codes_512(const uint8_t *p) {
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i nib = _mm512_and_si512(_mm512_srlv_epi16(v, shift), _mm512_set1_epi8(0x0F));
    uint64_t h;
    memcpy(&h, p + 32, 8);
    return _mm512_mask_add_epi8(nib, (__mmask64)h, nib, _mm512_set1_epi8(0x10));
}

/* q4_0_codes_512 of a repacked pair (Q4_0R, see q4_0_pair_repack): the same 64 codes */
static inline __m512i q4_0r_codes_512(const uint8_t *p) {
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(v, shift), _mm512_set1_epi8(0x0F));
}

/* The unsigned codes of the 32-blocks b0 and b1 of any 32-block type (b1 == b0: a group's odd last
 * block, which keeps the GGUF layout in the repacked types) */
static inline __m512i q32_codes_512(int type, const uint8_t *b0, const uint8_t *b1) {
    if (type == T_Q8_0) return _mm512_xor_si512(q8_0_pair_512(b0, b1), _mm512_set1_epi8((char)0x80));
    if (type == T_Q4_0R && b1 != b0) return q4_0r_codes_512(b0);
    if (type == T_Q4_0 || type == T_Q4_0R) return q4_0_codes_512(b0, b1);
    return type == T_Q5_0R && b1 != b0 ? q5_0r_codes_512(b0) : q5_0_codes_512(b0, b1);
}
/* a repacked pair's two adjacent f16 scales (at p), each widened into eight lanes (exactly, as scale_pair_512) */
static inline __m512 repacked_scales_512(const uint8_t *p) {
    uint32_t d;
    memcpy(&d, p, 4);
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return _mm512_cvtph_ps(_mm256_shuffle_epi8(_mm256_set1_epi32((int)d), spread));
}
/* the scales of the 32-blocks b0 and b1 of any 32-block type (a repacked Q5_0 pair keeps them side by side) */
static inline __m512 pair_scales_512(int type, const uint8_t *b0, const uint8_t *b1) {
    if (b1 != b0 && type == T_Q5_0R) return repacked_scales_512(b0 + 40);
    if (b1 != b0 && type == T_Q4_0R) return repacked_scales_512(b0 + 32);
    return scale_pair_512(b0, b1);
}

/* R whole Q8_0 / Q5_0 weight rows (rb bytes apart) against N <= 4 activation rows, two blocks per
 * instruction: block c in the low eight lanes, c + 1 in the high eight, so the low half is
 * block_q32_avx2's even register chain and the high half its odd one. Each lane holds the same
 * exact integer (four adjacent products, here by VNNI) scaled by the same float product and
 * fused-added in the same order: the same bits as the AVX2 and portable paths, at about half the
 * instructions (the draft's Q5_0 matmuls were its largest cost). Each output's eight lanes stay in a
 * register across groups.
 * The R x N outputs' chains interleave, since one row's chain of fused adds is too long for the
 * out-of-order window to overlap it with the next row's. The integer dots take unsigned weight
 * codes (VNNI multiplies unsigned by signed bytes) and start from the activations' lane sums
 * times the codes' bias: the same exact integers with fewer instructions. */
static inline __attribute__((always_inline)) void rows_q32_512(
        int type, const uint8_t *b, size_t rb, int64_t k, const int R, const int N, const int8_t *q,
        const float *d, const int32_t *corr, float *out, int64_t stride) {
    const int64_t nsb = n_groups(k);
    const int bs = q32_block_bytes(type);
    __m256 acc[8];
    for (int o = 0; o < R * N; o++) acc[o] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const int nb = (int)(group_len(k, s) / 32), np = (nb + 1) / 2;
        __m512 v[8], da[4];
        for (int o = 0; o < R * N; o++) v[o] = _mm512_setzero_ps();
        for (int i = 0; i < N; i++) da[i] = _mm512_set1_ps(d[i * nsb + s]);
        for (int c = 0; c < np; c++) {
            const int last = c == np - 1;
            /* an odd last block fills only the low lanes (the even chain); its operands are read half wide */
            const __mmask16 m16 = last && (nb & 1) ? 0x00FF : 0xFFFF;
            const __mmask64 m64 = last && (nb & 1) ? 0xFFFFFFFFULL : ~0ULL;
            __m512i a[4], ci[4];
            for (int i = 0; i < N; i++) {
                a[i] = _mm512_maskz_loadu_epi8(m64, q + i * k + s * QK + 64 * c);
                ci[i] = _mm512_maskz_loadu_epi32(m16, corr + i * (k / 4) + s * (QK / 4) + 16 * c);
            }
            for (int r = 0; r < R; r++) {
                const uint8_t *b0 = b + r * rb + (size_t)s * (8 * bs) + bs * 2 * c;
                const uint8_t *b1 = 2 * c + 1 < nb ? b0 + bs : b0;
                const __m512i u = q32_codes_512(type, b0, b1);
                const __m512 dw = pair_scales_512(type, b0, b1);
                for (int i = 0; i < N; i++) {
                    const __m512i p = _mm512_dpbusd_epi32(ci[i], u, a[i]);
                    v[r * N + i] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, da[i]), v[r * N + i], m16);
                }
            }
        }
        for (int o = 0; o < R * N; o++) {
            const __m256 lo = _mm512_castps512_ps256(v[o]);
            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[o]), 1));
            acc[o] = _mm256_add_ps(acc[o], _mm256_add_ps(lo, hi));
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < N; i++) {
            float l[8];
            _mm256_storeu_ps(l, acc[r * N + i]);
            out[i * stride + r] = hsum8(l);
        }
}

/* rows_q32_512 on R weight rows from j against the n activation rows (the shapes are literal
 * constants in every call, so each call is compiled for its own shape) */
#define Q32_ROWS(R)                                                                                       \
    do {                                                                                                  \
        const uint8_t *b = w + (size_t)j * rb;                                                            \
        switch (n) {                                                                                      \
        case 1: rows_q32_512(type, b, rb, k, R, 1, q, d, corr, out + j, stride); break;                   \
        case 2: rows_q32_512(type, b, rb, k, R, 2, q, d, corr, out + j, stride); break;                   \
        case 3: rows_q32_512(type, b, rb, k, R, 3, q, d, corr, out + j, stride); break;                   \
        default: rows_q32_512(type, b, rb, k, R, 4, q, d, corr, out + j, stride); break;                  \
        }                                                                                                 \
    } while (0)

/* Weight rows [j0, j1) against n <= 4 activation rows, by rows_q32_512 with constant shapes, two
 * weight rows at a time for any n. One activation row once took four weight rows at a time; from
 * DRAM that ran at about half the bandwidth of two (the draft's Q4_0 896x4864 and 4864x896
 * projections, one thread: 0.21-0.30 ms a call against 0.13-0.16 ms; a whole one-row draft step
 * 25 ms against 14). */
static void few_rows_q32_512(int type, const uint8_t *w, size_t rb, int64_t j0, int64_t j1, int64_t k, int64_t n,
                             const int8_t *q, const float *d, const int32_t *corr, float *out, int64_t stride) {
    enum { R = 2 };
    int64_t j = j0;
    for (; j + R <= j1; j += R) {
        if (j + R + PREFETCH_ROWS <= j1) { /* software prefetch: the loads in flight are too few without it */
            const char *ahead = (const char *)w + (size_t)(j + PREFETCH_ROWS) * rb;
            for (size_t o = 0; o < (size_t)R * rb; o += 64) __builtin_prefetch(ahead + o, 0, 3);
        }
        Q32_ROWS(R); /* the shape the loop steps by */
    }
    for (; j < j1; j++) Q32_ROWS(1);
}
#undef Q32_ROWS
#endif

/* ---------------------------------------------- Q4_0T: the draft's Q4_0 for AMX tiles
 *
 * Why: at three activation rows the draft's Q4_0 layers were bound by the vector units (unpacking,
 * then four instructions per pair of blocks and activation row), 27 ms a level where its 201 MB
 * read at this core's bandwidth take 12. AMX computes a block's integer dot for 16 weight rows and
 * up to 16 activation rows in one instruction, so the vector units are left with unpacking nibbles
 * and one fused add per block, weight row strip and activation row.
 *
 * Layout: rows in strips of 16 (a matrix of Q4_0T has a multiple of 16 rows); a strip's blocks in
 * order, each 288 bytes: 256 bytes of codes, then the 16 rows' f16 scales. Byte 4r + j of the
 * codes' 64-byte chunk c holds, in its low nibble, the code of element 8c + j of row r's block and,
 * in its high nibble, that of element 8c + 4 + j: the low nibbles of a chunk are then row 2c of the
 * tile TDPBSUD takes as its weights (8 rows of 16 x 4 bytes), the high nibbles row 2c + 1. Same
 * bytes as Q4_0: 18 a row and block.
 *
 * Arithmetic (every path, the same bits): output (i, r) = the fused adds over blocks b in order of
 * (float) p_b times (row r's scale of b times activation row i's scale of b's group), from 0, where
 * p_b is the exact integer dot of the block's codes and activations minus 8 times the activations'
 * block sum. One chain per output: no lanes to join, unlike the Q4_0R kernels, so its bits differ
 * from Q4_0's; a draft's only (its proposals, never the output, depend on it). */
static inline int q4_0t_code(const uint8_t *codes, int r, int e) {
    const int c = e / 8, hi = (e / 4) & 1;
    return (codes[64 * c + 4 * r + e % 4] >> (4 * hi)) & 15;
}

/* Q4_0 rows [16t, 16t + 16) of k columns to strip t of Q4_0T, and back */
static void q4_0t_strip(uint8_t *q4, int64_t k, uint8_t *strip, int to_tiled) {
    const size_t rb = row_bytes(T_Q4_0, k);
    for (int64_t b = 0; b < k / 32; b++) {
        uint8_t *t = strip + (size_t)b * 288;
        for (int r = 0; r < 16; r++) {
            uint8_t *blk = q4 + (size_t)r * rb + (size_t)b * 18;
            if (to_tiled) {
                memcpy(t + 256 + 2 * r, blk, 2);
                for (int e = 0; e < 32; e++) {
                    const int code = e < 16 ? blk[2 + e] & 15 : blk[2 + e - 16] >> 4;
                    const int c = e / 8, hi = (e / 4) & 1;
                    uint8_t *byte = t + 64 * c + 4 * r + e % 4;
                    *byte = (uint8_t)(hi ? (*byte & 0x0F) | (code << 4) : (*byte & 0xF0) | code);
                }
            } else {
                memcpy(blk, t + 256 + 2 * r, 2);
                for (int e = 0; e < 16; e++)
                    blk[2 + e] = (uint8_t)(q4_0t_code(t, r, e) | (q4_0t_code(t, r, e + 16) << 4));
            }
        }
    }
}

/* -8 times each activation row's block sums, bias[i * (k / 32) + b], from the sums of 16 that
 * quantize_row keeps (bsums: 16 a group) */
static void q4_0t_bias(const int32_t *bsums, int64_t k, int64_t n, int32_t *bias) {
    const int64_t nsb = n_groups(k);
    for (int64_t i = 0; i < n; i++)
        for (int64_t b = 0; b < k / 32; b++) {
            const int32_t *bs = bsums + i * nsb * (QK / 16) + 2 * b; /* block b's two sums of 16 */
            bias[i * (k / 32) + b] = -8 * (bs[0] + bs[1]);
        }
}

static void q4_0t_portable(const uint8_t *w, int64_t k, int64_t t0, int64_t t1, int64_t n, const int8_t *q,
                           const float *d, const int32_t *bias, float *out, int64_t stride) {
    const int64_t nb = k / 32, nsb = n_groups(k);
    for (int64_t t = t0; t < t1; t++)
        for (int r = 0; r < 16; r++)
            for (int64_t i = 0; i < n; i++) {
                float v = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = w + ((size_t)t * nb + b) * 288;
                    const int8_t *a = q + i * k + 32 * b;
                    int32_t p = bias[i * nb + b];
                    for (int e = 0; e < 32; e++) p += a[e] * q4_0t_code(blk, r, e);
                    v = fmaf((float)p, f16_to_f32(blk + 256 + 2 * r) * d[i * nsb + 32 * b / QK], v);
                }
                out[i * stride + 16 * t + r] = v;
            }
}

#ifdef LEVER_AMX
/* AMX needs the kernel's leave, once per process, asked when a tiled matrix is first used (not at
 * import: a process granted it must keep every later signal stack large enough for tile state).
 * amx_errno: the refusal's errno (0: granted); amx_on: tests turn AMX off to compare paths. */
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static int amx_errno = -1;
static _Atomic int amx_on = 0;
static void amx_request_once(void) {
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    amx_errno = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : errno;
    atomic_store(&amx_on, amx_errno == 0);
}
static void amx_request(void) { pthread_once(&amx_once, amx_request_once); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Three strips at once: tile 1 holds n activation rows of one block, tiles 3, 5, 7 the strips'
 * unpacked codes, tiles 2, 4, 6 their integer dots. One strip at a time left the unit waiting on
 * each block's tile store and reload (7 GB/s from DRAM); three independent chains read at 18-20,
 * the core's bandwidth. */
#define Q4T_STRIPS 3
static inline __attribute__((always_inline)) void q4_0t_strips_amx(
        const uint8_t *w, int64_t k, int64_t t, const int S, const int N, const int8_t *q, const float *d,
        const int32_t *bias, float *out, int64_t stride, int64_t t_end) {
    const int64_t nb = k / 32, nsb = n_groups(k);
    uint8_t codes[Q4T_STRIPS][512] __attribute__((aligned(64)));
    int32_t dots[Q4T_STRIPS][16 * 16] __attribute__((aligned(64)));
    __m512 v[Q4T_STRIPS][16];
    for (int s = 0; s < S; s++)
        for (int i = 0; i < N; i++) v[s][i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        _tile_loadd(1, q + 32 * b, k);
        for (int s = 0; s < S; s++) {
            const uint8_t *p = w + ((size_t)(t + s) * nb + b) * 288;
            if (t + s + 4 < t_end) /* the same block of the strip four on (the next group's and one more): 16-17
                                    * GB/s against 14-15 without (the draft's 896 x 4864) */
                for (int o = 0; o < 288; o += 64) __builtin_prefetch(p + 4 * nb * 288 + o, 0, 3);
            for (int c = 0; c < 4; c++) {
                const __m512i x = _mm512_loadu_si512(p + 64 * c);
                _mm512_store_si512(codes[s] + 128 * c, _mm512_and_si512(x, low));
                _mm512_store_si512(codes[s] + 128 * c + 64, _mm512_and_si512(_mm512_srli_epi16(x, 4), low));
            }
        }
        _tile_zero(2); _tile_loadd(3, codes[0], 64); _tile_dpbsud(2, 1, 3); _tile_stored(2, dots[0], 64);
        if (S > 1) { _tile_zero(4); _tile_loadd(5, codes[1], 64); _tile_dpbsud(4, 1, 5); _tile_stored(4, dots[1], 64); }
        if (S > 2) { _tile_zero(6); _tile_loadd(7, codes[2], 64); _tile_dpbsud(6, 1, 7); _tile_stored(6, dots[2], 64); }
        for (int s = 0; s < S; s++) {
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + ((size_t)(t + s) * nb + b) * 288 + 256)));
            for (int i = 0; i < N; i++) {
                const __m512i p = _mm512_add_epi32(_mm512_load_si512(dots[s] + 16 * i), _mm512_set1_epi32(bias[i * nb + b]));
                v[s][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, _mm512_set1_ps(d[i * nsb + 32 * b / QK])), v[s][i]);
            }
        }
    }
    for (int s = 0; s < S; s++)
        for (int i = 0; i < N; i++) _mm512_storeu_ps(out + i * stride + 16 * (t + s), v[s][i]);
}

#define Q4T_ROWS(S)                                                                                       \
    switch (m) {                                                                                          \
    case 1: q4_0t_strips_amx(w, k, t, S, 1, qi, di, bi, oi, stride, t1); break;                           \
    case 2: q4_0t_strips_amx(w, k, t, S, 2, qi, di, bi, oi, stride, t1); break;                           \
    case 3: q4_0t_strips_amx(w, k, t, S, 3, qi, di, bi, oi, stride, t1); break;                           \
    case 4: q4_0t_strips_amx(w, k, t, S, 4, qi, di, bi, oi, stride, t1); break;                           \
    default: q4_0t_strips_amx(w, k, t, S, m, qi, di, bi, oi, stride, t1); break;                          \
    }

/* Strips [t0, t1) against n activation rows, 16 at a time (a tile's rows) */
static void q4_0t_amx(const uint8_t *w, int64_t k, int64_t t0, int64_t t1, int64_t n, const int8_t *q,
                      const float *d, const int32_t *bias, float *out, int64_t stride) {
    const int64_t nb = k / 32, nsb = n_groups(k);
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int m = n - i0 < 16 ? (int)(n - i0) : 16;
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        cfg.rows[1] = (uint8_t)m; cfg.colsb[1] = 32;
        for (int c = 2; c < 8; c += 2) {
            cfg.rows[c] = (uint8_t)m; cfg.colsb[c] = 64;   /* dots: m x 16 int32 */
            cfg.rows[c + 1] = 8; cfg.colsb[c + 1] = 64;    /* codes: 8 x 64 bytes */
        }
        _tile_loadconfig(&cfg);
        const int8_t *qi = q + i0 * k;
        const float *di = d + i0 * nsb;
        const int32_t *bi = bias + i0 * nb;
        float *oi = out + i0 * stride;
        int64_t t = t0;
        for (; t + Q4T_STRIPS <= t1; t += Q4T_STRIPS) { Q4T_ROWS(Q4T_STRIPS) }
        for (; t < t1; t++) { Q4T_ROWS(1) }
        _tile_release();
    }
}
#undef Q4T_ROWS
#endif

/* Strips [t0, t1) of a Q4_0T matrix: AMX if `amx` (the matmul's one reading of amx_on, so every
 * job of a call takes the same path), else the portable loop */
static void q4_0t_rows(int amx, const uint8_t *w, int64_t k, int64_t t0, int64_t t1, int64_t n, const int8_t *q,
                       const float *d, const int32_t *bias, float *out, int64_t stride) {
#ifdef LEVER_AMX
    if (amx) { q4_0t_amx(w, k, t0, t1, n, q, d, bias, out, stride); return; }
#endif
    (void)amx;
    q4_0t_portable(w, k, t0, t1, n, q, d, bias, out, stride);
}

/* One 256-block of weight row `b` against activation rows [0, n): acc[i] += block dot.
 * The float combination below is the only float arithmetic of the int8 path. */
static void block_q8(int type, const uint8_t *b, int64_t s, int64_t k, int64_t n, const int8_t *q, const float *d,
                     const int32_t *bsums, float *acc) {
    const int64_t nsb = n_groups(k);
    if (type == T_Q4_K) { /* KLANES floats per row: eight lanes of scales, four of mins (llama.cpp's acc, acc_m) */
        float dw = f16_to_f32(b), dmin = f16_to_f32(b + 2);
        uint8_t sc[8], mn[8];
        q4k_scale_min(b + 4, sc, mn);
        int32_t lane[8];
        for (int64_t i = 0; i < n; i++) {
            const int32_t *bs = bsums + (i * nsb + s) * 16;
            const float dx = d[i * nsb + s];
            float *a = acc + KLANES * i;
            lanes_q4k(b + 16, sc, q + i * k + s * QK, lane);
            for (int l = 0; l < 8; l++) a[l] = fmaf(dx * dw, (float)lane[l], a[l]);
            for (int m = 0; m < 4; m++) {
                int32_t p = mn[2 * m] * (bs[4 * m] + bs[4 * m + 1]) + mn[2 * m + 1] * (bs[4 * m + 2] + bs[4 * m + 3]);
                a[8 + m] = fmaf(-(dx * dmin), (float)p, a[8 + m]);
            }
        }
    } else if (type == T_Q6_K) {
        const int8_t *sc = (const int8_t *)(b + 192);
        float dw = f16_to_f32(b + 208);
        int32_t lane[8];
        for (int64_t i = 0; i < n; i++) {
            const int32_t *bs = bsums + (i * nsb + s) * 16;
            const float dx = d[i * nsb + s];
            float *a = acc + KLANES * i;
            lanes_q6k(b, b + 128, sc, q + i * k + s * QK, lane);
            for (int l = 0; l < 8; l++) {
                int32_t v = lane[l] - 32 * (bs[2 * l] * sc[2 * l] + bs[2 * l + 1] * sc[2 * l + 1]);
                a[l] = fmaf(dx * dw, (float)v, a[l]);
            }
        }
    } else { /* Q8_0 / Q5_0 / Q4_0: the SIMD paths' eight lanes (four adjacent products each) and their two
              * chains of fused adds, even blocks and odd ones, joined per group: the same bits */
        const int nb = (int)(group_len(k, s) / 32);
        int8_t wq[8][32];
        float dw[8];
        for (int c = 0; c < nb; c++) {
            if (type == T_Q8_0) {
                memcpy(wq[c], b + 34 * c + 2, 32);
                dw[c] = f16_to_f32(b + 34 * c);
            } else if (type == T_Q4_0) unpack_q4_0(b + 18 * c, wq[c], &dw[c]);
            else unpack_q5_0(b + 22 * c, wq[c], &dw[c]);
        }
        for (int64_t i = 0; i < n; i++) {
            const int8_t *a = q + i * k + s * QK;
            const float da = d[i * nsb + s];
            float v[2][8] = {{0}};
            for (int c = 0; c < nb; c++)
                for (int l = 0; l < 8; l++) {
                    int32_t p = 0;
                    for (int e = 4 * l; e < 4 * l + 4; e++) p += wq[c][e] * a[32 * c + e];
                    v[c & 1][l] = fmaf((float)p, dw[c] * da, v[c & 1][l]);
                }
            for (int l = 0; l < 8; l++) acc[8 * i + l] += v[0][l] + v[1][l];
        }
    }
}

#if defined(LEVER_AVX2) && !defined(LEVER_AVX512) /* the AVX-512 build has row_q4k_512 / row_q6k_512 */
/* AVX2 K-quant kernels: one weight row, all its blocks, against N <= KQ_MAX activation rows. A
 * run's codes are unpacked (and its scales broadcast) once for every activation row, and each row's
 * integer lanes stay in registers through the block; its float lanes (fa) are fused-added once per
 * block. The previous kernel went block by block over a group of 16 weight rows and was called per
 * block: its scale registers spilled, and at one to four rows it read weights at 7 GB/s. Each lane
 * holds the integer lanes_q4k / lanes_q6k make (integer sums in any order are the same integer),
 * fused-added per block in block order, then summed by ksum: the same bits, checked against
 * llama.cpp's own results in tests/test_kernels.py. */
static inline __attribute__((always_inline)) void row_q4k_avx2(
        const uint8_t *w, int64_t nsb, int64_t k, const int N, const int8_t *q, const float *d,
        const int16_t *bs16, float *out, int64_t stride, const uint8_t *pf) {
    float fa[KQ_MAX * KLANES];
    memset(fa, 0, sizeof(float) * KLANES * N); /* only the rows this call has: it runs once per weight row */
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *b = w + (size_t)s * 144;
        if (pf) for (int o = 0; o < 144; o += 64) __builtin_prefetch(pf + (size_t)s * 144 + o, 0, 3);
        uint8_t t[16];
        q4k_scales_mins16(b + 4, t);
        __m256i lane[KQ_MAX];
        for (int i = 0; i < N; i++) lane[i] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            unpack_q4k_run_avx2(b + 16, c, &lo, &hi);
            const __m256i s0 = _mm256_set1_epi16(t[2 * c]), s1 = _mm256_set1_epi16(t[2 * c + 1]);
            for (int i = 0; i < N; i++) {
                const int8_t *a = q + i * k + s * QK + 64 * c;
                const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)a)), s0);
                const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(a + 32))), s1);
                lane[i] = _mm256_add_epi32(lane[i], _mm256_add_epi32(p0, p1));
            }
        }
        const float dw = f16_to_f32(b), dmin = f16_to_f32(b + 2);
        const __m128i mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(t + 8)));
        for (int i = 0; i < N; i++) {
            const float dx = d[i * nsb + s];
            _mm256_storeu_ps(fa + KLANES * i, _mm256_fmadd_ps(_mm256_set1_ps(dx * dw), _mm256_cvtepi32_ps(lane[i]), _mm256_loadu_ps(fa + KLANES * i)));
            const __m128i q8s = _mm_loadu_si128((const __m128i *)(bs16 + (i * nsb + s) * 8));
            _mm_storeu_ps(fa + KLANES * i + 8, _mm_fmadd_ps(_mm_set1_ps(-(dx * dmin)), _mm_cvtepi32_ps(_mm_madd_epi16(mins16, q8s)), _mm_loadu_ps(fa + KLANES * i + 8)));
        }
    }
    for (int i = 0; i < N; i++) out[i * stride] = ksum(fa + KLANES * i);
}

static inline __attribute__((always_inline)) void row_q6k_avx2(
        const uint8_t *w, int64_t nsb, int64_t k, const int N, const int8_t *q, const float *d,
        const int16_t *bs16, float *out, int64_t stride, const uint8_t *pf) {
    float fa[KQ_MAX * KLANES];
    memset(fa, 0, sizeof(float) * KLANES * N); /* only the rows this call has: it runs once per weight row */
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *b = w + (size_t)s * 210;
        if (pf) for (int o = 0; o < 210; o += 64) __builtin_prefetch(pf + (size_t)s * 210 + o, 0, 3);
        const int8_t *sc = (const int8_t *)(b + 192);
        __m256i lane[KQ_MAX];
        for (int i = 0; i < N; i++) lane[i] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i wq[4];
            unpack_q6k_half_avx2(b, b + 128, h, wq);
            for (int r = 0; r < 4; r++) {
                const __m256i sv = q6k_scales_avx2(sc, h, r);
                for (int i = 0; i < N; i++) {
                    const __m256i av = _mm256_loadu_si256((const __m256i *)(q + i * k + s * QK + 128 * h + 32 * r));
                    lane[i] = _mm256_add_epi32(lane[i], _mm256_madd_epi16(_mm256_maddubs_epi16(wq[r], av), sv));
                }
            }
        }
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        const float dw = f16_to_f32(b + 208);
        for (int i = 0; i < N; i++) {
            const __m256i off = _mm256_slli_epi32(
                _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bs16 + (i * nsb + s) * 16)), sc16), 5);
            _mm256_storeu_ps(fa + KLANES * i, _mm256_fmadd_ps(_mm256_set1_ps(d[i * nsb + s] * dw),
                                                              _mm256_cvtepi32_ps(_mm256_sub_epi32(lane[i], off)),
                                                              _mm256_loadu_ps(fa + KLANES * i)));
        }
    }
    for (int i = 0; i < N; i++) out[i * stride] = ksum(fa + KLANES * i);
}

#define ROW_Q4K row_q4k_avx2
#define ROW_Q6K row_q6k_avx2
#elif defined(LEVER_AVX512)
#define ROW_Q4K row_q4k_512
#define ROW_Q6K row_q6k_512
#endif

#ifdef LEVER_AVX2
/* K-quant weight rows [j0, j1) against n <= KQ_MAX activation rows (bs16 as py_matmul converts it).
 * The row PREFETCH_ROWS ahead is prefetched block by block as the row kernel goes (pf), not all at
 * once before it: a whole long row (ffn_down: 7350 bytes of Q6_K, 115 lines) issued at once stalled
 * the kernel on its prefetches, and one activation row of it streamed from DRAM in 0.55 ms against
 * 0.30 ms block by block (AVX-512, one thread; the AVX2 build on that host: 0.62 against 0.45). */
#define KQ_ROW(FN, NN) FN(w + (size_t)j * rb, nsb, k, NN, q, d, bs16, out + j, stride, pf)
#define KQ_ROWS(FN)                                                                                  \
    for (int64_t j = j0; j < j1; j++) {                                                              \
        const uint8_t *pf = j + PREFETCH_ROWS < j1 ? w + (size_t)(j + PREFETCH_ROWS) * rb : NULL;    \
        switch (n) { /* literal shapes, each compiled for its own; KQ_MAX cases */                   \
        case 1: KQ_ROW(FN, 1); break;                                                                \
        case 2: KQ_ROW(FN, 2); break;                                                                \
        case 3: KQ_ROW(FN, 3); break;                                                                \
        case 4: KQ_ROW(FN, 4); break;                                                                \
        case 5: KQ_ROW(FN, 5); break;                                                                \
        case 6: KQ_ROW(FN, 6); break;                                                                \
        case 7: KQ_ROW(FN, 7); break;                                                                \
        case 8: KQ_ROW(FN, 8); break;                                                                \
        case 9: KQ_ROW(FN, 9); break;                                                                \
        case 10: KQ_ROW(FN, 10); break;                                                              \
        case 11: KQ_ROW(FN, 11); break;                                                              \
        default: KQ_ROW(FN, 12); break;                                                              \
        }                                                                                            \
    }
static void few_rows_kq(int type, const uint8_t *w, size_t rb, int64_t j0, int64_t j1, int64_t k, int64_t n,
                        const int8_t *q, const float *d, const int16_t *bs16, float *out, int64_t stride) {
    const int64_t nsb = n_groups(k);
    if (type == T_Q4_K) { KQ_ROWS(ROW_Q4K) }
    else { KQ_ROWS(ROW_Q6K) }
}
#undef KQ_ROWS
#undef KQ_ROW
#endif

/* ------------------------------------------------------ fp32 activation path */

/* Weights of one 256-block as floats, exactly as GGUF dequantizes them. */
static void dequant_block(int type, const uint8_t *b, float *w, int64_t gl) {
    if (type == T_Q4_K) {
        float dw = f16_to_f32(b), dmin = f16_to_f32(b + 2);
        uint8_t sc[8], mn[8];
        q4k_scale_min(b + 4, sc, mn);
        const uint8_t *qs = b + 16;
        for (int c = 0; c < 4; c++) {
            float d0 = dw * sc[2 * c], m0 = dmin * mn[2 * c], d1 = dw * sc[2 * c + 1], m1 = dmin * mn[2 * c + 1];
            for (int l = 0; l < 32; l++) {
                w[64 * c + l] = fmaf(d0, (float)(qs[32 * c + l] & 0xF), -m0); /* ggml's d*q - m, contracted */
                w[64 * c + 32 + l] = fmaf(d1, (float)(qs[32 * c + l] >> 4), -m1);
            }
        }
    } else if (type == T_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float dw = f16_to_f32(b + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *l = ql + 64 * h, *hh = qh + 32 * h;
            float *o = w + 128 * h;
            for (int i = 0; i < 32; i++) {
                int q1 = (l[i] & 0xF) | ((hh[i] & 3) << 4), q2 = (l[32 + i] & 0xF) | (((hh[i] >> 2) & 3) << 4);
                int q3 = (l[i] >> 4) | (((hh[i] >> 4) & 3) << 4), q4 = (l[32 + i] >> 4) | (((hh[i] >> 6) & 3) << 4);
                o[i] = (dw * (float)sc[8 * h + i / 16]) * (float)(q1 - 32);
                o[32 + i] = (dw * (float)sc[8 * h + 2 + i / 16]) * (float)(q2 - 32);
                o[64 + i] = (dw * (float)sc[8 * h + 4 + i / 16]) * (float)(q3 - 32);
                o[96 + i] = (dw * (float)sc[8 * h + 6 + i / 16]) * (float)(q4 - 32);
            }
        }
    } else if (type == T_Q8_0) {
        for (int c = 0; c < gl / 32; c++) {
            const uint8_t *blk = b + 34 * c;
            float dw = f16_to_f32(blk);
            for (int e = 0; e < 32; e++) w[32 * c + e] = dw * (float)((const int8_t *)(blk + 2))[e];
        }
    } else if (type == T_Q5_0R || type == T_Q4_0R) { /* back to GGUF blocks first: a group is one row of gl columns */
        const int plain = type == T_Q5_0R ? T_Q5_0 : T_Q4_0;
        uint8_t g[176];
        memcpy(g, b, (size_t)(gl / 32) * q32_block_bytes(type));
        q32_pairs(plain, g, 1, gl, 0);
        dequant_block(plain, g, w, gl);
    } else if (type == T_Q5_0 || type == T_Q4_0) {
        for (int c = 0; c < gl / 32; c++) {
            int8_t wq[32];
            float dw;
            if (type == T_Q4_0) unpack_q4_0(b + 18 * c, wq, &dw);
            else unpack_q5_0(b + 22 * c, wq, &dw);
            for (int e = 0; e < 32; e++) w[32 * c + e] = dw * (float)wq[e];
        }
    } else {
        memcpy(w, b, (size_t)gl * sizeof(float));
    }
}

/* fp32 dot over d (a multiple of 8): eight lane partials (fused multiply-add), combined in a
 * fixed tree, so the result depends only on the operands, never on what else runs */
static inline float dot_d(const float *a, const float *b, int64_t d) {
#ifdef LEVER_AVX2
    __m256 p = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; e += 8) p = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), p);
    float l[8];
    _mm256_storeu_ps(l, p);
#else
    float l[8] = {0};
    for (int64_t e = 0; e < d; e += 8)
        for (int j = 0; j < 8; j++) l[j] = fmaf(a[e + j], b[e + j], l[j]);
#endif
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}


/* ------------------------------------------------------------------- driver */

typedef struct {
    int type;
    const uint8_t *w;
    int64_t k, n, j0, j1;
    const int8_t *q;
    const float *d;
    const int32_t *bsums;
    const int16_t *bs16; /* bsums as int16 (the width llama.cpp's q8_K keeps them in), for the SIMD K-quant kernels */
    const int32_t *corr; /* lane sums times the code bias, for the AVX-512 few-row 32-block kernel */
    const int32_t *bias; /* Q4_0T: -8 times the activations' block sums (q4_0t_bias) */
    int amx; /* Q4_0T: by AMX tiles */
    const float *x; /* fp32 path when non-NULL */
    float *out;
    int64_t out_stride;
    int failed;
} Job;

/* Weight rows go in groups of ROW_GROUP so one 256-column slice of all the
 * activation rows (N x 256 bytes) stays in L1 while every row of the group uses
 * it; the reduction order of each output is unchanged (blocks s in order). */
#define ROW_GROUP 16
/* More than four activation rows take the Q8_0 / Q5_0 few-row kernel four rows at a time, over
 * slices of Q32_SLICE weight rows that stay in cache from one four to the next (64 rows of the
 * draft's 896 columns are 38 KiB of Q5_0) */
#define Q32_SLICE 64
#define KQ_SLICE 32

static void *run_job(void *arg) {
    Job *jb = (Job *)arg;
    const size_t rb = row_bytes(jb->type, jb->k);
    const int64_t nsb = n_groups(jb->k), n = jb->n > 0 ? jb->n : 1;
    if (jb->type == T_Q4_0T) { /* rows j0 and j1 are whole strips (run_split) */
        q4_0t_rows(jb->amx, jb->w, jb->k, jb->j0 / 16, jb->j1 / 16, jb->n, jb->q, jb->d, jb->bias, jb->out, jb->out_stride);
        return NULL;
    }
#ifdef LEVER_AVX2
    if (jb->corr) {
        /* the few-row 32-block kernel (AVX-512: Q8_0 / Q5_0 / Q5_0R / Q4_0; AVX2: Q5_0R), more than four rows
         * four at a time over cached slices (the grouped loop below took 2.1x as long for five rows
         * as for four, 3x for eight) */
        const int64_t k4 = jb->k / 4;
        for (int64_t s0 = jb->j0; s0 < jb->j1; s0 += Q32_SLICE) {
            const int64_t s1 = jb->j1 - s0 < Q32_SLICE ? jb->j1 : s0 + Q32_SLICE;
            for (int64_t i0 = 0; i0 < n; i0 += 4)
#ifdef LEVER_AVX512
                few_rows_q32_512(jb->type, jb->w, rb, s0, s1, jb->k, n - i0 < 4 ? n - i0 : 4, jb->q + i0 * jb->k,
                                 jb->d + i0 * nsb, jb->corr + i0 * k4, jb->out + i0 * jb->out_stride, jb->out_stride);
#else
                few_rows_q5r_avx2(jb->w, rb, s0, s1, jb->k, n - i0 < 4 ? n - i0 : 4, jb->q + i0 * jb->k,
                                  jb->d + i0 * nsb, jb->corr + i0 * k4, jb->out + i0 * jb->out_stride, jb->out_stride);
#endif
        }
        return NULL;
    }
#endif
#ifdef LEVER_AVX2
#ifdef LEVER_AVX512
    if (!jb->x && is_kquant(jb->type) && (jb->n < KQ_MAX ? jb->n : KQ_MAX) * jb->k <= KQ_ROW_BYTES) {
#else
    if (!jb->x && is_kquant(jb->type)) {
#endif
        /* the K-quant row kernel, more than KQ_MAX rows KQ_MAX at a time over cached slices */
        const int64_t per = jb->type == T_Q4_K ? 8 : 16;
        for (int64_t s0 = jb->j0; s0 < jb->j1; s0 += KQ_SLICE) {
            const int64_t s1 = jb->j1 - s0 < KQ_SLICE ? jb->j1 : s0 + KQ_SLICE;
            for (int64_t i0 = 0; i0 < jb->n; i0 += KQ_MAX)
                few_rows_kq(jb->type, jb->w, rb, s0, s1, jb->k, jb->n - i0 < KQ_MAX ? jb->n - i0 : KQ_MAX, jb->q + i0 * jb->k,
                                 jb->d + i0 * nsb, jb->bs16 + i0 * nsb * per, jb->out + i0 * jb->out_stride, jb->out_stride);
        }
        return NULL;
    }
#endif
    const int64_t lanes = !jb->x && is_kquant(jb->type) ? KLANES : !jb->x && is_q32(jb->type) ? 8 : 1;
    float *acc = malloc(sizeof(float) * (size_t)(n * ROW_GROUP * lanes));
    float *wf = jb->x ? malloc(sizeof(float) * QK) : NULL;
    if (!acc || (jb->x && !wf)) { jb->failed = 1; free(acc); free(wf); return NULL; }
    const size_t block = group_bytes(jb->type);
    /* a few activation rows gain nothing from grouping: stream each weight row contiguously (the
     * draft's batched levels of 3-4 rows ran 15% faster so, from DRAM-resident weights) */
    const int64_t group = jb->n <= 4 ? 1 : ROW_GROUP;
    for (int64_t j0 = jb->j0; j0 < jb->j1; j0 += group) {
        const int64_t rows = jb->j1 - j0 < group ? jb->j1 - j0 : group;
        const int64_t ahead = j0 + (group > PREFETCH_ROWS ? group : PREFETCH_ROWS);
        memset(acc, 0, sizeof(float) * (size_t)(n * rows * lanes));
        for (int64_t s = 0; s < nsb; s++) {
            for (int64_t r = 0; r < rows; r++) {
                const uint8_t *b = jb->w + (size_t)(j0 + r) * rb + (size_t)s * block;
                float *ar = acc + r * n * lanes;
                if (ahead + r < jb->j1) { /* the same block of a row further on (see PREFETCH_ROWS) */
                    const char *p = (const char *)jb->w + (size_t)(ahead + r) * rb + (size_t)s * block;
                    for (size_t o = 0; o < block; o += 64) __builtin_prefetch(p + o, 0, 3);
                }
                if (jb->x) {
                    const int64_t gl = group_len(jb->k, s);
                    dequant_block(jb->type, b, wf, gl);
                    for (int64_t i = 0; i < jb->n; i++) ar[i] += dot_d(wf, jb->x + i * jb->k + s * QK, gl);
                }
#ifdef LEVER_AVX512
                else if (jb->type == T_Q4_K) block_q4k_512(b, s, jb->k, jb->n, jb->q, jb->d, jb->bs16, ar);
                else if (jb->type == T_Q6_K) block_q6k_512(b, s, jb->k, jb->n, jb->q, jb->d, jb->bs16, ar);
#endif
#if defined(LEVER_AVX2) && !defined(LEVER_AVX512) /* AVX-512: the 32-block types went to rows_q32_512 above */
                else if (lanes == 8) block_q32_avx2(jb->type, b, s, jb->k, jb->n, jb->q, jb->d, ar);
#endif
                else block_q8(jb->type, b, s, jb->k, jb->n, jb->q, jb->d, jb->bsums, ar);
            }
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < jb->n; i++) {
                const float *a = acc + (r * n + i) * lanes;
                jb->out[i * jb->out_stride + j0 + r] = lanes == KLANES ? ksum(a) : lanes == 8 ? hsum8(a) : a[0];
            }
    }
    free(acc);
    free(wf);
    return NULL;
}

/* A pool of persistent workers for run_jobs. Creating a thread per call cost more than the work
 * of a small matmul (a 0.5B draft token makes ~170 calls), so lending a second core to a draft made
 * it slower. Workers spin briefly after a job (the next call of a draft step comes within tens of
 * microseconds) and then sleep on a condition variable, so an idle pool costs no CPU. One caller
 * at a time owns the pool; a concurrent caller (the other lane) creates threads as before. */
#define POOL_MAX 15
#define POOL_SPIN 20000 /* polls before sleeping: roughly 100 us */
typedef struct {
    pthread_mutex_t lock;     /* one caller at a time */
    pthread_mutex_t wake_mu;
    pthread_cond_t wake;
    int started;                  /* workers running */
    _Atomic unsigned long ticket; /* (dispatch number << 5) | jobs in it: one load tells a worker both */
    _Atomic int pending;          /* jobs of the current dispatch not yet done */
    void *(*fn)(void *);
    char *jobs;
    size_t size;
    unsigned long born[POOL_MAX + 1]; /* the ticket before a worker's first dispatch */
} Pool;
static Pool pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void *pool_worker(void *arg) {
    const unsigned long id = (unsigned long)(intptr_t)arg; /* 1-based: job 0 is the caller's */
    unsigned long seen = pool.born[id]; /* not the ticket now: it may already be our first dispatch */
    for (;;) {
        unsigned long t;
        int spins = 0;
        while ((t = atomic_load_explicit(&pool.ticket, memory_order_acquire)) == seen && spins < POOL_SPIN) spins++;
        if (t == seen) {
            pthread_mutex_lock(&pool.wake_mu);
            while ((t = atomic_load(&pool.ticket)) == seen) pthread_cond_wait(&pool.wake, &pool.wake_mu);
            pthread_mutex_unlock(&pool.wake_mu);
        }
        seen = t;
        /* a job of this dispatch is ours: the dispatch cannot end (nor the next one rewrite fn and
         * jobs) before we are done with it. A dispatch we missed did not need us. */
        if (id < (t & 31)) {
            pool.fn(pool.jobs + id * pool.size);
            atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
        }
    }
    return NULL;
}

/* Run jobs[0..n) (each `size` bytes) with `fn`: job 0 on the calling thread, the others on the
 * pool's workers (on threads of their own when another caller has the pool; inline when a thread
 * cannot be created). */
static void run_jobs(void *(*fn)(void *), void *jobs, size_t size, int n) {
    if (n > 1 && pthread_mutex_trylock(&pool.lock) == 0) {
        while (pool.started < n - 1 && pool.started < POOL_MAX) {
            pthread_t tid;
            pool.born[pool.started + 1] = atomic_load(&pool.ticket);
            if (pthread_create(&tid, NULL, pool_worker, (void *)(intptr_t)(pool.started + 1)) != 0) break;
            pthread_detach(tid);
            pool.started++;
        }
        const int m = n - 1 < pool.started ? n : pool.started + 1; /* jobs the workers can take */
        pool.fn = fn; pool.jobs = jobs; pool.size = size;
        atomic_store(&pool.pending, m - 1);
        pthread_mutex_lock(&pool.wake_mu);
        const unsigned long next = ((atomic_load(&pool.ticket) >> 5) + 1) << 5;
        atomic_store_explicit(&pool.ticket, next | (unsigned long)m, memory_order_release);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.wake_mu);
        fn(jobs);
        for (int t = m; t < n; t++) fn((char *)jobs + t * size);
        while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) sched_yield();
        pthread_mutex_unlock(&pool.lock);
        return;
    }
    pthread_t tid[16];
    int started[16] = {0};
    for (int t = 1; t < n; t++) started[t] = pthread_create(&tid[t], NULL, fn, (char *)jobs + t * size) == 0;
    fn(jobs);
    for (int t = 1; t < n; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else fn((char *)jobs + t * size);
    }
}

static int clamp_threads(int threads, int64_t work, int64_t min_per_thread) {
    if (threads > 16) threads = 16;
    while (threads > 1 && work < min_per_thread * threads) threads--;
    return threads < 1 ? 1 : threads;
}

/* Split weight rows [0, m) across `threads` (each row's reduction stays in one thread; Q4_0T's
 * strips of 16 rows stay whole). */
static int run_split(Job proto, int64_t m, int threads) {
    threads = clamp_threads(threads, m, 64);  /* at least 64 rows per thread */
    const int64_t unit = proto.type == T_Q4_0T ? 16 : 1;
    Job jobs[16];
    int failed = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = proto;
        jobs[t].j0 = m / unit * t / threads * unit;
        jobs[t].j1 = m / unit * (t + 1) / threads * unit;
    }
    run_jobs(run_job, jobs, sizeof(Job), threads);
    for (int t = 0; t < threads; t++) failed |= jobs[t].failed;
    return failed;
}

/* ------------------------------------------------------------ Python glue */

static int need(Py_buffer *b, Py_ssize_t bytes, const char *what) {
    if (b->len < bytes) {
        PyErr_Format(PyExc_ValueError, "%s: buffer of %zd bytes, need %zd", what, b->len, bytes);
        return 0;
    }
    return 1;
}

/* A weight type this module knows and a row length whole in its blocks; 0 with a ValueError set if not */
static int known_rows(int type, Py_ssize_t k) {
    if (type < T_Q4_K || type > T_LAST) {
        PyErr_Format(PyExc_ValueError, "unknown weight type %d", type);
        return 0;
    }
    if (k % (is_kquant(type) ? QK : 32)) {
        PyErr_Format(PyExc_ValueError, "row length %zd is not a multiple of %d", k, is_kquant(type) ? QK : 32);
        return 0;
    }
    return 1;
}

static PyObject *py_quantize_rows(PyObject *self, PyObject *args) {
    Py_buffer x, q, d, bs;
    Py_ssize_t n, k;
    if (!PyArg_ParseTuple(args, "y*w*w*w*nn", &x, &q, &d, &bs, &n, &k)) return NULL;
    PyObject *ret = NULL;
    if (k % 32) { PyErr_Format(PyExc_ValueError, "row length %zd is not a multiple of 32", k); goto done; }
    const Py_ssize_t g = n_groups(k);
    if (!need(&x, n * k * 4, "x") || !need(&q, n * k, "q") || !need(&d, n * g * 4, "d") ||
        !need(&bs, n * g * 16 * 4, "bsums"))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        quantize_row((const float *)x.buf + i * k, k, (int8_t *)q.buf + i * k, (float *)d.buf + i * g,
                     (int32_t *)bs.buf + i * g * 16);
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&x); PyBuffer_Release(&q); PyBuffer_Release(&d); PyBuffer_Release(&bs);
    return ret;
}

/* matmul(type, w, m, k, q, d, bsums, x, n, out, out_stride, threads): x is None for the int8 path */
static PyObject *py_matmul(PyObject *self, PyObject *args) {
    int type, threads;
    Py_buffer w, q, d, bs, x, out;
    PyObject *xo;
    Py_ssize_t m, k, n, stride;
    if (!PyArg_ParseTuple(args, "iy*nny*y*y*Onw*ni", &type, &w, &m, &k, &q, &d, &bs, &xo, &n, &out, &stride, &threads))
        return NULL;
    PyObject *ret = NULL;
    int16_t *bs16 = NULL; /* converted once here, not in every thread */
    int32_t *corr = NULL; /* likewise */
    int32_t *bias = NULL; /* likewise */
    int have_x = xo != Py_None;
    if (have_x && PyObject_GetBuffer(xo, &x, PyBUF_SIMPLE) < 0) goto done0;
    if (!known_rows(type, k)) goto done;
#ifndef LEVER_AVX2
    if (type == T_Q5_0R) { PyErr_SetString(PyExc_ValueError, "repacked Q5_0 needs the AVX2 or AVX-512 kernels"); goto done; }
#endif
#ifndef LEVER_AVX512
    if (type == T_Q4_0R) { PyErr_SetString(PyExc_ValueError, "repacked Q4_0 needs the AVX-512 kernels"); goto done; }
#endif
    if (type == T_Q4_0T && have_x) { PyErr_SetString(PyExc_ValueError, "tiled Q4_0 takes int8 activations"); goto done; }
    if (type == T_Q4_0T && m % 16) { PyErr_Format(PyExc_ValueError, "tiled Q4_0 has rows in strips of 16, got %zd", m); goto done; }
    const Py_ssize_t g = n_groups(k);
    if (type == T_F32 && !have_x) { PyErr_SetString(PyExc_TypeError, "F32 weights need fp32 activations"); goto done; }
    if (!need(&w, m * (Py_ssize_t)row_bytes(type, k), "weights") || !need(&out, ((n - 1) * stride + m) * 4, "out"))
        goto done;
    if (have_x ? !need(&x, n * k * 4, "x")
               : (!need(&q, n * k, "q") || !need(&d, n * g * 4, "d") || !need(&bs, n * g * 16 * 4, "bsums")))
        goto done;
    int amx = 0;
    if (type == T_Q4_0T && n > 0) {
#ifdef LEVER_AMX
        amx_request();
        amx = atomic_load(&amx_on);
#endif
        if (!(bias = malloc(sizeof(int32_t) * (size_t)(n * (k / 32))))) { PyErr_NoMemory(); goto done; }
        q4_0t_bias(bs.buf, k, n, bias);
    }
#ifdef LEVER_AVX2
    if (!have_x && is_kquant(type) && n > 0) {
        if (!(bs16 = malloc(sizeof(int16_t) * (size_t)(n * g * (type == T_Q4_K ? 8 : 16))))) { PyErr_NoMemory(); goto done; }
        const int32_t *b32 = (const int32_t *)bs.buf;
        if (type == T_Q4_K) /* the Q4_K kernels take the sums of adjacent pairs (their min lanes' hadd), once per row */
            for (Py_ssize_t e = 0; e < n * g * 8; e++) bs16[e] = (int16_t)((int16_t)b32[2 * e] + (int16_t)b32[2 * e + 1]);
        else
            for (Py_ssize_t e = 0; e < n * g * 16; e++) bs16[e] = (int16_t)b32[e];
    }
#endif
#ifdef LEVER_AVX512
    if (!have_x && is_q32(type) && n > 0) {
#elif defined(LEVER_AVX2)
    if (!have_x && type == T_Q5_0R && n > 0) { /* AVX2: Q8_0's codes would overflow maddubs unsigned */
#else
    if (0) {
#endif
        if (!(corr = malloc(sizeof(int32_t) * (size_t)(n * (k / 4))))) { PyErr_NoMemory(); goto done; }
        q32_corrections(type, q.buf, k, n, corr);
    }
    Job job = {.type = type, .w = w.buf, .k = k, .n = n, .j0 = 0, .j1 = m, .q = q.buf, .d = d.buf, .bsums = bs.buf,
               .bs16 = bs16, .corr = corr, .bias = bias, .amx = amx, .x = have_x ? x.buf : NULL, .out = out.buf,
               .out_stride = stride, .failed = 0};
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = run_split(job, m, threads);
    Py_END_ALLOW_THREADS
    if (failed) { PyErr_NoMemory(); goto done; }
    ret = Py_None;
    Py_INCREF(ret);
done:
    if (have_x) PyBuffer_Release(&x);
done0:
    free(bs16);
    free(corr);
    free(bias);
    PyBuffer_Release(&w); PyBuffer_Release(&q); PyBuffer_Release(&d); PyBuffer_Release(&bs); PyBuffer_Release(&out);
    return ret;
}

static PyObject *py_rmsnorm(PyObject *self, PyObject *args) {
    Py_buffer x, wt, out;
    Py_ssize_t n, k;
    double eps;
    if (!PyArg_ParseTuple(args, "y*y*w*nnd", &x, &wt, &out, &n, &k, &eps)) return NULL;
    PyObject *ret = NULL;
    if (!need(&x, n * k * 4, "x") || !need(&wt, k * 4, "weight") || !need(&out, n * k * 4, "out")) goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const float *xi = (const float *)x.buf + i * k;
        float *o = (float *)out.buf + i * k;
        /* ggml's rms_norm: float squares summed in double, then a float mean and scale */
        double ss = 0.0;
        for (Py_ssize_t e = 0; e < k; e++) ss += (double)(xi[e] * xi[e]);
        const float mean = (float)(ss / (double)k);
        const float scale = 1.0f / sqrtf(mean + (float)eps);
        for (Py_ssize_t e = 0; e < k; e++) o[e] = (xi[e] * scale) * ((const float *)wt.buf)[e];
    }
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&x); PyBuffer_Release(&wt); PyBuffer_Release(&out);
    return ret;
}

/* exp as ggml's vectorized SiLU computes it (ggml_v_expf, AVX-512 form): a range reduction
 * and a degree-5 polynomial, all fused multiply-adds, then scaling by 2^n. Computing the FFN
 * gate the way llama.cpp does keeps our greedy output on its near-ties. */
static inline float ggml_expf(float x) {
    const float r = 0x1.8p23f;
    const float z = fmaf(x, 0x1.715476p+0f, r);
    const float n = z - r;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                         fmaf(0x1.ffffecp-1f, b, 1.0f));
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
    return ldexpf(j, (int)n);
}

#ifdef LEVER_AVX512
/* ggml_expf on 16 lanes: the same fused multiply-adds in the same order; scalef scales by 2^n
 * exactly as ldexpf does (one correctly rounded result, overflow to infinity, gradual underflow) */
static inline __m512 ggml_expf_512(__m512 x) {
    const __m512 r = _mm512_set1_ps(0x1.8p23f);
    const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r);
    const __m512 n = _mm512_sub_ps(z, r);
    const __m512 nn = _mm512_xor_ps(n, _mm512_set1_ps(-0.0f));
    const __m512 b = _mm512_fmadd_ps(nn, _mm512_set1_ps(0x1.7f7d1cp-20f), _mm512_fmadd_ps(nn, _mm512_set1_ps(0x1.62e4p-1f), x));
    const __m512 u = _mm512_mul_ps(b, b);
    const __m512 j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
                        _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
        u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
    const __m512 scaled = _mm512_scalef_ps(j, n);
    const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192.0f), _CMP_GT_OQ);
    const __mmask16 low = _mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ);
    const __m512 edge = _mm512_mask_blend_ps(low, _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
    return _mm512_mask_blend_ps(big, scaled, edge);
}
#endif

#if defined(LEVER_AVX2) && !defined(LEVER_AVX512)
/* ggml_expf on 8 lanes: the same fused multiply-adds in the same order. 2^n is applied as two
 * powers of two, 2^a then 2^(n - a) with a = floor(n / 2), both normal for |n| <= 192: the first
 * product is exact, so a result among the subnormals is rounded once, as ldexpf rounds it. */
static inline __m256 pow2_avx2(__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); }

static inline __m256 ggml_expf_avx2(__m256 x) {
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 nn = _mm256_xor_ps(n, _mm256_set1_ps(-0.0f));
    const __m256 b = _mm256_fmadd_ps(nn, _mm256_set1_ps(0x1.7f7d1cp-20f), _mm256_fmadd_ps(nn, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_fmadd_ps(_mm256_set1_ps(0x1.ffffecp-1f), b, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_cvtps_epi32(n), a = _mm256_srai_epi32(ni, 1);
    const __m256 scaled = _mm256_mul_ps(_mm256_mul_ps(j, pow2_avx2(a)), pow2_avx2(_mm256_sub_epi32(ni, a)));
    const __m256 big = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), n), _mm256_set1_ps(192.0f), _CMP_GT_OQ);
    const __m256 low = _mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ);
    const __m256 edge = _mm256_blendv_ps(_mm256_set1_ps(INFINITY), _mm256_setzero_ps(), low);
    return _mm256_blendv_ps(scaled, edge, big);
}
#endif

static PyObject *py_swiglu(PyObject *self, PyObject *args) {
    Py_buffer g, u, out;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "y*y*w*n", &g, &u, &out, &count)) return NULL;
    PyObject *ret = NULL;
    if (!need(&g, count * 4, "gate") || !need(&u, count * 4, "up") || !need(&out, count * 4, "out")) goto done;
    Py_BEGIN_ALLOW_THREADS
    const float *gp = g.buf, *up = u.buf;
    float *o = out.buf;
    Py_ssize_t e = 0;
#ifdef LEVER_AVX512
    for (; e + 16 <= count; e += 16) {
        const __m512 x = _mm512_loadu_ps(gp + e);
        _mm512_storeu_ps(o + e, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                             ggml_expf_512(_mm512_sub_ps(_mm512_setzero_ps(), x)))),
                                              _mm512_loadu_ps(up + e)));
    }
#elif defined(LEVER_AVX2)
    for (; e + 8 <= count; e += 8) {
        const __m256 x = _mm256_loadu_ps(gp + e);
        _mm256_storeu_ps(o + e, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                                             ggml_expf_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x)))),
                                              _mm256_loadu_ps(up + e)));
    }
#endif
    for (; e < count; e++) o[e] = (gp[e] / (1.0f + ggml_expf(0.0f - gp[e]))) * up[e];
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&g); PyBuffer_Release(&u); PyBuffer_Release(&out);
    return ret;
}

/* ---------------------------------------------------------------- attention
 * Row r attends to its first len[r] keys in the order perm[r] lists them (its
 * committed prefix, then its own ancestors and itself): the layout of a plain
 * autoregressive step. Everything below runs in that order with one lane per
 * head dimension, so a tree node's output is bit-identical to the one it would
 * get decoded alone, and no masked key costs anything. */

static inline void axpy_d(float p, const float *v, float *acc, int64_t d) {
#ifdef LEVER_AVX2
    __m256 pv = _mm256_set1_ps(p);
    for (int64_t e = 0; e < d; e += 8)
        _mm256_storeu_ps(acc + e, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + e), _mm256_loadu_ps(acc + e)));
#else
    for (int64_t e = 0; e < d; e++) acc[e] = fmaf(p, v[e], acc[e]);
#endif
}

/* The same two reductions over half-precision cache rows: each element widens exactly to fp32
 * first, so the lanes and their order, and with them batch and tree invariance, are unchanged. */
static inline void widen8(const uint16_t *h, float *f) {
#if defined(LEVER_AVX2) && defined(__F16C__)
    _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
#else
    for (int j = 0; j < 8; j++) f[j] = f16_to_f32((const uint8_t *)(h + j));
#endif
}

static inline float dot_dh(const float *a, const uint16_t *b, int64_t d) {
#if defined(LEVER_AVX2) && defined(__F16C__)
    __m256 p = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; e += 8)
        p = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + e))), p);
    float l[8];
    _mm256_storeu_ps(l, p);
#else
    float l[8] = {0}, w[8];
    for (int64_t e = 0; e < d; e += 8) {
        widen8(b + e, w);
        for (int j = 0; j < 8; j++) l[j] = fmaf(a[e + j], w[j], l[j]);
    }
#endif
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

static inline void axpy_dh(float p, const uint16_t *v, float *acc, int64_t d) {
#if defined(LEVER_AVX2) && defined(__F16C__)
    __m256 pv = _mm256_set1_ps(p);
    for (int64_t e = 0; e < d; e += 8)
        _mm256_storeu_ps(acc + e, _mm256_fmadd_ps(pv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + e))),
                                                  _mm256_loadu_ps(acc + e)));
#else
    float w[8];
    for (int64_t e = 0; e < d; e += 8) {
        widen8(v + e, w);
        for (int j = 0; j < 8; j++) acc[e + j] = fmaf(p, w[j], acc[e + j]);
    }
#endif
}

typedef struct {
    const float *q;
    const void *k, *v;  /* float, or uint16_t halves when f16 */
    const int64_t *perm, *len;
    float *out;
    int64_t n, nh, kvh, d, c, r0, r1, pstride;
    float scale;
    int f16;
    int failed;
} AttnJob;

#if defined(LEVER_AVX2) && defined(__F16C__)
#define ATTN_VECS 4 /* output vectors per head held in registers while the keys go by */
/* The G query heads that share one KV head, together: each half-precision key and value row is
 * widened once for all G, and the G dot products run as G independent chains (one alone waits on
 * its own fused adds). Per head, every operation and its order are those of the one-head loop in
 * run_attn (dot_dh's lanes and sum, the running max, expf, the sum and axpy_dh over keys in
 * order), so the bits are the same. ``s`` holds G * c scores. */
static inline __attribute__((always_inline)) void attn_group_f16(
    const float *q, const uint16_t *kh16, const uint16_t *vh16, const int64_t *pr, int64_t len, int64_t d,
    int64_t c, float scale, float *s, float *out, const int G) {
    float mx[8], sum[8];
    for (int g = 0; g < G; g++) mx[g] = -INFINITY;
    for (int64_t j = 0; j < len; j++) {
        const uint16_t *kr = kh16 + pr[j] * d;
        __m256 p[8];
        for (int g = 0; g < G; g++) p[g] = _mm256_setzero_ps();
        for (int64_t e = 0; e < d; e += 8) {
            const __m256 kv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kr + e)));
            for (int g = 0; g < G; g++) p[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + e), kv, p[g]);
        }
        for (int g = 0; g < G; g++) {
            float l[8];
            _mm256_storeu_ps(l, p[g]);
            const float sc = (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) * scale;
            s[g * c + j] = sc;
            if (sc > mx[g]) mx[g] = sc;
        }
    }
    /* the weights first (each head's sum over keys in order), then the values a slice of ATTN_VECS
     * vectors at a time, every head's slice of the output held in registers across all keys */
    for (int g = 0; g < G; g++) {
        sum[g] = 0.0f;
        for (int64_t j = 0; j < len; j++) {
            const float p = expf(s[g * c + j] - mx[g]);
            s[g * c + j] = p;
            sum[g] += p;
        }
    }
    for (int64_t e0 = 0; e0 < d; e0 += 8 * ATTN_VECS) {
        const int ne = (int)((d - e0) / 8 < ATTN_VECS ? (d - e0) / 8 : ATTN_VECS);
        __m256 acc[8][ATTN_VECS];
        for (int g = 0; g < G; g++)
            for (int t = 0; t < ATTN_VECS; t++) acc[g][t] = _mm256_setzero_ps();
        for (int64_t j = 0; j < len; j++) {
            const uint16_t *vr = vh16 + pr[j] * d + e0;
            __m256 vv[ATTN_VECS];
            for (int t = 0; t < ATTN_VECS; t++)
                vv[t] = t < ne ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vr + 8 * t))) : _mm256_setzero_ps();
            for (int g = 0; g < G; g++) {
                const __m256 pv = _mm256_set1_ps(s[g * c + j]);
                for (int t = 0; t < ATTN_VECS; t++) acc[g][t] = _mm256_fmadd_ps(pv, vv[t], acc[g][t]);
            }
        }
        for (int g = 0; g < G; g++) {
            const float inv = len > 0 ? 1.0f / sum[g] : 0.0f;
            for (int t = 0; t < ne; t++) {
                float l[8];
                _mm256_storeu_ps(l, acc[g][t]);
                for (int u = 0; u < 8; u++) out[g * d + e0 + 8 * t + u] = l[u] * inv;
            }
        }
    }
}

#undef ATTN_VECS
/* run_attn for half-precision caches with at most 8 query heads per KV head; 0 if it does not apply */
static int run_attn_grouped(AttnJob *a) {
    const int64_t grp = a->nh / a->kvh;
    if (!a->f16 || grp < 1 || grp > 8) return 0;
    float *s = malloc(sizeof(float) * (size_t)(grp * (a->c > 0 ? a->c : 1)));
    if (!s) { a->failed = 1; return 1; }
    for (int64_t r = a->r0; r < a->r1; r++) {
        const int64_t *pr = a->perm + r * a->pstride, len = a->len[r];
        for (int64_t kv = 0; kv < a->kvh; kv++) {
            const int64_t h0 = kv * grp, head = kv * a->c * a->d;
            const float *qh = a->q + (r * a->nh + h0) * a->d;
            const uint16_t *kh16 = (const uint16_t *)a->k + head, *vh16 = (const uint16_t *)a->v + head;
            float *o = a->out + (r * a->nh + h0) * a->d;
            switch (grp) {
#define ATTN_CASE(G) case G: attn_group_f16(qh, kh16, vh16, pr, len, a->d, a->c, a->scale, s, o, G); break;
                ATTN_CASE(1) ATTN_CASE(2) ATTN_CASE(3) ATTN_CASE(4) ATTN_CASE(5) ATTN_CASE(6) ATTN_CASE(7) ATTN_CASE(8)
#undef ATTN_CASE
            }
        }
    }
    free(s);
    return 1;
}
#endif

static void *run_attn(void *arg) {
    AttnJob *a = (AttnJob *)arg;
#if defined(LEVER_AVX2) && defined(__F16C__)
    if (run_attn_grouped(a)) return NULL;
#endif
    float *s = malloc(sizeof(float) * (size_t)(a->c > 0 ? a->c : 1));
    if (!s) { a->failed = 1; return NULL; }
    const int64_t grp = a->nh / a->kvh;
    for (int64_t r = a->r0; r < a->r1; r++) {
        const int64_t *pr = a->perm + r * a->pstride, len = a->len[r];
        for (int64_t h = 0; h < a->nh; h++) {
            const float *qh = a->q + (r * a->nh + h) * a->d;
            const int64_t head = (h / grp) * a->c * a->d;
            const float *kh = (const float *)a->k + head, *vh = (const float *)a->v + head;
            const uint16_t *kh16 = (const uint16_t *)a->k + head, *vh16 = (const uint16_t *)a->v + head;
            float *o = a->out + (r * a->nh + h) * a->d;
            float mx = -INFINITY;
            for (int64_t j = 0; j < len; j++) {
                s[j] = (a->f16 ? dot_dh(qh, kh16 + pr[j] * a->d, a->d) : dot_d(qh, kh + pr[j] * a->d, a->d)) * a->scale;
                if (s[j] > mx) mx = s[j];
            }
            float sum = 0.0f;
            for (int64_t e = 0; e < a->d; e++) o[e] = 0.0f;
            for (int64_t j = 0; j < len; j++) {
                float p = expf(s[j] - mx);
                sum += p;
                if (a->f16) axpy_dh(p, vh16 + pr[j] * a->d, o, a->d);
                else axpy_d(p, vh + pr[j] * a->d, o, a->d);
            }
            float inv = len > 0 ? 1.0f / sum : 0.0f;
            for (int64_t e = 0; e < a->d; e++) o[e] *= inv;
        }
    }
    free(s);
    return NULL;
}

/* attention(q, k_cache, v_cache, perm, lengths, out, n, n_head, n_kv_head, head_dim, context, scale, threads, f16,
 *           shared_perm)
 * f16: the caches hold IEEE half-precision values (2 bytes each) instead of fp32.
 * shared_perm: perm is one row of key order that every row uses (a causal run), not [n, context]. */
static PyObject *py_attention(PyObject *self, PyObject *args) {
    Py_buffer q, k, v, perm, len, out;
    Py_ssize_t n, nh, kvh, d, c;
    double scale;
    int threads, f16, shared;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*nnnnndipp", &q, &k, &v, &perm, &len, &out, &n, &nh, &kvh, &d, &c, &scale,
                          &threads, &f16, &shared))
        return NULL;
    const Py_ssize_t pstride = shared ? 0 : c;
    PyObject *ret = NULL;
    const Py_ssize_t esize = f16 ? 2 : 4;
    if (d % 8 || kvh < 1 || nh % kvh) { PyErr_SetString(PyExc_ValueError, "head_dim must be a multiple of 8 and n_head of n_kv_head"); goto done; }
    if (!need(&q, n * nh * d * 4, "q") || !need(&k, kvh * c * d * esize, "k cache") || !need(&v, kvh * c * d * esize, "v cache") ||
        !need(&perm, (shared ? 1 : n) * c * 8, "perm") || !need(&len, n * 8, "lengths") || !need(&out, n * nh * d * 4, "out"))
        goto done;
    for (Py_ssize_t r = 0; r < n; r++) {
        int64_t l = ((const int64_t *)len.buf)[r];
        if (l < 0 || l > c) { PyErr_Format(PyExc_ValueError, "row %zd: length %lld outside [0, %zd]", r, (long long)l, c); goto done; }
        for (int64_t j = 0; j < l; j++) {
            int64_t key = ((const int64_t *)perm.buf)[r * pstride + j];
            if (key < 0 || key >= c) { PyErr_Format(PyExc_ValueError, "row %zd: key slot %lld outside the cache", r, (long long)key); goto done; }
        }
    }
    threads = clamp_threads(threads, n, 1);
    AttnJob jobs[16];
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        jobs[t] = (AttnJob){q.buf, k.buf, v.buf, perm.buf, len.buf, out.buf, n, nh, kvh, d, c, n * t / threads,
                            n * (t + 1) / threads, pstride, (float)scale, f16, 0};
    }
    run_jobs(run_attn, jobs, sizeof(AttnJob), threads);
    for (int t = 0; t < threads; t++) failed |= jobs[t].failed;
    Py_END_ALLOW_THREADS
    if (failed) { PyErr_NoMemory(); goto done; }
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&q); PyBuffer_Release(&k); PyBuffer_Release(&v); PyBuffer_Release(&perm); PyBuffer_Release(&len);
    PyBuffer_Release(&out);
    return ret;
}

/* rope_tables(positions int64 [n], half, base, cos [n, half], sin [n, half]): ggml's rope
 * cache: theta starts at the position and is multiplied by base^(-1/half) per pair, in float */
static PyObject *py_rope_tables(PyObject *self, PyObject *args) {
    Py_buffer pos, co, si;
    Py_ssize_t n, half;
    double base;
    if (!PyArg_ParseTuple(args, "y*nndw*w*", &pos, &n, &half, &base, &co, &si)) return NULL;
    PyObject *ret = NULL;
    if (!need(&pos, n * 8, "positions") || !need(&co, n * half * 4, "cos") || !need(&si, n * half * 4, "sin")) goto done;
    const float theta_scale = powf((float)base, -2.0f / (float)(2 * half));
    for (Py_ssize_t i = 0; i < n; i++) {
        float theta = (float)((const int64_t *)pos.buf)[i];
        float *c = (float *)co.buf + i * half, *sn = (float *)si.buf + i * half;
        for (Py_ssize_t j = 0; j < half; j++) {
            c[j] = cosf(theta);
            sn[j] = sinf(theta);
            theta *= theta_scale;
        }
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&pos); PyBuffer_Release(&co); PyBuffer_Release(&si);
    return ret;
}

/* rope(x [n, heads*d], cos, sin [n, d/2], n, heads, d, neox, out): each pair rotated as ggml's
 * C++ compiles x0*c - x1*s and x0*s + x1*c (its first product fused into the add) */
static PyObject *py_rope(PyObject *self, PyObject *args) {
    Py_buffer x, co, si, out;
    Py_ssize_t n, heads, d;
    int neox;
    if (!PyArg_ParseTuple(args, "y*y*y*nnnpw*", &x, &co, &si, &n, &heads, &d, &neox, &out)) return NULL;
    PyObject *ret = NULL;
    const Py_ssize_t half = d / 2;
    if (d % 2) { PyErr_SetString(PyExc_ValueError, "head_dim must be even"); goto done; }
    if (!need(&x, n * heads * d * 4, "x") || !need(&co, n * half * 4, "cos") || !need(&si, n * half * 4, "sin") ||
        !need(&out, n * heads * d * 4, "out"))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        const float *c = (const float *)co.buf + i * half, *sn = (const float *)si.buf + i * half;
        for (Py_ssize_t h = 0; h < heads; h++) {
            const float *xi = (const float *)x.buf + (i * heads + h) * d;
            float *o = (float *)out.buf + (i * heads + h) * d;
            for (Py_ssize_t j = 0; j < half; j++) {
                const Py_ssize_t a = neox ? j : 2 * j, b = neox ? j + half : 2 * j + 1;
                const float x0 = xi[a], x1 = xi[b];
                o[a] = fmaf(x0, c[j], -(x1 * sn[j]));
                o[b] = fmaf(x0, sn[j], x1 * c[j]);
            }
        }
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&x); PyBuffer_Release(&co); PyBuffer_Release(&si); PyBuffer_Release(&out);
    return ret;
}

/* dequantize(type, rows bytes, n, k, out float32 [n, k]): GGUF rows as llama.cpp's get_rows makes them */
static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    int type;
    Py_buffer w, out;
    Py_ssize_t n, k;
    if (!PyArg_ParseTuple(args, "iy*nnw*", &type, &w, &n, &k, &out)) return NULL;
    PyObject *ret = NULL;
    if (!known_rows(type, k)) goto done;
    if (type == T_Q4_0T) { PyErr_SetString(PyExc_ValueError, "tiled Q4_0 rows are dequantized after tile_q4_0(..., False)"); goto done; }
    if (!need(&w, n * (Py_ssize_t)row_bytes(type, k), "rows") || !need(&out, n * k * 4, "out")) goto done;
    const size_t rb = row_bytes(type, k), block = group_bytes(type);
    for (Py_ssize_t i = 0; i < n; i++)
        for (int64_t s = 0; s < n_groups(k); s++)
            dequant_block(type, (const uint8_t *)w.buf + i * rb + s * block, (float *)out.buf + i * k + s * QK,
                          group_len(k, s));
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&w); PyBuffer_Release(&out);
    return ret;
}

/* f32 to f16, rounding to nearest even (as numpy's astype(float16) and F16C do) */
static uint16_t f32_to_f16(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#endif
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0)); /* inf, nan */
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00);                                 /* overflows */
    if (ax < 0x38800000) { /* a subnormal half (or zero): round the value times 2^24 to an integer */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint16_t)nearbyintf(a * 16777216.0f));
    }
    const uint32_t m = ax + 0xc8000fff + ((ax >> 13) & 1); /* rebias the exponent, round to even */
    return (uint16_t)(sign | (m >> 13));
}

/* requantize_q4_0(type, w, n, k, out): n rows of any weight type to Q4_0, by gguf's reference: each
 * block's weights dequantized as GGUF does, d = (the weight largest in magnitude) / -8, codes
 * trunc(w / d + 8.5) up to 15. For the draft only (its proposals, never the output, depend on it). */
static PyObject *py_requantize_q4_0(PyObject *self, PyObject *args) {
    int type;
    Py_buffer w, out;
    Py_ssize_t n, k;
    if (!PyArg_ParseTuple(args, "iy*nnw*", &type, &w, &n, &k, &out)) return NULL;
    PyObject *ret = NULL;
    if (!known_rows(type, k)) goto done;
    if (type == T_Q4_0T) { PyErr_SetString(PyExc_ValueError, "tiled Q4_0 is requantized already"); goto done; }
    if (!need(&w, n * (Py_ssize_t)row_bytes(type, k), "weights") || !need(&out, n * (Py_ssize_t)row_bytes(T_Q4_0, k), "out"))
        goto done;
    const size_t rb = row_bytes(type, k);
    float x[QK];
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *row = (const uint8_t *)w.buf + (size_t)i * rb;
        uint8_t *o = (uint8_t *)out.buf + (size_t)i * row_bytes(T_Q4_0, k);
        for (int64_t s = 0; s < n_groups(k); s++) {
            const int64_t gl = group_len(k, s);
            dequant_block(type, row + (size_t)s * group_bytes(type), x, gl);
            for (int64_t c = 0; c < gl / 32; c++) {
                const float *v = x + 32 * c;
                uint8_t *blk = o + (size_t)(s * (QK / 32) + c) * 18;
                float amax = fabsf(v[0]), max = v[0]; /* the first of the largest, as gguf's argmax (a -0 too) */
                for (int e = 1; e < 32; e++)
                    if (fabsf(v[e]) > amax) { amax = fabsf(v[e]); max = v[e]; }
                const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
                const uint16_t h = f32_to_f16(d);
                memcpy(blk, &h, 2);
                for (int e = 0; e < 16; e++) {
                    const float q0 = truncf(v[e] * id + 8.5f), q1 = truncf(v[e + 16] * id + 8.5f);
                    const int c0 = q0 > 15.0f ? 15 : (int)q0, c1 = q1 > 15.0f ? 15 : (int)q1;
                    blk[2 + e] = (uint8_t)(c0 | (c1 << 4));
                }
            }
        }
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return ret;
}

/* repack_pairs(type, w, n, k, to_repacked): n Q5_0 (Q4_0) rows of k columns to Q5_0R (Q4_0R) in place, or back */
static PyObject *py_repack_pairs(PyObject *self, PyObject *args) {
    Py_buffer w;
    Py_ssize_t n, k;
    int type, to_repacked;
    if (!PyArg_ParseTuple(args, "iw*nnp", &type, &w, &n, &k, &to_repacked)) return NULL;
    PyObject *ret = NULL;
    if (type != T_Q5_0 && type != T_Q4_0) { PyErr_Format(PyExc_ValueError, "only Q5_0 and Q4_0 rows are repacked, not type %d", type); goto done; }
    if (k % 32) { PyErr_Format(PyExc_ValueError, "row length %zd is not a multiple of 32", k); goto done; }
    if (!need(&w, n * (Py_ssize_t)row_bytes(type, k), "rows")) goto done;
    q32_pairs(type, w.buf, n, k, to_repacked);
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&w);
    return ret;
}

/* tile_q4_0(src, n, k, dst, to_tiled): n Q4_0 rows (a multiple of 16) of k columns to Q4_0T in dst, or back;
 * dst may be src (a strip at a time goes through a strip of scratch) */
static PyObject *py_tile_q4_0(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t n, k;
    int to_tiled;
    if (!PyArg_ParseTuple(args, "y*nnw*p", &src, &n, &k, &dst, &to_tiled)) return NULL;
    PyObject *ret = NULL;
    uint8_t *scratch = NULL;
    if (k % 32 || n % 16) { PyErr_Format(PyExc_ValueError, "tiled Q4_0 needs rows in 16s of a multiple of 32 columns, got %zd x %zd", n, k); goto done; }
    const Py_ssize_t bytes = n * (Py_ssize_t)row_bytes(T_Q4_0, k);
    if (!need(&src, bytes, "src") || !need(&dst, bytes, "dst")) goto done;
    const size_t strip = 16 * row_bytes(T_Q4_0, k);
    if (!(scratch = malloc(strip))) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t t = 0; t < n / 16; t++) {
        memcpy(scratch, (const uint8_t *)src.buf + t * strip, strip);
        if (to_tiled) q4_0t_strip(scratch, k, (uint8_t *)dst.buf + t * strip, 1);
        else q4_0t_strip((uint8_t *)dst.buf + t * strip, k, scratch, 0);
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    free(scratch);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return ret;
}

/* amx(on) -> (on now, built, the kernel's refusal errno or 0): whether Q4_0T matmuls use AMX from now on
 * (on: -1 only asks; 0 the portable path, for tests; 1 AMX where granted). Asks the kernel once. */
static PyObject *py_amx(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "i", &on)) return NULL;
#ifdef LEVER_AMX
    amx_request();
    if (on >= 0) atomic_store(&amx_on, on && amx_errno == 0);
    return Py_BuildValue("(OOi)", atomic_load(&amx_on) ? Py_True : Py_False, Py_True, amx_errno);
#else
    (void)on;
    return Py_BuildValue("(OOi)", Py_False, Py_False, 0);
#endif
}

static PyObject *py_simd(PyObject *self, PyObject *args) {
#if defined(LEVER_AVX512)
    return PyUnicode_FromString("avx512-vnni");
#elif defined(LEVER_AVX2)
    return PyUnicode_FromString("avx2");
#else
    return PyUnicode_FromString("portable");
#endif
}

static PyMethodDef methods[] = {
    {"quantize_rows", py_quantize_rows, METH_VARARGS, "int8 rows with one scale per 256 and sums per 16"},
    {"matmul", py_matmul, METH_VARARGS, "y = A @ W^T from GGUF block bytes"},
    {"rmsnorm", py_rmsnorm, METH_VARARGS, "row-wise RMS norm"},
    {"swiglu", py_swiglu, METH_VARARGS, "gate * sigmoid(gate) * up"},
    {"attention", py_attention, METH_VARARGS, "masked GQA over each row's own key order"},
    {"rope_tables", py_rope_tables, METH_VARARGS, "rotary cos/sin tables as ggml builds them"},
    {"rope", py_rope, METH_VARARGS, "rotary embedding of each head's pairs"},
    {"dequantize", py_dequantize, METH_VARARGS, "GGUF rows to float32"},
    {"simd", py_simd, METH_NOARGS, "which code path was compiled"},
    {"requantize_q4_0", py_requantize_q4_0, METH_VARARGS, "rows of any weight type to Q4_0 (gguf's reference quantizer)"},
    {"tile_q4_0", py_tile_q4_0, METH_VARARGS, "Q4_0 rows to the AMX strips of Q4_0T, or back"},
    {"amx", py_amx, METH_VARARGS, "whether Q4_0T matmuls use AMX (and turn it on or off)"},
    {"repack_pairs", py_repack_pairs, METH_VARARGS, "Q5_0 / Q4_0 rows to the SIMD kernels' pair layout in place, or back"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "lever-actors native kernels", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
