/* The decoder layer's small ops on the CPU, one call each: add + RMSNorm, RMSNorm, rotary on q and k in
 * place, SiLU x mul, and the K/V store. Launched by kernels/cpu_fused.py and kernels/cpu_attention.py,
 * which check every argument; compiled without -ffast-math and with -ffp-contract=off so that each
 * product and sum rounds where transformers' torch ops round (float32 and bfloat16).
 *
 * Rows are `stride` elements apart; within a row the elements are contiguous. bfloat16 values are widened
 * to float32 to compute and rounded to nearest even where torch rounds a bfloat16 op's result.
 *
 * Written for GCC's (and clang's) auto-vectoriser without -ffast-math, for whatever -march=native gives
 * (AVX-512, AVX2, NEON, or none): the element loops have no branches (selects only) and no calls (exp is
 * our own, below); `IVDEP` tells the compiler that an element depends on that element alone (an output
 * may be its input: in place is fine); rotary's head loop is compiled for each common head_dim, so that
 * a head is straight vector code; the one reduction (the norm's sum of squares) is kept in NORM_LANES
 * partial sums, lane j summing the elements j, j + NORM_LANES, ... in order, then added in a fixed tree:
 * the same sum on every machine, vector unit or none (an order other than torch's: float32 results
 * within a rounding or two of torch's).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__clang__)
#define IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define IVDEP _Pragma("GCC ivdep")
#else
#define IVDEP
#endif

#if defined(__GNUC__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

/* a * b + c: one rounding where the machine has a fused multiply-add (used inside our exp only, which
 * is no rounding point of torch's), two elsewhere; -ffp-contract=off keeps every other product apart */
#if defined(__FP_FAST_FMAF)
#define MADD(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even; a NaN stays a NaN (quieted). Branch-free, so that its loops vectorise. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? (bits >> 16) | 0x40u : rounded);
}

/* bf16_to_f32(f32_to_bf16(f)) in fewer steps (the rounding kept in the float's bits); a NaN stays a NaN
 * (its payload is not ours to keep: every result goes through f32_to_bf16, which quiets it). */
static inline float round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    float rounded;
    memcpy(&rounded, &bits, sizeof rounded);
    return f != f ? f : rounded;
}

#define ROUND_F32(x) (x)
#define ROUND_BF16(x) round_bf16(x)
#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

/* silu(g) = g / (1 + exp(-g)), torch's formula, with exp our own so that the loop vectorises (glibc's
 * expf is a call per element). exp(t) = 2^n exp(r), n = round(t / ln2), |r| <= ln2 / 2, r = t - n ln2 with
 * ln2 in two parts (Cody-Waite: n times the first part, and t minus that, are exact); exp(r) by a degree-6
 * polynomial (1 + r + c2 r^2 + ... + c6 r^6, a minimax fit: 0.05 ulp from exp on that interval), whose
 * coefficients are doubled so that it gives 2 exp(r) (exactly twice what the plain ones give), then
 * times 2^(n-1) built in the exponent bits: for t in [-86, 88.75], n is in [-124, 128], the scale a normal
 * float, and the product overflows to +inf where expf does (t > 88.7228). Checked over every 61st float:
 * within 0.9 ulp of exp on [-86, 88.72] with a fused multiply-add, 1.2 ulp without; silu within 2.4 ulp,
 * as with glibc's expf, and the same as glibc's over g in [85, 90] and at the extremes.
 * Outside, selects: t < -86 gives 0 (1 + exp(t) is 1 then, as it is with the true value: silu(g) = g, +inf
 * included); t > 88.75 gives +inf (silu = -0, and NaN at g = -inf, as torch gives); a NaN fails both
 * tests and stays a NaN. */
static inline float exp_clamped(float t) {
    const float shifter = 0x1.8p23f;                      /* adding it rounds t / ln2 to an integer, n, ... */
    const float k = MADD(t, 0x1.715476p+0f, shifter);
    uint32_t kbits;                                       /* ... which is then the low bits of k's mantissa */
    memcpy(&kbits, &k, sizeof kbits);
    const float n = k - shifter;
    float r = MADD(n, -0x1.63p-1f, t);                    /* ln2's first part: 0.693359375, 9 bits */
    r = MADD(n, 0x1.bd0106p-13f, r);                      /* 0.693359375 - ln2 */
    float q = MADD(2 * 0x1.6a23d0p-10f, r, 2 * 0x1.123a20p-7f);
    q = MADD(q, r, 2 * 0x1.5558f2p-5f);
    q = MADD(q, r, 2 * 0x1.555492p-3f);
    q = MADD(q, r, 2 * 0x1.fffffcp-2f);
    q = MADD(q, r, 2.0f);
    q = MADD(q, r, 2.0f);                                 /* 2 exp(r) */
    const uint32_t scale_bits = (kbits - 0x4B400000u + 126u) << 23;   /* 2^(n-1) */
    float scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    float e = q * scale;
    e = t < -86.0f ? 0.0f : e;
    e = t > 88.75f ? INFINITY : e;
    return e;
}

static inline float silu_f32(float g) {
    return g / (1.0f + exp_clamped(-g));
}

/* The norm's sum of squares: NORM_LANES partial sums (see the header) */
#define NORM_LANES 16

static inline float sum_lanes(float *acc) {
    for (int w = NORM_LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

/* out = round(round(x * rsqrt(mean(x^2) + eps)) * w); with `residual`: first residual = round(x + residual)
 * and that sum is what is normalised. out may be x. */
#define DEFINE_NORM(NAME, T, LOAD, STORE, ROUND)                                                             \
int NAME(T *x, T *residual, const T *weight, T *out, int64_t num_rows, int64_t size, int64_t stride_x,     \
         int64_t stride_residual, int64_t stride_out, float eps) {                                          \
    for (int64_t r = 0; r < num_rows; r++) {                                                                 \
        T *xr = x + r * stride_x, *orow = out + r * stride_out;                                             \
        T *src = xr;                                                                                         \
        float acc[NORM_LANES] = {0.0f};                                                                      \
        int64_t i = 0;                                                                                       \
        if (residual != NULL) {                                                                              \
            T *res = residual + r * stride_residual;                                                         \
            for (; i + NORM_LANES <= size; i += NORM_LANES)                                                  \
                for (int j = 0; j < NORM_LANES; j++) {                                                       \
                    const T s = STORE(LOAD(xr[i + j]) + LOAD(res[i + j]));                                   \
                    const float v = LOAD(s);                                                                 \
                    res[i + j] = s;                                                                          \
                    acc[j] += v * v;                                                                         \
                }                                                                                            \
            for (int j = 0; i + j < size; j++) {                                                             \
                const T s = STORE(LOAD(xr[i + j]) + LOAD(res[i + j]));                                       \
                const float v = LOAD(s);                                                                     \
                res[i + j] = s;                                                                              \
                acc[j] += v * v;                                                                             \
            }                                                                                                \
            src = res;                                                                                       \
        } else {                                                                                             \
            for (; i + NORM_LANES <= size; i += NORM_LANES)                                                  \
                for (int j = 0; j < NORM_LANES; j++) { const float v = LOAD(src[i + j]); acc[j] += v * v; } \
            for (int j = 0; i + j < size; j++) { const float v = LOAD(src[i + j]); acc[j] += v * v; }       \
        }                                                                                                    \
        const float inv = 1.0f / sqrtf(sum_lanes(acc) / (float)size + eps);                                  \
        IVDEP                                                                                                \
        for (int64_t k = 0; k < size; k++) orow[k] = STORE(ROUND(LOAD(src[k]) * inv) * LOAD(weight[k]));    \
    }                                                                                                        \
    return 0;                                                                                                \
}

/* Each head x = (x1, x2) of a row: x1 * cos - x2 * sin, x2 * cos + x1 * sin (transformers' x * cos +
 * rotate_half(x) * sin: each product rounded, then the sum). cos_sin: [num_rows, head_dim], the row's cos
 * of the head_dim / 2 frequencies then their sin. The rows are compiled for the common head_dims (a
 * constant `half`: a head is straight vector code, no loop); another head_dim that is a multiple of 16
 * goes 8 elements at a time, and any other one element by element. */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND)                                                           \
static ALWAYS_INLINE void NAME##_span(T *restrict x1, T *restrict x2, const T *restrict c,                  \
                                      const T *restrict s, int64_t n) {                                     \
    for (int64_t i = 0; i < n; i++) {                                                                        \
        const float a = LOAD(x1[i]), b = LOAD(x2[i]), ci = LOAD(c[i]), si = LOAD(s[i]);                      \
        x1[i] = STORE(ROUND(a * ci) + ROUND(-b * si));                                                       \
        x2[i] = STORE(ROUND(b * ci) + ROUND(a * si));                                                        \
    }                                                                                                        \
}                                                                                                            \
static ALWAYS_INLINE void NAME##_rows(T *x, const T *cos_sin, int64_t num_rows, int64_t num_heads,          \
                                      int64_t head_dim, int64_t stride_x, int64_t chunk) {                  \
    const int64_t half = head_dim / 2;                                                                       \
    for (int64_t r = 0; r < num_rows; r++) {                                                                 \
        const T *c = cos_sin + r * head_dim;                                                                 \
        for (int64_t h = 0; h < num_heads; h++) {                                                            \
            T *x1 = x + r * stride_x + h * head_dim;                                                         \
            for (int64_t i = 0; i < half; i += chunk)                                                        \
                NAME##_span(x1 + i, x1 + half + i, c + i, c + half + i, chunk);                              \
        }                                                                                                    \
    }                                                                                                        \
}                                                                                                            \
int NAME(T *x, const T *cos_sin, int64_t num_rows, int64_t num_heads, int64_t head_dim, int64_t stride_x) { \
    switch (head_dim) {                                                                                      \
    case 16: NAME##_rows(x, cos_sin, num_rows, num_heads, 16, stride_x, 8); break;                           \
    case 32: NAME##_rows(x, cos_sin, num_rows, num_heads, 32, stride_x, 16); break;                          \
    case 64: NAME##_rows(x, cos_sin, num_rows, num_heads, 64, stride_x, 32); break;                          \
    case 128: NAME##_rows(x, cos_sin, num_rows, num_heads, 128, stride_x, 64); break;                        \
    default:                                                                                                 \
        if (head_dim % 16 == 0) NAME##_rows(x, cos_sin, num_rows, num_heads, head_dim, stride_x, 8);         \
        else NAME##_rows(x, cos_sin, num_rows, num_heads, head_dim, stride_x, 1);                            \
    }                                                                                                        \
    return 0;                                                                                                \
}

/* out = round(silu(gate)) * up, gate and up the two halves of each row of x. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                                         \
int NAME(const T *x, T *out, int64_t num_rows, int64_t size, int64_t stride_x, int64_t stride_out) {       \
    for (int64_t r = 0; r < num_rows; r++) {                                                                 \
        const T *gate = x + r * stride_x, *up = gate + size;                                                \
        T *o = out + r * stride_out;                                                                         \
        IVDEP                                                                                                \
        for (int64_t i = 0; i < size; i++)                                                                   \
            o[i] = STORE(ROUND(silu_f32(LOAD(gate[i]))) * LOAD(up[i]));                                      \
    }                                                                                                        \
    return 0;                                                                                                \
}

DEFINE_NORM(rms_norm_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_NORM(rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)
DEFINE_ROTARY(rotary_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)
DEFINE_SILU_MUL(silu_and_mul_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_SILU_MUL(silu_and_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)

/* Each token's K and V (rows `stride_key_bytes` / `stride_value_bytes` apart, `row_bytes` each) into its
 * slot of the caches ([num_slots, row] contiguous); a negative slot is skipped, one past the cache refused
 * (nothing written, 1 returned). */
int store_kv(const char *key, const char *value, char *k_cache, char *v_cache, const int64_t *slots,
             int64_t num_tokens, int64_t num_slots, int64_t row_bytes, int64_t stride_key_bytes,
             int64_t stride_value_bytes) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] >= num_slots) return 1;
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row_bytes, key + t * stride_key_bytes, (size_t)row_bytes);
        memcpy(v_cache + slots[t] * row_bytes, value + t * stride_value_bytes, (size_t)row_bytes);
    }
    return 0;
}
