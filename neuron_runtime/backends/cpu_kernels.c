/*
 * Fused fp32 kernels for the CPU backend's per-token work: the parts of a layer that are not
 * GEMMs. In plain torch each of them is a chain of small ops (an RMSNorm is seven, decode
 * attention a gather copy plus a dozen more), and at batch 1 the dispatch of those ops costs
 * a fifth of a decode step. Each kernel here reads its inputs once and writes its output once.
 *
 * cpu_kernels.py compiles this file on first use and calls it through ctypes; every kernel has
 * a torch twin (layers/) that is used when no C compiler is present and that the tests compare
 * against. All tensors are contiguous fp32 unless a stride says otherwise; one thread.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/*
 * y = x @ w^T + bias for the few rows of a decode step: x [m, in], w [out, in] (torch's
 * Linear layout), bias [out] or NULL, y [m, out]. A GEMV-shaped product is bound by reading
 * w, so every weight row is read from memory once and dotted with each input row while it is
 * in cache. One row is a plain dot per weight row; more rows go 4 weight rows by 2 input rows
 * at a time (8 independent sums keep both FMA pipes busy).
 */
void linear_rows(const float *x, const float *w, const float *bias, float *y, int64_t m,
                 int64_t in, int64_t out) {
    if (m == 1) {
        for (int64_t j = 0; j < out; j++) y[j] = dot(w + j * in, x, in);
    } else {
        int64_t j = 0;
        for (; j + 4 <= out; j += 4) {
            const float *w0 = w + j * in, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
            int64_t r = 0;
            for (; r + 2 <= m; r += 2) {
                const float *xa = x + r * in, *xb = xa + in;
                float a0 = 0, a1 = 0, a2 = 0, a3 = 0, b0 = 0, b1 = 0, b2 = 0, b3 = 0;
                for (int64_t i = 0; i < in; i++) {
                    a0 += w0[i] * xa[i];
                    a1 += w1[i] * xa[i];
                    a2 += w2[i] * xa[i];
                    a3 += w3[i] * xa[i];
                    b0 += w0[i] * xb[i];
                    b1 += w1[i] * xb[i];
                    b2 += w2[i] * xb[i];
                    b3 += w3[i] * xb[i];
                }
                float *ya = y + r * out + j, *yb = ya + out;
                ya[0] = a0; ya[1] = a1; ya[2] = a2; ya[3] = a3;
                yb[0] = b0; yb[1] = b1; yb[2] = b2; yb[3] = b3;
            }
            for (; r < m; r++)  /* an odd row out */
                for (int64_t k = 0; k < 4; k++)
                    y[r * out + j + k] = dot(w + (j + k) * in, x + r * in, in);
        }
        for (; j < out; j++)  /* the last out % 4 weight rows */
            for (int64_t r = 0; r < m; r++) y[r * out + j] = dot(w + j * in, x + r * in, in);
    }
    if (bias != NULL)
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < out; j++) y[r * out + j] += bias[j];
}

/* out[r] = x[r] / rms(x[r]) * weight, rms(v) = sqrt(mean(v^2) + eps). */
static void rms_norm_row(const float *x, const float *weight, float *out, int64_t hidden,
                         float eps) {
    float sum_sq = 0.0f;
    for (int64_t i = 0; i < hidden; i++) sum_sq += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
    for (int64_t i = 0; i < hidden; i++) out[i] = x[i] * inv * weight[i];
}

/*
 * For each of `rows` rows of `hidden`: x += residual (when residual is not NULL), then
 * out = rms_norm(x) * weight. x ends up holding the new residual stream.
 */
void add_rms_norm(float *x, const float *residual, const float *weight, float *out, int64_t rows,
                  int64_t hidden, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * hidden;
        if (residual != NULL) {
            const float *res = residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++) xr[i] += res[i];
        }
        rms_norm_row(xr, weight, out + r * hidden, hidden, eps);
    }
}

/* out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:], silu(g) = g / (1 + exp(-g)). */
void silu_and_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter;
        const float *up = gate + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/*
 * Rotates the first `heads` heads of each row in place (rotate-half pairs: element i with
 * element i + d/2) by that row's cos/sin tables, which hold d/2 values each.
 */
void rotary_in_place(float *x, const float *cos, const float *sin, int64_t rows, int64_t heads,
                     int64_t row_stride, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half;
        const float *s = sin + r * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + r * row_stride + h * d;
            float *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/*
 * Stores each row's keys and values (rows of `kv_heads` heads at row strides `k_stride`,
 * `v_stride`) into the caches [kv_heads, cache_slots, d] at that row's flat slot.
 */
void write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
              float *k_cache, float *v_cache, const int64_t *slots, int64_t rows,
              int64_t kv_heads, int64_t d, int64_t cache_slots) {
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t dst = (h * cache_slots + slots[r]) * d;
            memcpy(k_cache + dst, k + r * k_stride + h * d, sizeof(float) * (size_t)d);
            memcpy(v_cache + dst, v + r * v_stride + h * d, sizeof(float) * (size_t)d);
        }
    }
}

/*
 * One new token per sequence attending over its paged cache.
 *
 * q:            [n, heads, d] at row stride q_stride (floats)
 * k/v cache:    [kv_heads, num_blocks, block_size, d]
 * block_tables: [n, max_blocks]; context_lens: [n], the new token's own key included
 * out:          [n, heads, d] contiguous
 *
 * Query heads h * group .. h * group + group - 1 share KV head h, so each key and value is
 * read once for its whole group. A sequence sees its last `window` keys when window > 0;
 * softcap > 0 squashes scores to softcap * tanh(score / softcap) (Gemma).
 */
void paged_decode_attention(const float *q, int64_t q_stride, const float *k_cache,
                            const float *v_cache, const int64_t *block_tables,
                            const int64_t *context_lens, float *out, int64_t n, int64_t heads,
                            int64_t kv_heads, int64_t d, int64_t num_blocks, int64_t block_size,
                            int64_t max_blocks, float scale, int64_t window, float softcap) {
    const int64_t group = heads / kv_heads;
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < n; b++)
        if (context_lens[b] > max_ctx) max_ctx = context_lens[b];
    float *scores = malloc(sizeof(float) * (size_t)(group * max_ctx));
    float *acc = malloc(sizeof(float) * (size_t)(group * d));
    if (scores == NULL || acc == NULL) abort();
    const int64_t head_stride = num_blocks * block_size * d;  /* one KV head's whole cache */

    for (int64_t b = 0; b < n; b++) {
        const int64_t ctx = context_lens[b];
        const int64_t first = (window > 0 && ctx > window) ? ctx - window : 0;
        const int64_t len = ctx - first;
        const int64_t *table = block_tables + b * max_blocks;
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *qh = q + b * q_stride + h * group * d;
            const float *kh = k_cache + h * head_stride;
            const float *vh = v_cache + h * head_stride;

            for (int64_t j = first; j < ctx; j++) {  /* scores[g][j - first] = q_g . k_j */
                const float *k = kh + (table[j / block_size] * block_size + j % block_size) * d;
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qh + g * d;
                    float dot = 0.0f;
                    for (int64_t i = 0; i < d; i++) dot += qg[i] * k[i];
                    dot *= scale;
                    if (softcap > 0.0f) dot = softcap * tanhf(dot / softcap);
                    scores[g * len + (j - first)] = dot;
                }
            }
            for (int64_t g = 0; g < group; g++) {  /* softmax over each head's row */
                float *s = scores + g * len;
                float top = s[0];
                for (int64_t j = 1; j < len; j++) top = s[j] > top ? s[j] : top;
                float total = 0.0f;
                for (int64_t j = 0; j < len; j++) {
                    s[j] = expf(s[j] - top);
                    total += s[j];
                }
                const float inv = 1.0f / total;
                for (int64_t j = 0; j < len; j++) s[j] *= inv;
            }
            memset(acc, 0, sizeof(float) * (size_t)(group * d));
            for (int64_t j = first; j < ctx; j++) {  /* acc[g] = sum_j p[g][j] v_j */
                const float *v = vh + (table[j / block_size] * block_size + j % block_size) * d;
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g * len + (j - first)];
                    float *a = acc + g * d;
                    for (int64_t i = 0; i < d; i++) a[i] += p * v[i];
                }
            }
            memcpy(out + (b * heads + h * group) * d, acc, sizeof(float) * (size_t)(group * d));
        }
    }
    free(scores);
    free(acc);
}
