/*
 * Fused fp32 kernels for the CPU backend: the linear layers on pre-packed weights, and the
 * per-token work between them. In plain torch each of the latter is a chain of small ops (an
 * RMSNorm is seven, decode attention a gather copy plus a dozen more), and at batch 1 the
 * dispatch of those ops costs a fifth of a decode step. Each kernel here reads its inputs once
 * and writes its output once.
 *
 * cpu_kernels.py compiles this file on first use and calls it through ctypes; every kernel has
 * a torch twin (layers/) that is used when no C compiler is present and that the tests compare
 * against. All tensors are contiguous fp32 unless a stride says otherwise; one thread.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/*
 * y = x @ w^T + bias for any number of rows, on weights packed once into panels
 * (cpu_kernels.py, CPUKernels.pack): panel p holds output columns [p * PANEL, p * PANEL +
 * PANEL) as [in, PANEL], so w[p * PANEL + j, i] is packed[(p * in + i) * PANEL + j], zero-padded
 * past `out`. x [m, in], bias [out] or NULL, y [m, out].
 *
 * A tile is up to TILE_ROWS rows of x times one panel: for each i, the panel's PANEL weights
 * (two vectors) are loaded once and multiplied by every row's x[r, i], into TILE_ROWS x 2
 * vector sums held in registers. A panel (at most `in` x 128 bytes) stays in L2 while all the
 * row tiles of a ROW_BLOCK go through it, so the weights stream from memory once per ROW_BLOCK
 * rows; at one row this is a GEMV bound by that stream.
 */
#define PANEL 32
#define TILE_ROWS 8
#define ROW_BLOCK 64

typedef float vec16 __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) void tile(const float *x, int64_t in,
                                                       const float *panel, const float *bias,
                                                       float *y, int64_t out, int64_t cols,
                                                       int rows, const float *ahead,
                                                       int64_t ahead_every) {
    vec16 acc[TILE_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = (vec16){0};
    int64_t countdown = ahead_every;
    for (int64_t i = 0; i < in; i++) {
        if (ahead != NULL && --countdown == 0) {
            __builtin_prefetch(ahead, 0, 3);
            ahead += 16;
            countdown = ahead_every;
        }
        const vec16 w0 = *(const vec16 *)(panel + i * PANEL);
        const vec16 w1 = *(const vec16 *)(panel + i * PANEL + 16);
        for (int r = 0; r < rows; r++) {
            const float xi = x[r * in + i];
            acc[r][0] += xi * w0;
            acc[r][1] += xi * w1;
        }
    }
    for (int r = 0; r < rows; r++) {
        float sums[PANEL], *yr = y + r * out;
        memcpy(sums, acc[r], sizeof(sums));
        for (int64_t j = 0; j < cols; j++) yr[j] = bias != NULL ? sums[j] + bias[j] : sums[j];
    }
}

void packed_linear(const float *x, const float *packed, const float *bias, float *y, int64_t m,
                   int64_t in, int64_t out) {
    const int64_t panels = (out + PANEL - 1) / PANEL;
    for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
        const int64_t r1 = r0 + ROW_BLOCK < m ? r0 + ROW_BLOCK : m;
        for (int64_t p = 0; p < panels; p++) {
            const float *panel = packed + p * in * PANEL;
            const int64_t c0 = p * PANEL, cols = out - c0 < PANEL ? out - c0 : PANEL;
            const float *b = bias != NULL ? bias + c0 : NULL;
            float *yp = y + c0;
            /* Several row tiles share this panel: they fetch the next one between them, a
             * line every ahead_every steps, so it is in cache when its first tile starts
             * instead of being read at the speed of memory. With one or two tiles the weights
             * are read about as fast as they are used, and the hardware streams them. */
            const int64_t tiles = (r1 - r0 + TILE_ROWS - 1) / TILE_ROWS;
            const int64_t lines = in * PANEL / 16;
            const int64_t every = tiles > 2 ? (in * tiles + lines - 1) / lines : 0;
            const float *ahead = tiles > 2 && p + 1 < panels ? panel + in * PANEL : NULL;
            int64_t r = r0;
#define TILE(n)                                                                              \
    do {                                                                                     \
        tile(x + r * in, in, panel, b, yp + r * out, out, cols, n, ahead, every);            \
        if (ahead != NULL) ahead += (in / every) * 16;                                       \
        r += n;                                                                              \
    } while (0)
            /* Whole tiles, then 4, 2 and 1 rows: constant row counts keep the sums in registers. */
            while (r + TILE_ROWS <= r1) TILE(TILE_ROWS);
            if (r + 4 <= r1) TILE(4);
            if (r + 2 <= r1) TILE(2);
            if (r < r1) TILE(1);
#undef TILE
        }
    }
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
/* Vectors that may sit at any float boundary (query rows inside the fused qkv output). */
typedef float vec16u __attribute__((vector_size(64), aligned(4)));

static inline float lane_sum(vec16 v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/*
 * Asks for 64-byte lines first .. first + count - 1 (below end) of p into L2. A fetch into L2
 * (locality 1) does not hold one of L1's few miss buffers while it waits on memory, so many
 * more lines are in flight at once: 1.4-1.6x the bandwidth of an L1 fetch on long contexts.
 */
static inline void prefetch_lines(const float *p, int64_t first, int64_t count, int64_t end) {
    for (int64_t l = first; l < first + count && l < end; l++) __builtin_prefetch(p + 16 * l, 0, 1);
}

/*
 * One KV head of one sequence: its `group` query heads (qh, contiguous) over keys first..ctx-1,
 * writing [group, d] to out. One pass, block by block through the sequence's table: a block's
 * scores, then its values weighted by them, with the softmax kept online (each head's running
 * max `top` and sum `total`; earlier sums are rescaled when the max grows). Reading a block's
 * keys and values back to back keeps both in flight from memory together. `vecs` is d / 16; the
 * callers pass it as a constant so the loops over a row unroll. scores holds group x block_size.
 * The last block fetches the first `after_lines` lines of after_k / after_v, the next head's
 * first block (NULL for none).
 */
static inline __attribute__((always_inline)) void attend_kv_head(
    const float *qh, const float *kh, const float *vh, const int64_t *table, int64_t first,
    int64_t ctx, int64_t block_size, int64_t group, int vecs, float scale, float softcap,
    const float *after_k, const float *after_v, int64_t after_lines, float *scores, float *top,
    float *total, float *out) {
    const int64_t d = (int64_t)vecs * 16;
    for (int64_t g = 0; g < group; g++) {
        total[g] = 0.0f;
        for (int v = 0; v < vecs; v++) *(vec16u *)(out + g * d + 16 * v) = (vec16){0};
    }
    for (int64_t j = first; j < ctx;) {
        const int64_t offset = j % block_size;
        const int64_t keys = (ctx < j - offset + block_size ? ctx : j - offset + block_size) - j;
        const int64_t row = (table[j / block_size] * block_size + offset) * d;
        const float *k = kh + row, *val = vh + row;
        /* Blocks lie anywhere in the cache, and the hardware does not stream from one block
         * into another: each key of this block fetches a share of the next block's lines. */
        const float *next_k = after_k, *next_v = after_v;
        int64_t lines = after_lines;
        if (j + keys < ctx) {
            const int64_t next_row = table[j / block_size + 1] * block_size * d;
            next_k = kh + next_row;
            next_v = vh + next_row;
            lines = block_size * d / 16;
        }
        const int64_t share = (lines + keys - 1) / keys;
        for (int64_t t = 0; t < keys; t++, k += d) {  /* scores[g][t] = q_g . k_t */
            if (next_k != NULL) prefetch_lines(next_k, t * share, share, lines);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qh + g * d;
                vec16 sum = *(const vec16u *)qg * *(const vec16 *)k;
                for (int v = 1; v < vecs; v++)
                    sum += *(const vec16u *)(qg + 16 * v) * *(const vec16 *)(k + 16 * v);
                float dot = lane_sum(sum) * scale;
                if (softcap > 0.0f) dot = softcap * tanhf(dot / softcap);
                scores[g * block_size + t] = dot;
            }
        }
        for (int64_t g = 0; g < group; g++) {  /* scores -> exp(score - running max) */
            float *sc = scores + g * block_size;
            float m = j == first ? sc[0] : top[g];
            for (int64_t t = 0; t < keys; t++) m = sc[t] > m ? sc[t] : m;
            float sum = 0.0f;
            for (int64_t t = 0; t < keys; t++) {
                sc[t] = expf(sc[t] - m);
                sum += sc[t];
            }
            if (j != first && m > top[g]) {
                const float shrink = expf(top[g] - m);
                total[g] *= shrink;
                for (int v = 0; v < vecs; v++) *(vec16u *)(out + g * d + 16 * v) *= shrink;
            }
            total[g] += sum;
            top[g] = m;
        }
        for (int64_t t = 0; t < keys; t++, val += d) {  /* out[g] += p[g][t] v_t */
            if (next_k != NULL) prefetch_lines(next_v, t * share, share, lines);
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * block_size + t];
                float *o = out + g * d;
                for (int v = 0; v < vecs; v++)
                    *(vec16u *)(o + 16 * v) += p * *(const vec16 *)(val + 16 * v);
            }
        }
        j += keys;
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.0f / total[g];
        for (int v = 0; v < vecs; v++) *(vec16u *)(out + g * d + 16 * v) *= inv;
    }
}

/* The same for any head size: plain loops over d. */
static void attend_kv_head_any(const float *qh, const float *kh, const float *vh,
                               const int64_t *table, int64_t first, int64_t ctx,
                               int64_t block_size, int64_t group, int64_t d, float scale,
                               float softcap, float *scores, float *out) {
    const int64_t len = ctx - first;
    for (int64_t j = first; j < ctx; j++) {
        const float *k = kh + (table[j / block_size] * block_size + j % block_size) * d;
        for (int64_t g = 0; g < group; g++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < d; i++) dot += qh[g * d + i] * k[i];
            dot *= scale;
            if (softcap > 0.0f) dot = softcap * tanhf(dot / softcap);
            scores[g * len + (j - first)] = dot;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * len;
        float top = s[0];
        for (int64_t j = 1; j < len; j++) top = s[j] > top ? s[j] : top;
        float total = 0.0f;
        for (int64_t j = 0; j < len; j++) {
            s[j] = expf(s[j] - top);
            total += s[j];
        }
        for (int64_t j = 0; j < len; j++) s[j] /= total;
    }
    memset(out, 0, sizeof(float) * (size_t)(group * d));
    for (int64_t j = first; j < ctx; j++) {
        const float *val = vh + (table[j / block_size] * block_size + j % block_size) * d;
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < d; i++) out[g * d + i] += scores[g * len + (j - first)] * val[i];
    }
}

/* A sequence's first key in attention: all of them, or the last `window` (0 for none). */
static inline int64_t first_key(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

void paged_decode_attention(const float *q, int64_t q_stride, const float *k_cache,
                            const float *v_cache, const int64_t *block_tables,
                            const int64_t *context_lens, float *out, int64_t n, int64_t heads,
                            int64_t kv_heads, int64_t d, int64_t num_blocks, int64_t block_size,
                            int64_t max_blocks, float scale, int64_t window, float softcap) {
    const int64_t group = heads / kv_heads;
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < n; b++)
        if (context_lens[b] > max_ctx) max_ctx = context_lens[b];
    /* The one-pass kernel needs group x block_size scores, the any-size one group x max_ctx. */
    const int64_t score_len = max_ctx > block_size ? max_ctx : block_size;
    float *scores = malloc(sizeof(float) * (size_t)(group * (score_len + 2)));
    if (scores == NULL) abort();
    float *top = scores + group * score_len, *total = top + group;
    const int64_t head_stride = num_blocks * block_size * d;  /* one KV head's whole cache */

    for (int64_t b = 0; b < n; b++) {
        const int64_t ctx = context_lens[b];
        const int64_t first = first_key(ctx, window);
        const int64_t *table = block_tables + b * max_blocks;
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *qh = q + b * q_stride + h * group * d;
            const float *kh = k_cache + h * head_stride, *vh = v_cache + h * head_stride;
            float *o = out + (b * heads + h * group) * d;
            /* The (sequence, KV head) after this one, whose first block this one's last
             * block fetches: no hardware stream carries over from one to the next. */
            const float *after_k = NULL, *after_v = NULL;
            int64_t after_lines = 0;
            if (h + 1 < kv_heads || b + 1 < n) {
                const int64_t nb = h + 1 < kv_heads ? b : b + 1;
                const int64_t nh = h + 1 < kv_heads ? h + 1 : 0;
                const int64_t nctx = context_lens[nb], nfirst = first_key(nctx, window);
                const int64_t skip = nfirst % block_size;
                const int64_t keys = nctx - nfirst < block_size - skip ? nctx - nfirst
                                                                       : block_size - skip;
                const int64_t row = (block_tables[nb * max_blocks + nfirst / block_size] *
                                     block_size + skip) * d + nh * head_stride;
                after_k = k_cache + row;
                after_v = v_cache + row;
                after_lines = keys * d / 16;
            }
            /* Head sizes of whole vectors take the vector kernel, the common ones with a
             * constant size; cache rows are then 64-byte aligned. */
            if (d == 64)
                attend_kv_head(qh, kh, vh, table, first, ctx, block_size, group, 4, scale,
                               softcap, after_k, after_v, after_lines, scores, top, total, o);
            else if (d == 128)
                attend_kv_head(qh, kh, vh, table, first, ctx, block_size, group, 8, scale,
                               softcap, after_k, after_v, after_lines, scores, top, total, o);
            else if (d % 16 == 0)
                attend_kv_head(qh, kh, vh, table, first, ctx, block_size, group, (int)(d / 16),
                               scale, softcap, after_k, after_v, after_lines, scores, top,
                               total, o);
            else
                attend_kv_head_any(qh, kh, vh, table, first, ctx, block_size, group, d, scale,
                                   softcap, scores, o);
        }
    }
    free(scores);
}

/*
 * out[r] = the first column of row r holding the row's largest value (torch.argmax over finite
 * values). Greedy decoding takes it over the vocabulary for every row, where torch's argmax
 * runs at a few GB/s. One vector pass finds the maximum, a second stops at its first
 * occurrence. Built with -ffast-math, so NaN is not looked for: the model runner fails rows
 * whose hidden state holds NaN.
 */
void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        float top = row[0];
        int64_t c = 0;
        if (cols >= 16) {
            float lanes[16];
            memcpy(lanes, row, sizeof lanes);
            for (c = 16; c + 16 <= cols; c += 16)
                for (int l = 0; l < 16; l++) lanes[l] = row[c + l] > lanes[l] ? row[c + l] : lanes[l];
            for (int l = 0; l < 16; l++) top = lanes[l] > top ? lanes[l] : top;
        }
        for (; c < cols; c++) top = row[c] > top ? row[c] : top;
        int64_t first = 0;
        while (first < cols - 1 && row[first] != top) first++;
        out[r] = first;
    }
}
