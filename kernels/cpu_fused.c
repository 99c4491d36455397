/* The decoder layer's small ops on the CPU, one call each: add + RMSNorm, RMSNorm, rotary on q and k in
 * place, SiLU x mul, and the K/V store. Launched by kernels/cpu_fused.py and kernels/cpu_attention.py,
 * which check every argument; compiled without -ffast-math and with -ffp-contract=off so that each
 * product and sum rounds where transformers' torch ops round (float32 and bfloat16).
 *
 * Rows are `stride` elements apart; within a row the elements are contiguous. bfloat16 values are widened
 * to float32 to compute and rounded to nearest even where torch rounds a bfloat16 op's result.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((bits >> 16) | 0x40);   /* NaN stays NaN */
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#define ROUND_F32(x) (x)
#define ROUND_BF16(x) bf16_to_f32(f32_to_bf16(x))
#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

/* out = round(round(x * rsqrt(mean(x^2) + eps)) * w); with `residual`: first residual = round(x + residual)
 * and that sum is what is normalised. out may be x. */
#define DEFINE_NORM(NAME, T, LOAD, STORE, ROUND)                                                             \
int NAME(T *x, T *residual, const T *weight, T *out, int64_t num_rows, int64_t size, int64_t stride_x,     \
         int64_t stride_residual, int64_t stride_out, float eps) {                                          \
    for (int64_t r = 0; r < num_rows; r++) {                                                                 \
        T *xr = x + r * stride_x, *orow = out + r * stride_out;                                             \
        T *src = xr;                                                                                         \
        if (residual != NULL) {                                                                              \
            T *res = residual + r * stride_residual;                                                         \
            for (int64_t i = 0; i < size; i++) res[i] = STORE(LOAD(xr[i]) + LOAD(res[i]));                  \
            src = res;                                                                                       \
        }                                                                                                    \
        float sum = 0.0f;                                                                                    \
        for (int64_t i = 0; i < size; i++) { const float v = LOAD(src[i]); sum += v * v; }                  \
        const float inv = 1.0f / sqrtf(sum / (float)size + eps);                                             \
        for (int64_t i = 0; i < size; i++) orow[i] = STORE(ROUND(LOAD(src[i]) * inv) * LOAD(weight[i]));    \
    }                                                                                                        \
    return 0;                                                                                                \
}

/* Each head x = (x1, x2) of a row: x1 * cos - x2 * sin, x2 * cos + x1 * sin (transformers' x * cos +
 * rotate_half(x) * sin: each product rounded, then the sum). cos_sin: [num_rows, head_dim], the row's cos
 * of the head_dim / 2 frequencies then their sin. */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND)                                                           \
int NAME(T *x, const T *cos_sin, int64_t num_rows, int64_t num_heads, int64_t head_dim, int64_t stride_x) { \
    const int64_t half = head_dim / 2;                                                                       \
    for (int64_t r = 0; r < num_rows; r++) {                                                                 \
        const T *c = cos_sin + r * head_dim, *s = c + half;                                                 \
        for (int64_t h = 0; h < num_heads; h++) {                                                            \
            T *x1 = x + r * stride_x + h * head_dim, *x2 = x1 + half;                                       \
            for (int64_t i = 0; i < half; i++) {                                                             \
                const float a = LOAD(x1[i]), b = LOAD(x2[i]), ci = LOAD(c[i]), si = LOAD(s[i]);              \
                x1[i] = STORE(ROUND(a * ci) + ROUND(-b * si));                                               \
                x2[i] = STORE(ROUND(b * ci) + ROUND(a * si));                                                \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    return 0;                                                                                                \
}

/* out = round(silu(gate)) * up, gate and up the two halves of each row of x. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                                         \
int NAME(const T *x, T *out, int64_t num_rows, int64_t size, int64_t stride_x, int64_t stride_out) {       \
    for (int64_t r = 0; r < num_rows; r++) {                                                                 \
        const T *gate = x + r * stride_x, *up = gate + size;                                                \
        T *o = out + r * stride_out;                                                                         \
        for (int64_t i = 0; i < size; i++) {                                                                 \
            const float g = LOAD(gate[i]);                                                                   \
            o[i] = STORE(ROUND(g / (1.0f + expf(-g))) * LOAD(up[i]));                                        \
        }                                                                                                    \
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
