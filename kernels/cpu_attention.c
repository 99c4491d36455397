/* Paged decode attention on the CPU: one query token per sequence against its K/V, read in place from
 * the cache blocks through the block table (no gather copy). Launched by kernels/cpu_attention.py, which
 * compiles this file once per machine and checks every argument before the call.
 *
 * Each decode row's query heads (up to HEAD_CHUNK at a time) walk the sequence (its sliding window only, or
 * with chunked attention its own chunk: `window` < 0 is a chunk of -window positions, see first_key)
 * in tiles of positions, an online (flash-decoding) softmax carried from tile to tile, K and V read once:
 *   scores:  W positions at a time, for every head while those K rows are in L1 (the heads of a GQA group
 *            one after another on the same rows, bfloat16 rows widened once for them); each position's
 *            products summed to one vector, the W vectors reduced together by a shuffle tree;
 *   softmax: the running max per head, the sum and the V accumulator rescaled to it, the weights by a
 *            polynomial exp in float32, each step over all heads (independent chains that overlap);
 *   V sums:  the heads of a GQA group (8, 4, 3, 2 or 1 at a time) share each V row load, into 8 chains of
 *            accumulators held in registers.
 * A tile is 8 to 64 positions, about 16 KiB of the rows these heads read; the next tile's rows are
 * prefetched while one is computed, and during a row's last tile the next decode row's first (spread over
 * the tile's steps; with more heads than one pass takes, the next row's first rows at its start). head_dim
 * 16, 32, 64, 128 and 256 are compiled as constants; any other takes the same code with a runtime head_dim (a scalar tail past its last multiple of W). The vectors are
 * GCC's generic vector extensions, W = 8 floats: AVX/AVX-512 on x86, register pairs on NEON, plain code
 * elsewhere. K/V in float32 or bfloat16 (widened to float32 as read); accumulation and softmax in float32.
 * Scratch on the stack (about 50 KiB, nothing shared between threads); the heap only for a head_dim past
 * SCRATCH.
 *
 * Layouts (element strides, all contiguous):
 *   query:         [num_tokens, num_heads, head_dim], a token every `stride_q` elements (a fused qkv's slice)
 *   out:           [num_tokens, num_heads, head_dim]
 *   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables:  [num_seqs, max_blocks] int32;  seq_lens: [num_seqs] int32
 *   rows:          [num_decode] int64, the query row of each decode token;  seqs: [num_decode] int32, its sequence
 * Returns 0, or 1 when the heap scratch (a head_dim past SCRATCH) could not be allocated.
 */
#include <float.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"   /* x86 without AVX: vectors passed between inlined functions */
#endif

#define W 8                 /* floats per vector (the shuffles, splat and lane masks are written for 8) */
#define TILE 64             /* the most positions per tile (a multiple of W) */
#define TILE_BYTES 16384    /* the rows a tile's heads read: L1 holds them for every head */
#define HEAD_CHUNK 32       /* query heads sharing one pass over the K/V rows */
#define WIDE 256            /* the longest head_dim whose bfloat16 K rows are widened once for all heads */
#define SCRATCH 4096        /* floats of query and of accumulator on the stack: 32 heads of 128 */

typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));

#ifdef __clang__   /* the same shuffles by clang's builtin */
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static inline vf load_f32(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf load_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
static inline vf vmax(vf a, vf b) {
#ifdef __AVX__
    return __builtin_ia32_maxps256(a, b);   /* GCC makes the select below a compare and two masked ops */
#else
    return vselect(a > b, a, b);
#endif
}

/* Horizontal max and sum by shuffles. Never a loop over a vector's lanes: GCC may leave it scalar, through
 * memory (a vector store, then loads of its lanes that wait for it: no store forwarding). */
static inline float hmax(vf v) {
    v = vmax(v, SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    return vmax(v, SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6))[0];
}

static inline float hsum(vf v) {
    v += SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    return v[0] + v[1];
}

/* Lane j of the result is the sum of p[j]'s lanes: a tree of shuffles (unpack, unpack 64-bit, swap halves)
 * and adds, 21 operations for 8 sums instead of 8 horizontal reductions of 6. */
static inline vf transpose_sum(const vf p[W]) {
    vf x[4], y[2];
    for (int i = 0; i < 4; i++)   /* lanes [a,b,a,b | a,b,a,b] of positions 2i, 2i+1 */
        x[i] = SHUFFLE(p[2 * i], p[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13)
             + SHUFFLE(p[2 * i], p[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    for (int i = 0; i < 2; i++)   /* lanes [a,b,c,d | a,b,c,d] of positions 4i .. 4i+3 */
        y[i] = SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + SHUFFLE(x[2 * i], x[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(y[0], y[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(y[0], y[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* e^x for the softmax's arguments, x <= 0 (Cephes' expf: 2^n times a polynomial of the remainder, within
 * 2 ulp). x is clamped at -80, whose e^x ~ 2e-35 stands for 0 beside the running max's weight of 1; a NaN
 * stays NaN (vmax returns its second operand when either is NaN), so a NaN score poisons the output as in
 * the reference rather than vanishing from the softmax. */
static inline vf vexp(vf x) {
    x = vmax(splat(-80.0f), x);
    const vi n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);   /* rounded, as x <= 0 */
    const vf nf = __builtin_convertvector(n, vf);
    const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vf)((n + 127) << 23);
}

/* at[j] = base + the cache offset of the row of position pos + j, j < count, through the block table; then
 * the last again to TILE (a tile's padding). A function of its own: its counters stay in registers. */
static inline void row_offsets(int64_t *at, int64_t count, int64_t pos, const int32_t *table, int64_t block_size,
                               int64_t row, int64_t base) {
    int64_t b = pos / block_size, r = pos - b * block_size, j = 0;
    while (j < count) {
        const int64_t start = (int64_t)table[b++] * block_size * row + base;
        for (; r < block_size && j < count; r++, j++) at[j] = start + r * row;
        r = 0;
    }
    for (; j < TILE; j++) at[j] = at[count - 1];
}

/* Ask for the lines of `bytes` from p into the caches (L2 and up), ahead of their use. */
static inline void prefetch(const void *p, int64_t bytes) {
    for (int64_t e = 0; e < bytes; e += 64) __builtin_prefetch((const char *)p + e, 0, 2);
}

/* Prefetch the K and V rows (row_bytes each) of positions first .. first+count-1 of the sequence with block
 * table `table`: a block's rows are contiguous. */
static inline void prefetch_positions(const void *k, const void *v, const int32_t *table, int64_t first,
                                      int64_t count, int64_t block_size, int64_t row_bytes) {
    for (int64_t p = first, end = first + count; p < end;) {
        const int64_t b = p / block_size, stop = (b + 1) * block_size < end ? (b + 1) * block_size : end;
        const int64_t offset = ((int64_t)table[b] * block_size + p - b * block_size) * row_bytes;
        prefetch((const char *)k + offset, (stop - p) * row_bytes);
        prefetch((const char *)v + offset, (stop - p) * row_bytes);
        p = stop;
    }
}

/* s[j] = the dot product of qh and the row at k[j], for W rows (head_dim D). */
#define DEFINE_SCORES(NAME, T, LOAD8, LOAD)                                                                  \
static inline __attribute__((always_inline)) void NAME(float *s, const float *qh, const T *const k[W],     \
                                                       const int64_t D) {                                    \
    const int64_t DV = D / W * W;                                                                            \
    vf part[W];                                                                                              \
    float tail[W] = {0};                                                                                     \
    for (int j = 0; j < W; j++) {                                                                            \
        vf a = splat(0.0f);                                                                                  \
        for (int64_t d = 0; d < DV; d += W) a += load_f32(qh + d) * LOAD8(k[j] + d);                         \
        part[j] = a;                                                                                         \
        for (int64_t d = DV; d < D; d++) tail[j] += qh[d] * LOAD(k[j][d]);                                  \
    }                                                                                                        \
    const vf r = transpose_sum(part) + load_f32(tail);                                                       \
    memcpy(s, &r, sizeof r);                                                                                 \
}

/* acc[g] = acc[g] * corr[g] + the sum over the tile's n positions j of w[g][j] * V row j (at v + at[j]), for
 * NG heads sharing a KV head (acc[g] a head_dim D apart) and NA vectors of each: each V vector loaded once
 * for the NG heads, U positions at once (U sets of accumulators): U * NG * NA <= 8 independent chains of
 * adds in registers (the counts are constants where this is inlined, the loops unrolled). U divides W: the
 * positions past n it takes are the tile's padding, weight 0. */
#define DEFINE_PV_STEP(NAME, T, LOAD8)                                                                       \
static inline __attribute__((always_inline)) void NAME(                                                     \
        float *acc, const float *corr, const float (*w)[TILE], const T *v, const int64_t *at, int64_t n,   \
        const int64_t NG, const int64_t NA, const int64_t D) {                                               \
    const int64_t U = 8 / (NG * NA);     /* NA <= 8 / NG */                                                 \
    vf a[8], x[8];                                                                                           \
    _Pragma("GCC unroll 8") for (int64_t i = 0; i < 8; i++) a[i] = splat(0.0f);                             \
    _Pragma("GCC unroll 8") for (int64_t g = 0; g < NG; g++)                                                 \
        _Pragma("GCC unroll 8") for (int64_t c = 0; c < NA; c++)                                             \
            a[g * NA + c] = load_f32(acc + g * D + c * W) * corr[g];                                         \
    for (int64_t j = 0; j < n; j += U)                                                                       \
        _Pragma("GCC unroll 8") for (int64_t i = 0; i < U; i++) {                                            \
            _Pragma("GCC unroll 8") for (int64_t c = 0; c < NA; c++) x[c] = LOAD8(v + at[j + i] + c * W);  \
            _Pragma("GCC unroll 8") for (int64_t g = 0; g < NG; g++) {                                       \
                const vf wg = splat(w[g][j + i]);                                                            \
                _Pragma("GCC unroll 8") for (int64_t c = 0; c < NA; c++) a[(i * NG + g) * NA + c] += wg * x[c]; \
            }                                                                                                \
        }                                                                                                    \
    _Pragma("GCC unroll 8") for (int64_t i = 1; i < U; i++)                                                  \
        _Pragma("GCC unroll 8") for (int64_t e = 0; e < NG * NA; e++) a[e] += a[i * NG * NA + e];            \
    _Pragma("GCC unroll 8") for (int64_t g = 0; g < NG; g++)                                                 \
        _Pragma("GCC unroll 8") for (int64_t c = 0; c < NA; c++)                                             \
            memcpy(acc + g * D + c * W, &a[g * NA + c], sizeof(vf));                                         \
}

/* A tile's V sums for NG heads sharing a KV head: 8 / NG vectors of each head at a time, then 4, 2, 1 for
 * what is left (every count a constant, for a generic head_dim too), a scalar tail past the last multiple
 * of W. */
#define PV_PASSES(STEP, NA) if (NA <= 8 / NG)                                                                \
    for (; d0 + NA * W <= DV; d0 += NA * W) STEP(acc + d0, corr, w, v + d0, at, n, NG, NA, D);
#define DEFINE_PV(NAME, T, LOAD, STEP)                                                                       \
static inline __attribute__((always_inline)) void NAME(                                                     \
        float *acc, const float *corr, const float (*w)[TILE], const T *v, const int64_t *at, int64_t n,   \
        const int64_t NG, const int64_t D) {                                                                 \
    const int64_t DV = D / W * W;                                                                            \
    int64_t d0 = 0;                                                                                          \
    PV_PASSES(STEP, 8) PV_PASSES(STEP, 4) PV_PASSES(STEP, 2) PV_PASSES(STEP, 1)                              \
    for (int64_t g = 0; g < NG; g++)                                                                         \
        for (int64_t d = DV; d < D; d++) {                                                                   \
            float a = acc[g * D + d] * corr[g];                                                              \
            for (int64_t j = 0; j < n; j++) a += w[g][j] * LOAD(v[at[j] + d]);                               \
            acc[g * D + d] = a;                                                                              \
        }                                                                                                    \
}

/* In ATTEND: the heads from h on (of h0 .. h0+nh-1) that share its KV head. */
#define RUN(h) (group - (h0 + (h)) % group < nh - (h) ? group - (h0 + (h)) % group : nh - (h))

/* One decode row's attention for its query heads h0 .. h0+nh-1 (q and o point at the first; `group` heads
 * share a KV head), tile by tile: every head's scores, then every head's softmax step, then every head's V
 * sums (a head's phases one after the other were one long chain of latencies: the CPU idled). qs and acc:
 * scratch of nh * D floats. */
#define DEFINE_ATTEND(NAME, T, LOAD8, LOAD, STORE, SCORES, PV)                                               \
static inline __attribute__((always_inline)) void NAME(                                                     \
        const T *q, T *o, int64_t h0, int64_t nh, int64_t group, const T *k_cache, const T *v_cache,        \
        const int32_t *table, int64_t first, int64_t len, int64_t block_size, int64_t row, float scale,    \
        float *qs, float *acc, const int32_t *next_table, int64_t next_first, int64_t next_len,             \
        const int64_t D) {                                                                                   \
    const int64_t DV = D / W * W;        /* the vector part of a head; D - DV a scalar tail */              \
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7};                                                                \
    float m[HEAD_CHUNK], m_old[HEAD_CHUNK], corr[HEAD_CHUNK], wide[W * WIDE];                                \
    float sc[HEAD_CHUNK][TILE] __attribute__((aligned(32)));   /* a tile's scores, then its weights */     \
    vf l[HEAD_CHUNK];                    /* the softmax's sums, per lane */                                 \
    int64_t kv_of[HEAD_CHUNK];           /* a head's K/V offset in a row (no division in the loops) */      \
    for (int64_t h = 0; h < HEAD_CHUNK; h++) m[h] = m_old[h] = -FLT_MAX;   /* read W heads at a time */    \
    for (int64_t h = 0; h < nh; h++) {                                                                       \
        for (int64_t d = 0; d < D; d++) { qs[h * D + d] = LOAD(q[h * D + d]) * scale; acc[h * D + d] = 0; } \
        kv_of[h] = (h0 + h) / group * D;                                                                     \
        l[h] = splat(0.0f);                                                                                  \
    }                                                                                                        \
    /* at[t][j]: the cache offset of the part of a row these heads read, for a tile's position j (t          \
     * alternates: the next tile's are worked out before this one is computed; rows past n repeat the last,  \
     * weight 0). The next tile's rows are prefetched, a KV head's part at each step of this one: the         \
     * hardware's prefetchers do not follow rows a few KiB apart read a part at a time, and stop at pages.   \
     * After a row's last tile the next is the next decode row's first (`next_table`): its K/V arrive while  \
     * this tile computes, spread over its steps (all at once they stalled the row: a cold batch-64 layer    \
     * 115-125 us, spread 56-59 us, on the development VM). Rows a multiple of 4 KiB apart fall in the same \
     * L1 sets, hence small tiles for long rows. */                                                         \
    int64_t at[2][TILE], ns[2] = {0, 0};                                                                     \
    const int64_t kv_lo = kv_of[0], bytes = (kv_of[nh - 1] + D - kv_lo) * (int64_t)sizeof(T);              \
    const int64_t fit = TILE_BYTES / bytes / W * W, tile = fit < W ? W : fit > TILE ? TILE : fit;            \
    for (int64_t lo = first, t = 0; lo < len; lo += tile, t ^= 1) {                                          \
        const int64_t n = len - lo < tile ? len - lo : tile, nv = (n + W - 1) / W;                          \
        for (int64_t ahead = lo == first ? 0 : 1; ahead < 2; ahead++) {   /* this tile (the first), next */ \
            const int64_t count = len - lo - ahead * tile < tile ? len - lo - ahead * tile : tile;          \
            ns[t ^ ahead] = count > 0 ? count : 0;                                                           \
            if (count > 0) row_offsets(at[t ^ ahead], count, lo + ahead * tile, table, block_size, row, kv_lo); \
            else if (ahead == 1 && next_table != NULL) {   /* the last tile: the next row's first is next */ \
                const int64_t next = next_len - next_first < tile ? next_len - next_first : tile;          \
                ns[t ^ 1] = next > 0 ? next : 0;                                                             \
                if (next > 0) row_offsets(at[t ^ 1], next, next_first, next_table, block_size, row, kv_lo);  \
            }                                                                                                \
        }                                                                                                    \
        const int64_t *rows_at = at[t], *next_at = at[t ^ 1], next_n = ns[t ^ 1];                            \
        for (int64_t c = 0; c < nv; c++)     /* scores, W positions at a time */                            \
            for (int64_t h = 0; h < nh;) {   /* the heads of one KV head */                                 \
                const int64_t run = RUN(h), off = kv_of[h] - kv_lo;                                          \
                for (int64_t j = c * W; j < c * W + W && j < next_n; j++)                                    \
                    prefetch(k_cache + next_at[j] + off, D * (int64_t)sizeof(T));                            \
                const T *k[W];                                                                               \
                for (int64_t j = 0; j < W; j++) k[j] = k_cache + rows_at[c * W + j] + off;                   \
                if (sizeof(T) < sizeof(float) && D <= WIDE) {   /* bfloat16: widened once for the heads */   \
                    const float *kw[W];                                                                      \
                    for (int64_t j = 0; j < W; j++) {                                                        \
                        for (int64_t d = 0; d < DV; d += W) {                                                \
                            const vf x = LOAD8(k[j] + d);                                                    \
                            memcpy(wide + j * D + d, &x, sizeof x);                                          \
                        }                                                                                    \
                        for (int64_t d = DV; d < D; d++) wide[j * D + d] = LOAD(k[j][d]);                    \
                        kw[j] = wide + j * D;                                                                \
                    }                                                                                        \
                    for (int64_t e = h; e < h + run; e++) scores_f32(&sc[e][c * W], qs + e * D, kw, D);     \
                } else                                                                                       \
                    for (int64_t e = h; e < h + run; e++) SCORES(&sc[e][c * W], qs + e * D, k, D);          \
                h += run;                                                                                    \
            }                                                                                                \
        /* softmax: the running max; the factors rescaling what came before (W heads at once; ~0 at the     \
         * first tile); the weights and their sums. */                                                       \
        const vi valid = lane < (int32_t)(n - (nv - 1) * W);   /* the last vector's positions */            \
        for (int64_t h = 0; h < nh; h++) {                                                                   \
            vf mv = vselect(valid, load_f32(&sc[h][(nv - 1) * W]), splat(-FLT_MAX));                         \
            for (int64_t c = 0; c < nv - 1; c++) mv = vmax(mv, load_f32(&sc[h][c * W]));                     \
            const float mt = hmax(mv);                                                                       \
            m_old[h] = m[h];                                                                                 \
            m[h] = mt > m[h] ? mt : m[h];                                                                    \
        }                                                                                                    \
        for (int64_t h = 0; h < nh; h += W) {                                                                \
            const vf cv = vexp(load_f32(m_old + h) - load_f32(m + h));                                       \
            memcpy(corr + h, &cv, sizeof cv);                                                                \
        }                                                                                                    \
        for (int64_t h = 0; h < nh; h++) {                                                                   \
            vf sum = splat(0.0f);                                                                            \
            for (int64_t c = 0; c < nv; c++) {                                                               \
                vf p = vexp(load_f32(&sc[h][c * W]) - m[h]);                                                 \
                if (c == nv - 1) p = (vf)((vi)p & valid);                                                    \
                sum += p;                                                                                    \
                memcpy(&sc[h][c * W], &p, sizeof p);                                                         \
            }                                                                                                \
            l[h] = l[h] * corr[h] + sum;                                                                     \
        }                                                                                                    \
        for (int64_t h = 0; h < nh;) {       /* V sums: the heads of a KV head 8, 4, 3, 2 or 1 at a time */ \
            const int64_t run = RUN(h), off = kv_of[h] - kv_lo;                                              \
            for (int64_t j = 0; j < next_n; j++) prefetch(v_cache + next_at[j] + off, D * (int64_t)sizeof(T)); \
            for (int64_t j = nv * W; j < next_n; j++)   /* K rows past this tile's: the next row's, after a short tile */ \
                prefetch(k_cache + next_at[j] + off, D * (int64_t)sizeof(T));                                 \
            float *ah = acc + h * D;                                                                         \
            const T *v = v_cache + off;                                                                      \
            if (run >= 8) PV(ah, corr + h, sc + h, v, rows_at, n, 8, D);                                     \
            else if (run >= 4) PV(ah, corr + h, sc + h, v, rows_at, n, 4, D);                                \
            else if (run == 3) PV(ah, corr + h, sc + h, v, rows_at, n, 3, D);                                \
            else if (run == 2) PV(ah, corr + h, sc + h, v, rows_at, n, 2, D);                                \
            else PV(ah, corr + h, sc + h, v, rows_at, n, 1, D);                                              \
            h += run >= 8 ? 8 : run >= 4 ? 4 : run;                                                          \
        }                                                                                                    \
    }                                                                                                        \
    for (int64_t h = 0; h < nh; h++) {                                                                       \
        const float sum = hsum(l[h]), inv = sum > 0.0f ? 1.0f / sum : 0.0f;   /* no positions: zeros */     \
        for (int64_t d = 0; d < D; d++) o[h * D + d] = STORE(acc[h * D + d] * inv);                         \
    }                                                                                                        \
}

#define ATTEND_PARAMS(T) const T *q, T *o, int64_t h0, int64_t nh, int64_t group, const T *k, const T *v,     \
                         const int32_t *table, int64_t first, int64_t len, int64_t block_size, int64_t row,    \
                         float scale, float *qs, float *acc, const int32_t *next_table, int64_t next_first,      \
                         int64_t next_len
#define ATTEND_ARGS q, o, h0, nh, group, k, v, table, first, len, block_size, row, scale, qs, acc, next_table,  \
                    next_first, next_len

/* The first position a decode row of `len` positions attends to: its last `window` with window > 0 (a sliding
 * window), its own chunk's first with window < 0 (Llama 4's chunked attention, chunks of -window positions:
 * ((len - 1) / chunk) x chunk), 0 with window 0. */
static inline int64_t first_key(int64_t len, int64_t window) {
    if (window < 0) return (len - 1) / -window * -window;
    return window > 0 && len > window ? len - window : 0;
}

/* The kernel over a list of decode rows (the exported calls below hand it all of them, or a run each thread):
 * every row and chunk of its query heads, with head_dim a constant in the specialised copies of ATTEND (the
 * switch is outside every loop over positions). */
#define DECODE_PARAMS(T)                                                                                     \
    const T *query, const T *k_cache, const T *v_cache, T *out, const int32_t *block_tables,                 \
    const int32_t *seq_lens, const int64_t *rows, const int32_t *seqs, int64_t num_decode, int64_t stride_q,  \
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,        \
    float scale, int64_t window
#define DECODE_ARGS(ROWS, SEQS, NUM)                                                                         \
    query, k_cache, v_cache, out, block_tables, seq_lens, ROWS, SEQS, NUM, stride_q, num_heads, num_kv_heads,  \
    head_dim, block_size, max_blocks, scale, window
#define DEFINE_DECODE(NAME, T, ATTEND)                                                                       \
static void NAME##_d16(ATTEND_PARAMS(T)) { ATTEND(ATTEND_ARGS, 16); }                                         \
static void NAME##_d32(ATTEND_PARAMS(T)) { ATTEND(ATTEND_ARGS, 32); }                                         \
static void NAME##_d64(ATTEND_PARAMS(T)) { ATTEND(ATTEND_ARGS, 64); }                                         \
static void NAME##_d128(ATTEND_PARAMS(T)) { ATTEND(ATTEND_ARGS, 128); }                                       \
static void NAME##_d256(ATTEND_PARAMS(T)) { ATTEND(ATTEND_ARGS, 256); }                                       \
static void NAME##_dn(ATTEND_PARAMS(T), int64_t D) { ATTEND(ATTEND_ARGS, D); }                                \
static int NAME##_rows(DECODE_PARAMS(T)) {                                                               \
    const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * head_dim;                          \
    float stack[2 * SCRATCH], *qs = stack;                                                                   \
    int64_t chunk = SCRATCH / head_dim < HEAD_CHUNK ? SCRATCH / head_dim : HEAD_CHUNK;                      \
    if (chunk == 0) {   /* a head_dim past SCRATCH: one head at a time, its scratch on the heap */           \
        chunk = 1;                                                                                           \
        if ((qs = malloc(sizeof(float) * (size_t)(2 * head_dim))) == NULL) return 1;                         \
    }                                                                                                        \
    float *acc = qs + chunk * head_dim;                                                                      \
    for (int64_t i = 0; i < num_decode; i++) {                                                               \
        const int64_t len = seq_lens[seqs[i]];                                                               \
        const int64_t first = first_key(len, window);                                                        \
        const int32_t *table = block_tables + (int64_t)seqs[i] * max_blocks;                                \
        const int32_t *next_table = NULL;                                                                    \
        int64_t next_first = 0, next_len = 0;                                                                \
        if (chunk >= num_heads && i + 1 < num_decode) {   /* its first tile, prefetched during this row */ \
            next_len = seq_lens[seqs[i + 1]];                                                                \
            next_first = first_key(next_len, window);                                                        \
            next_table = block_tables + (int64_t)seqs[i + 1] * max_blocks;                                   \
        }                                                                                                    \
        if (chunk < num_heads && i + 1 < num_decode) {   /* head chunks: the next row's first rows at once */ \
            const int64_t next_len = seq_lens[seqs[i + 1]], row_bytes = row * (int64_t)sizeof(T);             \
            const int64_t next_first = first_key(next_len, window);                                          \
            const int64_t fit = TILE_BYTES / row_bytes > 1 ? TILE_BYTES / row_bytes : 1;                     \
            const int64_t count = next_len - next_first < fit ? next_len - next_first : fit;                \
            prefetch_positions(k_cache, v_cache, block_tables + (int64_t)seqs[i + 1] * max_blocks, next_first, \
                               count, block_size, row_bytes);                                                \
        }                                                                                                    \
        for (int64_t h0 = 0; h0 < num_heads; h0 += chunk) {                                                  \
            const int64_t nh = num_heads - h0 < chunk ? num_heads - h0 : chunk;                             \
            const T *q = query + rows[i] * stride_q + h0 * head_dim, *k = k_cache, *v = v_cache;            \
            T *o = out + (rows[i] * num_heads + h0) * head_dim;                                              \
            switch (head_dim) {                                                                              \
                case 16: NAME##_d16(ATTEND_ARGS); break;                                                     \
                case 32: NAME##_d32(ATTEND_ARGS); break;                                                     \
                case 64: NAME##_d64(ATTEND_ARGS); break;                                                     \
                case 128: NAME##_d128(ATTEND_ARGS); break;                                                   \
                case 256: NAME##_d256(ATTEND_ARGS); break;                                                   \
                default: NAME##_dn(ATTEND_ARGS, head_dim);                                                   \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    if (qs != stack) free(qs);                                                                               \
    return 0;                                                                                                \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_SCORES(scores_f32, float, load_f32, LOAD_F32)
DEFINE_SCORES(scores_bf16, uint16_t, load_bf16, bf16_to_f32)
DEFINE_PV_STEP(pv_step_f32, float, load_f32)
DEFINE_PV_STEP(pv_step_bf16, uint16_t, load_bf16)
DEFINE_PV(pv_f32, float, LOAD_F32, pv_step_f32)
DEFINE_PV(pv_bf16, uint16_t, bf16_to_f32, pv_step_bf16)
DEFINE_ATTEND(attend_f32, float, load_f32, LOAD_F32, STORE_F32, scores_f32, pv_f32)
DEFINE_ATTEND(attend_bf16, uint16_t, load_bf16, bf16_to_f32, f32_to_bf16, scores_bf16, pv_bf16)
DEFINE_DECODE(paged_decode_f32, float, attend_f32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, attend_bf16)

/* The exported calls: the decode rows in contiguous runs near equal in the K/V they read, one run a thread of
 * the OpenMP team torch's own ops run on (built with -fopenmp where torch's libgomp is the one loaded:
 * kernels/cpu_attention.py), when there is more than one thread and at least `split_min_bytes` to read; else
 * every row on the calling thread. Each run is the same code on its rows: the same bits either way. */
int64_t split_min_bytes = 256 << 10;   /* below it a run handed to another thread may cost more than it saves */

int decode_threads(void) {   /* the threads a split may use: 0 in a build without OpenMP */
#ifdef _OPENMP
    return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
    return 0;
#endif
}

static inline int64_t keys_read(int64_t len, int64_t window) {   /* the positions a decode row attends to */
    return len - first_key(len, window);
}

/* cuts[0..parts]: run r is rows [cuts[r], cuts[r + 1]), none empty; a cut where the K/V read so far first
 * reaches its share, or where the rows left are one a run. Returns the number of runs. */
static int64_t decode_cuts(int64_t *cuts, int64_t parts, const int32_t *seq_lens, const int32_t *seqs,
                           int64_t num_decode, int64_t window, int64_t total) {
    int64_t k = 1, acc = 0;
    cuts[0] = 0;
    for (int64_t i = 0; i + 1 < num_decode && k < parts; i++) {
        acc += keys_read(seq_lens[seqs[i]], window);
        if (acc * parts >= total * k || num_decode - (i + 1) == parts - k) cuts[k++] = i + 1;
    }
    cuts[k] = num_decode;
    return k;
}

#define MAX_RUNS 64
#define DEFINE_SPLIT(NAME, T)                                                                                \
int NAME(DECODE_PARAMS(T)) {                                                                                 \
    int64_t parts = decode_threads(), total = 0;                                                             \
    parts = parts < num_decode ? parts : num_decode;                                                         \
    parts = parts < MAX_RUNS ? parts : MAX_RUNS;                                                             \
    for (int64_t i = 0; parts > 1 && i < num_decode; i++) total += keys_read(seq_lens[seqs[i]], window);    \
    if (parts < 2 || total * 2 * num_kv_heads * head_dim * (int64_t)sizeof(T) < split_min_bytes)             \
        return NAME##_rows(DECODE_ARGS(rows, seqs, num_decode));                                             \
    int64_t cuts[MAX_RUNS + 1];                                                                              \
    const int64_t runs = decode_cuts(cuts, parts, seq_lens, seqs, num_decode, window, total);               \
    int status = 0;                                                                                          \
    _Pragma("omp parallel for num_threads(runs) schedule(static, 1) reduction(|: status)")                   \
    for (int64_t r = 0; r < runs; r++)                                                                       \
        status |= NAME##_rows(DECODE_ARGS(rows + cuts[r], seqs + cuts[r], cuts[r + 1] - cuts[r]));           \
    return status;                                                                                           \
}
DEFINE_SPLIT(paged_decode_f32, float)
DEFINE_SPLIT(paged_decode_bf16, uint16_t)
