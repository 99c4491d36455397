/* Paged decode attention on the CPU: one query token per sequence against its K/V, read in place from
 * the cache blocks through the block table (no gather copy). Launched by kernels/cpu_attention.py, which
 * compiles this file once per machine and checks every argument before the call.
 *
 * For each decode row every query head is scored against every position of the sequence (its sliding
 * window only), block by block, all heads of a position while its K row is in cache (each cache line of
 * K and V is read once), the scores kept in a per-call buffer; then softmax in float32 and the weighted
 * sum of V, position by position again. K/V in float32 or bfloat16 (widened to float32 as read); accumulation in float32.
 *
 * Layouts (element strides, all contiguous):
 *   query:         [num_tokens, num_heads, head_dim], a token every `stride_q` elements (a fused qkv's slice)
 *   out:           [num_tokens, num_heads, head_dim]
 *   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables:  [num_seqs, max_blocks] int32;  seq_lens: [num_seqs] int32
 *   rows:          [num_decode] int64, the query row of each decode token;  seqs: [num_decode] int32, its sequence
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                                  \
int NAME(const T *query, const T *k_cache, const T *v_cache, T *out, const int32_t *block_tables,            \
         const int32_t *seq_lens, const int64_t *rows, const int32_t *seqs, int64_t num_decode, int64_t stride_q, \
         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,  \
         float scale, int64_t window) {                                                                      \
    const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * head_dim;                          \
    int64_t longest = 0;                                                                                     \
    for (int64_t i = 0; i < num_decode; i++)                                                                 \
        if (seq_lens[seqs[i]] > longest) longest = seq_lens[seqs[i]];                                       \
    float *scores = malloc(sizeof(float) * (size_t)(num_heads * longest + num_heads * head_dim * 2));       \
    if (scores == NULL) return 1;                                                                            \
    float *q = scores + num_heads * longest;       /* [num_heads, head_dim] */                              \
    float *acc = q + num_heads * head_dim;         /* [num_heads, head_dim] */                              \
    for (int64_t i = 0; i < num_decode; i++) {                                                               \
        const int64_t len = seq_lens[seqs[i]];                                                               \
        const int64_t first = (window > 0 && len > window) ? len - window : 0;                             \
        const int64_t n = len - first;                                                                       \
        const int32_t *table = block_tables + (int64_t)seqs[i] * max_blocks;                                \
        const T *q_src = query + rows[i] * stride_q;                                                         \
        for (int64_t j = 0; j < num_heads * head_dim; j++) q[j] = LOAD(q_src[j]) * scale;                  \
        /* scores[head][p]: every head of a position while its K row is in cache */                         \
        for (int64_t b = first / block_size; b * block_size < len; b++) {                                    \
            const int64_t lo = b * block_size > first ? b * block_size : first;                              \
            const int64_t hi = (b + 1) * block_size < len ? (b + 1) * block_size : len;                      \
            const T *k = k_cache + ((int64_t)table[b] * block_size + lo - b * block_size) * row;            \
            for (int64_t pos = lo; pos < hi; pos++, k += row) {                                              \
                for (int64_t head = 0; head < num_heads; head++) {                                           \
                    const float *qh = q + head * head_dim;                                                   \
                    const T *kh = k + (head / group) * head_dim;                                             \
                    float dot = 0.0f;                                                                        \
                    for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * LOAD(kh[d]);                      \
                    scores[head * n + pos - first] = dot;                                                    \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int64_t head = 0; head < num_heads; head++) {                                                   \
            float *sh = scores + head * n;                                                                   \
            float m = -FLT_MAX, sum = 0.0f;                                                                  \
            for (int64_t p = 0; p < n; p++) m = sh[p] > m ? sh[p] : m;                                       \
            for (int64_t p = 0; p < n; p++) { sh[p] = expf(sh[p] - m); sum += sh[p]; }                       \
            const float inv = 1.0f / sum;                                                                    \
            for (int64_t p = 0; p < n; p++) sh[p] *= inv;                                                    \
        }                                                                                                    \
        memset(acc, 0, sizeof(float) * (size_t)(num_heads * head_dim));                                     \
        for (int64_t b = first / block_size; b * block_size < len; b++) {                                    \
            const int64_t lo = b * block_size > first ? b * block_size : first;                              \
            const int64_t hi = (b + 1) * block_size < len ? (b + 1) * block_size : len;                      \
            const T *v = v_cache + ((int64_t)table[b] * block_size + lo - b * block_size) * row;            \
            for (int64_t pos = lo; pos < hi; pos++, v += row) {                                              \
                for (int64_t head = 0; head < num_heads; head++) {                                           \
                    const float w = scores[head * n + pos - first];                                          \
                    const T *vh = v + (head / group) * head_dim;                                             \
                    float *ah = acc + head * head_dim;                                                       \
                    for (int64_t d = 0; d < head_dim; d++) ah[d] += w * LOAD(vh[d]);                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        T *o = out + rows[i] * num_heads * head_dim;                                                         \
        for (int64_t j = 0; j < num_heads * head_dim; j++) o[j] = STORE(acc[j]);                            \
    }                                                                                                        \
    free(scores);                                                                                            \
    return 0;                                                                                                \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_DECODE(paged_decode_f32, float, LOAD_F32, STORE_F32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
