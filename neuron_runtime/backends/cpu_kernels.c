/*
 * Fused fp32 kernels for the CPU backend: the linear layers on pre-packed weights, and the
 * per-token work between them. In plain torch each of the latter is a chain of small ops (an
 * RMSNorm is seven, decode attention a gather copy plus a dozen more), and at batch 1 the
 * dispatch of those ops costs a fifth of a decode step. Each kernel here reads its inputs once
 * and writes its output once.
 *
 * cpu_kernels.py compiles this file on first use and calls it through ctypes; every kernel has
 * a torch twin (layers/) that is used when no C compiler is present and that the tests compare
 * against. All tensors are contiguous fp32 unless a stride says otherwise.
 *
 * The kernels split their work over a pool of threads (set_num_threads); every output element
 * is computed by one thread in the same order whatever the thread count, so results do not
 * depend on it.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/*
 * The thread pool: num_threads - 1 workers, created once, plus the calling thread.
 *
 * A job is `tasks` independent tasks of fn, handed out `grain` at a time from one counter
 * (`cursor`: the job's generation in the high 32 bits, the next task in the low 32), so a
 * thread that starts late, or is preempted by another process on a shared host, only takes
 * fewer of them; the caller works through the tasks too and returns when all are done.
 * Between jobs a worker spins for SPIN_NS (a forward pass calls a kernel every few tens of
 * microseconds), then sleeps on a futex, so an idle engine costs no CPU.
 */
typedef void (*task_fn)(const void *ctx, int64_t begin, int64_t end);

#define MAX_THREADS 256
#define CURSOR_CLOSED 0xffffffffu /* a task index past any job's */
#define SPIN_NS 100000

static struct {
    pthread_mutex_t lock;          /* one job at a time; set_num_threads */
    _Atomic int threads;           /* workers + the caller */
    pthread_t workers[MAX_THREADS];
    task_fn fn;                    /* the current job (cursor closed while written) */
    const void *ctx;
    int64_t tasks, grain;
    _Atomic uint64_t cursor;       /* generation << 32 | next task */
    _Atomic uint32_t generation;   /* futex: a new job (or stop) */
    _Atomic uint32_t done;         /* tasks finished in the current job; futex for the caller */
    _Atomic uint32_t sleepers;     /* workers asleep (or about to be) on generation */
    _Atomic uint32_t caller_asleep;
    _Atomic int stop;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .threads = 1};

static void futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/*
 * Spins until (*addr == value) == equal, for at most SPIN_NS; returns whether it came.
 * Between rounds of 64 pauses it yields its core: on a host shared with other processes (a
 * Serve replica beside its ingress, HTTP proxy and Ray's daemons) a thread that waits here
 * would otherwise keep a core from a runnable one until preempted, and that one may be the
 * engine's own thread that issues the next kernel call; alone on its core, sched_yield comes
 * straight back.
 */
static int spin_until(_Atomic uint32_t *addr, uint32_t value, int equal) {
    const int64_t until = now_ns() + SPIN_NS;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if ((atomic_load_explicit(addr, memory_order_acquire) == value) == equal) return 1;
            cpu_relax();
        }
        if (now_ns() > until) return 0;
        sched_yield();
    }
}

/* Takes tasks of job `gen` until none are left (or the job is over). */
static void work_on(uint32_t gen) {
    uint64_t c = atomic_load(&pool.cursor);
    for (;;) {
        if ((uint32_t)(c >> 32) != gen) return;
        /* Read before the exchange: a caller closes the cursor before it writes the next
         * job's fields, so a successful exchange proves they were this job's throughout. */
        const int64_t next = (int64_t)(uint32_t)c;
        const int64_t tasks = __atomic_load_n(&pool.tasks, __ATOMIC_RELAXED);
        const int64_t grain = __atomic_load_n(&pool.grain, __ATOMIC_RELAXED);
        const task_fn fn = __atomic_load_n(&pool.fn, __ATOMIC_RELAXED);
        const void *ctx = __atomic_load_n(&pool.ctx, __ATOMIC_RELAXED);
        if (next >= tasks) return;
        if (!atomic_compare_exchange_weak(&pool.cursor, &c, c + (uint64_t)grain)) continue;
        const int64_t end = next + grain < tasks ? next + grain : tasks;
        fn(ctx, next, end);
        if (atomic_fetch_add(&pool.done, (uint32_t)(end - next)) + (end - next) == tasks &&
            atomic_load(&pool.caller_asleep))
            futex_wake(&pool.done);
        c = atomic_load(&pool.cursor);
    }
}

static void *worker_main(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg;
    for (;;) {
        if (!spin_until(&pool.generation, seen, 0)) {
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.generation) == seen) futex_wait(&pool.generation, seen);
            atomic_fetch_sub(&pool.sleepers, 1);
        }
        seen = atomic_load(&pool.generation);
        if (atomic_load(&pool.stop)) return NULL;
        work_on(seen);
    }
}

/*
 * Runs fn over tasks [0, tasks), `grain` per call, on the pool; returns when all are done.
 * Runs them all on the calling thread when the pool has no workers, when there is only one
 * piece of work, or when another thread's job holds the pool (ctypes calls drop the GIL).
 */
static void parallel_for(task_fn fn, const void *ctx, int64_t tasks, int64_t grain) {
    if (tasks <= 0) return;
    if (grain < 1) grain = 1;
    if (pool.threads == 1 || grain >= tasks || tasks >= INT32_MAX ||
        pthread_mutex_trylock(&pool.lock) != 0) {
        fn(ctx, 0, tasks);
        return;
    }
    if (pool.threads == 1) { /* resized to one while we waited for the lock */
        pthread_mutex_unlock(&pool.lock);
        fn(ctx, 0, tasks);
        return;
    }
    const uint32_t gen = atomic_load(&pool.generation) + 1;
    /* Closed first: a worker still holding the last job's cursor value must fail its
     * exchange rather than take a task of this job with that job's fields. */
    atomic_store(&pool.cursor, (uint64_t)gen << 32 | CURSOR_CLOSED);
    __atomic_store_n(&pool.fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.tasks, tasks, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.grain, grain, __ATOMIC_RELAXED);
    atomic_store(&pool.done, 0);
    atomic_store(&pool.cursor, (uint64_t)gen << 32);
    atomic_store(&pool.generation, gen);
    if (atomic_load(&pool.sleepers)) futex_wake(&pool.generation);
    work_on(gen);
    /* Workers may still be finishing the tasks they took. */
    spin_until(&pool.done, (uint32_t)tasks, 1);
    for (uint32_t d; (d = atomic_load(&pool.done)) != (uint32_t)tasks;) {
        atomic_store(&pool.caller_asleep, 1);
        if ((d = atomic_load(&pool.done)) != (uint32_t)tasks) futex_wait(&pool.done, d);
        atomic_store(&pool.caller_asleep, 0);
    }
    pthread_mutex_unlock(&pool.lock);
}

static void stop_workers(void) {
    atomic_store(&pool.stop, 1);
    atomic_fetch_add(&pool.generation, 1);
    futex_wake(&pool.generation);
    for (int i = 0; i < pool.threads - 1; i++) pthread_join(pool.workers[i], NULL);
    atomic_store(&pool.stop, 0);
    atomic_store(&pool.threads, 1);
}

static void start_workers(int n) {
    /* Workers take no signals: Python handles them on its main thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    const uintptr_t gen = atomic_load(&pool.generation);
    int started = 0;
    while (started < n - 1 &&
           pthread_create(&pool.workers[started], NULL, worker_main, (void *)gen) == 0)
        started++;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    atomic_store(&pool.threads, started + 1);
}

/* A forked child has only the thread that forked: it starts with no workers. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    atomic_store(&pool.threads, 1);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.caller_asleep, 0);
}

__attribute__((constructor)) static void pool_init(void) {
    pthread_atfork(NULL, NULL, pool_after_fork);
}

/* Sizes the pool to n threads, the caller included (1: everything on the caller). */
void set_num_threads(int64_t n) {
    n = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
    pthread_mutex_lock(&pool.lock);
    if (n != pool.threads) {
        stop_workers();
        start_workers((int)n);
    }
    pthread_mutex_unlock(&pool.lock);
}

int64_t num_threads(void) { return pool.threads; }

/*
 * How many tasks a job of `tasks` gets per grab: about TASKS_PER_THREAD grabs per thread, so
 * a late or preempted thread leaves its share to the others, and at least min_grain tasks
 * (work too small to be worth a cache line passed between cores stays on one).
 */
#define TASKS_PER_THREAD 4

static int64_t grain_for(int64_t tasks, int64_t min_grain) {
    const int64_t grain = tasks / (TASKS_PER_THREAD * (int64_t)pool.threads);
    return grain > min_grain ? grain : min_grain < 1 ? 1 : min_grain;
}

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
typedef float vec8 __attribute__((vector_size(32)));

/* A tile row's PANEL sums (plus bias) into the output's first `cols` columns. */
static inline __attribute__((always_inline)) void store_row(const float *sums, const float *bias, float *yr, int64_t cols) {
    for (int64_t j = 0; j < cols; j++) yr[j] = bias != NULL ? sums[j] + bias[j] : sums[j];
}

#if !defined(__AVX512F__) && defined(__AVX__)
/*
 * Without AVX-512, GCC lowers 64-byte vector arithmetic piecewise, through the stack (a
 * scalar times a vec16 is built lane by lane): ~10x slower than the same sums on 32-byte
 * vectors. So on AVX/AVX2 the tiles below sum on vec8 (four per panel row, sixteen ymm
 * registers: two rows at a time), lane for lane the same operations in the same order.
 */
#define TILE8_ROWS 2

static inline __attribute__((always_inline)) void tile8(const float *x, int64_t in,
                                                        const float *panel, const float *bias,
                                                        float *y, int64_t out, int64_t cols,
                                                        int rows, const float *ahead,
                                                        int64_t ahead_every) {
    vec8 acc[TILE8_ROWS][4];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = (vec8){0};
    int64_t countdown = ahead_every;
    for (int64_t i = 0; i < in; i++) {
        if (ahead != NULL && --countdown == 0) {
            __builtin_prefetch(ahead, 0, 3);
            ahead += 16;
            countdown = ahead_every;
        }
        const float *w = panel + i * PANEL;
        const vec8 w0 = *(const vec8 *)w, w1 = *(const vec8 *)(w + 8);
        const vec8 w2 = *(const vec8 *)(w + 16), w3 = *(const vec8 *)(w + 24);
        for (int r = 0; r < rows; r++) {
            const float xi = x[r * in + i];
            const vec8 b = {xi, xi, xi, xi, xi, xi, xi, xi};
            acc[r][0] += b * w0;
            acc[r][1] += b * w1;
            acc[r][2] += b * w2;
            acc[r][3] += b * w3;
        }
    }
    for (int r = 0; r < rows; r++) {
        float sums[PANEL];
        memcpy(sums, acc[r], sizeof(sums));
        store_row(sums, bias, y + r * out, cols);
    }
}

/*
 * Three rows and more: GROUP_ROWS rows times half a panel (16 columns, two vec8), twelve sums
 * in registers. Per input that is 12 FMAs on two weight loads and six broadcasts, enough
 * independent sums to keep both FMA pipes busy through their latency, where a pair of rows on
 * a whole panel runs 8 sums on four weight loads. A half panel of 16 rows is read three times
 * (6 + 6 + 4 rows), not eight. Each sum is the same chain of FMAs over i as in tile8. The two
 * stay separate functions: one over both shapes (vec8 counts as a parameter) measured 5-15%
 * slower, its sums no longer all kept in registers.
 */
#define GROUP_ROWS 6

static inline __attribute__((always_inline)) void group16(const float *x, int64_t in,
                                                          const float *w, const float *bias,
                                                          float *y, int64_t out, int64_t cols,
                                                          int rows, const float *ahead,
                                                          int64_t ahead_every) {
    vec8 acc[GROUP_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = (vec8){0};
    int64_t countdown = ahead_every;
    for (int64_t i = 0; i < in; i++) {
        if (ahead != NULL && --countdown == 0) {
            __builtin_prefetch(ahead, 0, 3);
            ahead += 16;
            countdown = ahead_every;
        }
        const vec8 w0 = *(const vec8 *)(w + i * PANEL), w1 = *(const vec8 *)(w + i * PANEL + 8);
        for (int r = 0; r < rows; r++) {
            const float xi = x[r * in + i];
            const vec8 b = {xi, xi, xi, xi, xi, xi, xi, xi};
            acc[r][0] += b * w0;
            acc[r][1] += b * w1;
        }
    }
    for (int r = 0; r < rows; r++) {
        float sums[16];
        memcpy(sums, acc[r], sizeof(sums));
        store_row(sums, bias, y + r * out, cols);
    }
}

/* Rows [0, rows) of x (three or more) times one panel, a half panel at a time. */
static void groups16(const float *x, int64_t in, const float *panel, const float *bias,
                     float *y, int64_t out, int64_t cols, int64_t rows, const float *ahead) {
    const int64_t halves = cols > 16 ? 2 : 1;
    const int64_t passes = halves * ((rows + GROUP_ROWS - 1) / GROUP_ROWS);
    /* Three passes and more fetch the next panel between them, a line every `every` inputs
     * (fewer read the weights about as fast as they use them: the hardware streams them). */
    if (passes <= 2) ahead = NULL;
    const int64_t lines = in * PANEL / 16;
    const int64_t every = ahead != NULL ? (in * passes + lines - 1) / lines : 0;
    for (int64_t h = 0; h < halves; h++) {
        const int64_t c0 = h * 16, hcols = cols - c0 < 16 ? cols - c0 : 16;
        const float *b = bias != NULL ? bias + c0 : NULL;
        for (int64_t r = 0; r < rows; r += GROUP_ROWS) {
            const float *xr = x + r * in;
            float *yr = y + r * out + c0;
            const float *w = panel + c0;
            switch (rows - r < GROUP_ROWS ? rows - r : GROUP_ROWS) {
#define GROUP(n)                                                                             \
    case n:                                                                                  \
        group16(xr, in, w, b, yr, out, hcols, n, ahead, every);                              \
        break
                GROUP(6);
                GROUP(5);
                GROUP(4);
                GROUP(3);
                GROUP(2);
                GROUP(1);
#undef GROUP
            }
            if (ahead != NULL) ahead += (in / every) * 16;
        }
    }
}
#endif

static inline __attribute__((always_inline)) void tile(const float *x, int64_t in,
                                                       const float *panel, const float *bias,
                                                       float *y, int64_t out, int64_t cols,
                                                       int rows, const float *ahead,
                                                       int64_t ahead_every) {
#if !defined(__AVX512F__) && defined(__AVX__)
    /* Pairs of rows; the first pair fetches the next panel's lines. */
    for (int r = 0; r < rows; r += TILE8_ROWS) {
        const int n = rows - r < TILE8_ROWS ? rows - r : TILE8_ROWS;
        tile8(x + r * in, in, panel, bias, y + r * out, out, cols, n, r == 0 ? ahead : NULL,
              ahead_every);
    }
#else
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
        float sums[PANEL];
        memcpy(sums, acc[r], sizeof(sums));
        store_row(sums, bias, y + r * out, cols);
    }
#endif
}

struct linear_job {
    const void *x, *packed; /* fp32, or bf16 pairs (packed_linear_bf16) */
    const float *bias;
    float *y;
    int64_t m, in, out, panels, chunks, chunk_panels;
    int bf16;
};

#if defined(__AVX512BF16__)
/* The bf16 tile (packed_linear_bf16 below): x and the panel as 32-bit lanes, each holding a
 * pair of bf16 values. */
static inline __attribute__((always_inline)) void tile_bf16(const uint32_t *x, int64_t pairs,
                                                            const uint32_t *panel,
                                                            const float *bias, float *y,
                                                            int64_t out, int64_t cols, int rows,
                                                            const uint32_t *ahead,
                                                            int64_t ahead_every, int ahead_l2) {
    __m512 acc[TILE_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t countdown = ahead_every;
    for (int64_t i = 0; i < pairs; i++) {
        if (ahead != NULL && --countdown == 0) {
            if (ahead_l2)
                __builtin_prefetch(ahead, 0, 2);
            else
                __builtin_prefetch(ahead, 0, 3);
            ahead += 16;
            countdown = ahead_every;
        }
        const __m512bh w0 = (__m512bh)_mm512_load_si512(panel + i * PANEL);
        const __m512bh w1 = (__m512bh)_mm512_load_si512(panel + i * PANEL + 16);
        for (int r = 0; r < rows; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)x[r * pairs + i]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, w1);
        }
    }
    for (int r = 0; r < rows; r++) {
        float sums[PANEL];
        _mm512_storeu_ps(sums, acc[r][0]);
        _mm512_storeu_ps(sums + 16, acc[r][1]);
        store_row(sums, bias, y + r * out, cols);
    }
}

#define BF16_TILE(n)                                                                         \
    do {                                                                                     \
        if (tiles == 2) /* a constant locality in each copy */                               \
            tile_bf16(x + r * steps, steps, panel, b, yp + r * out, out, cols, n, ahead, every, \
                      1);                                                                    \
        else                                                                                 \
            tile_bf16(x + r * steps, steps, panel, b, yp + r * out, out, cols, n, ahead, every, \
                      0);                                                                    \
    } while (0)
#else
#define BF16_TILE(n) abort() /* cpu_kernels.py asks has_bf16 first */
#endif

/*
 * Rows [r0, r1) (one row block) times panels [p0, p1). A panel is `steps` rows of PANEL
 * 4-byte lanes: fp32 weights, one input per row, or (bf16, a constant in each caller) pairs of
 * bf16 weights, two inputs per row; a row of x is `steps` lanes the same way.
 */
static inline __attribute__((always_inline)) void linear_block(const struct linear_job *j,
                                                               int64_t r0, int64_t r1,
                                                               int64_t p0, int64_t p1,
                                                               int bf16) {
    const int64_t steps = bf16 ? j->in / 2 : j->in, out = j->out;
    for (int64_t p = p0; p < p1; p++) {
        const uint32_t *panel = (const uint32_t *)j->packed + p * steps * PANEL;
        const int64_t c0 = p * PANEL, cols = out - c0 < PANEL ? out - c0 : PANEL;
        const float *b = j->bias != NULL ? j->bias + c0 : NULL;
        float *yp = j->y + c0;
        const uint32_t *x = j->x;
#if !defined(__AVX512F__) && defined(__AVX__)
        if (!bf16 && r1 - r0 > TILE8_ROWS) {
            groups16((const float *)(x + r0 * steps), steps, (const float *)panel, b,
                     yp + r0 * out, out, cols, r1 - r0,
                     p + 1 < p1 ? (const float *)(panel + steps * PANEL) : NULL);
            continue;
        }
#endif
        /* Several row tiles share this panel: they fetch the next one between them, a
         * line every ahead_every steps, so it is in cache when its first tile starts
         * instead of being read at the speed of memory. With one fp32 tile or two the
         * weights are read about as fast as they are used, and the hardware streams them.
         * Two bf16 tiles (9-16 rows, a decode batch) use half the bytes twice as fast: the
         * first would wait on memory while the second runs from L2, so both fetch the next
         * panel into L2 (16 rows of SmolLM2's layers: 5-7% faster on 2 threads, AMD Zen 4;
         * into L1, as more tiles do, it was no faster). */
        const int64_t tiles = (r1 - r0 + TILE_ROWS - 1) / TILE_ROWS;
        const int64_t lines = steps * PANEL / 16;
        const int fetch = tiles > 2 || (bf16 && tiles == 2);
        const int64_t every = fetch ? (steps * tiles + lines - 1) / lines : 0;
        const uint32_t *ahead = fetch && p + 1 < p1 ? panel + steps * PANEL : NULL;
        int64_t r = r0;
#define TILE(n)                                                                              \
    do {                                                                                     \
        if (bf16)                                                                            \
            BF16_TILE(n);                                                                    \
        else                                                                                 \
            tile((const float *)(x + r * steps), steps, (const float *)panel, b,             \
                 yp + r * out, out, cols, n, (const float *)ahead, every);                   \
        if (ahead != NULL) ahead += (steps / every) * 16;                                    \
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
#undef BF16_TILE

/* Task t: row block t / chunks, panels of chunk t % chunks. */
static void linear_tasks(const void *ctx, int64_t begin, int64_t end) {
    const struct linear_job *j = ctx;
    for (int64_t t = begin; t < end; t++) {
        const int64_t r0 = t / j->chunks * ROW_BLOCK, p0 = t % j->chunks * j->chunk_panels;
        const int64_t r1 = r0 + ROW_BLOCK < j->m ? r0 + ROW_BLOCK : j->m;
        const int64_t p1 = p0 + j->chunk_panels < j->panels ? p0 + j->chunk_panels : j->panels;
        if (j->bf16)
            linear_block(j, r0, r1, p0, p1, 1);
        else
            linear_block(j, r0, r1, p0, p1, 0);
    }
}

/*
 * Threads split the output columns (chunks of whole panels) and, when there are few panels
 * for many rows, the row blocks: each output element is still one tile's sum, in the same
 * order as on one thread.
 */
static void run_linear(const void *x, const void *packed, const float *bias, float *y,
                       int64_t m, int64_t in, int64_t out, int bf16) {
    const int64_t panels = (out + PANEL - 1) / PANEL;
    const int64_t row_blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
    /* Enough tasks for TASKS_PER_THREAD each, in as few chunks per row block as that takes. */
    const int64_t wanted = TASKS_PER_THREAD * (int64_t)pool.threads;
    int64_t chunks = (wanted + row_blocks - 1) / row_blocks;
    chunks = chunks < panels ? chunks : panels;
    const int64_t chunk_panels = (panels + chunks - 1) / chunks;
    chunks = (panels + chunk_panels - 1) / chunk_panels;
    const struct linear_job job = {x,   packed, bias,   y,           m,   in,
                                   out, panels, chunks, chunk_panels, bf16};
    parallel_for(linear_tasks, &job, row_blocks * chunks, 1);
}

void packed_linear(const float *x, const float *packed, const float *bias, float *y, int64_t m,
                   int64_t in, int64_t out) {
    run_linear(x, packed, bias, y, m, in, out, 0);
}

/*
 * The same GEMM in bf16 where the CPU has AVX512_BF16 (cpu_kernels.py, CPUKernels.pack_bf16):
 * x ([m, in] fp32) is rounded to bf16 once per call, by the calling thread, and a panel holds,
 * for each pair of inputs (2i, 2i + 1), PANEL 32-bit lanes, lane j the two bf16 weights of
 * column j (input 2i in the low half). One VDPBF16PS
 * adds both products of a pair to each of 16 fp32 sums: twice the multiply-adds of an fp32
 * FMA per instruction, on half the weight bytes. The products of two bf16 values are exact in
 * fp32; the sums are fp32, in the same order for a row whatever the batch or thread count.
 */
#if defined(__AVX512BF16__)
int64_t has_bf16(void) { return 1; }

static pthread_key_t bf16_inputs_key;
static pthread_once_t bf16_inputs_once = PTHREAD_ONCE_INIT;
static __thread uint16_t *bf16_inputs;
static __thread int64_t bf16_inputs_size;

static void make_bf16_inputs_key(void) { pthread_key_create(&bf16_inputs_key, free); }

/* x ([m, in] fp32) rounded to bf16 (to nearest even; denormals to zero) in this thread's
 * buffer, grown as needed and freed when the thread ends; NULL when it cannot grow. */
static const uint16_t *bf16_rounded(const float *x, int64_t n) {
    if (bf16_inputs_size < n) {
        pthread_once(&bf16_inputs_once, make_bf16_inputs_key);
        free(bf16_inputs);
        bf16_inputs = aligned_alloc(64, (size_t)((n + 31) / 32 * 64));
        bf16_inputs_size = bf16_inputs != NULL ? n : 0;
        pthread_setspecific(bf16_inputs_key, bf16_inputs);
        if (bf16_inputs == NULL) return NULL;
    }
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(bf16_inputs + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    if (i < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1);
        const __m512 rest = _mm512_maskz_loadu_ps(tail, x + i);
        _mm256_mask_storeu_epi16(bf16_inputs + i, tail, (__m256i)_mm512_cvtneps_pbh(rest));
    }
    return bf16_inputs;
}

/* Returns -1 (nothing written) when the buffer for x in bf16 cannot be allocated. */
int64_t packed_linear_bf16(const float *x, const uint32_t *packed, const float *bias, float *y,
                           int64_t m, int64_t in, int64_t out) {
    const uint16_t *xb = bf16_rounded(x, m * in);
    if (xb == NULL) return -1;
    run_linear(xb, packed, bias, y, m, in, out, 1);
    return 0;
}
#else
int64_t has_bf16(void) { return 0; }

int64_t packed_linear_bf16(const float *x, const uint32_t *packed, const float *bias, float *y,
                           int64_t m, int64_t in, int64_t out) {
    (void)x, (void)packed, (void)bias, (void)y, (void)m, (void)in, (void)out;
    abort(); /* cpu_kernels.py asks has_bf16 first */
}
#endif

/*
 * The same GEMM on weights that stay in their GGUF quantization (cpu_kernels.py,
 * CPUKernels.pack_q4_1 / pack_q8_0), dequantized in registers: a panel is PANEL output
 * columns as in packed_linear, cut into k-blocks of QBLOCK inputs (the GGUF block), one
 * record per (panel, k-block), records of a panel consecutive:
 *   Q4_1 (768 bytes): scale[32] and min[32] as fp32 (column j), then for each of the 32
 *        inputs 16 bytes, byte j holding column j in its low nibble and column j + 16 in
 *        its high one: w = scale * q + min;
 *   Q8_0 (1152 bytes): scale[32] fp32, then for each input 32 int8 (column j): w = scale * q.
 * scale * q is exact in fp32 (an fp16 scale times an integer under 2^8), so w is the value the
 * GGUF dequantizer gives, bit for bit; tiles of 4 and more rows also sum in packed_linear's
 * order, so they give its results on the dequantized weights exactly (see tile_q).
 * Each row tile dequantizes the panel's weights in registers again (up to TILE_ROWS rows
 * share them); row blocks of many tiles dequantize each panel once into a buffer.
 */
#define QBLOCK 32
#define Q4_1_RECORD 768
#define Q8_0_RECORD 1152
/* A weight's format; decode_step's linear layers name theirs by it (bf16: packed_linear_bf16). */
enum { FORMAT_F32 = 0, FORMAT_Q4_1 = 1, FORMAT_Q8_0 = 2, FORMAT_BF16 = 3 };

typedef int32_t i32x16 __attribute__((vector_size(64)));

/* 16 bytes widened to 16 int32 lanes, zero- or sign-extended (GCC leaves a generic
 * conversion of byte vectors to scalar code). */
#if defined(__AVX512F__)
static inline i32x16 widen_u8(const uint8_t *p) {
    return (i32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline i32x16 widen_i8(const uint8_t *p) {
    return (i32x16)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
#elif defined(__AVX2__)
static inline i32x16 widen_u8(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i h[2] = {_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))};
    i32x16 v;
    memcpy(&v, h, sizeof(v));
    return v;
}
static inline i32x16 widen_i8(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i h[2] = {_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))};
    i32x16 v;
    memcpy(&v, h, sizeof(v));
    return v;
}
#else
static inline i32x16 widen_u8(const uint8_t *p) {
    i32x16 v;
    for (int i = 0; i < 16; i++) v[i] = p[i];
    return v;
}
static inline i32x16 widen_i8(const uint8_t *p) {
    i32x16 v;
    for (int i = 0; i < 16; i++) v[i] = (int8_t)p[i];
    return v;
}
#endif
typedef float vec16u __attribute__((vector_size(64), aligned(4)));

/* Keeps a dequantized weight vector as computed: -ffast-math would otherwise be free to
 * fold the scale into x (x * d * q), which is not exact. */
#if defined(__AVX512F__)
#define KEEP(v) __asm__("" : "+v"(v))
#elif defined(__AVX__)
#define KEEP(v)                                                                              \
    do {                                                                                     \
        vec8 h_[2];                                                                          \
        memcpy(h_, &(v), sizeof(h_));                                                        \
        __asm__("" : "+x"(h_[0]), "+x"(h_[1]));                                              \
        memcpy(&(v), h_, sizeof(h_));                                                        \
    } while (0)
#else
#define KEEP(v) __asm__("" : "+m"(v))
#endif

/* The 32 weights (columns 0-15, 16-31) of input i of a record. */
static inline __attribute__((always_inline)) void dequant(const uint8_t *rec, int format, int i,
                                                          vec16 *w0, vec16 *w1) {
    if (format == FORMAT_Q4_1) {
        const vec16 d0 = *(const vec16u *)rec, d1 = *(const vec16u *)(rec + 64);
        const vec16 m0 = *(const vec16u *)(rec + 128), m1 = *(const vec16u *)(rec + 192);
        const i32x16 v = widen_u8(rec + 256 + i * 16);
        vec16 a = __builtin_convertvector(v & 15, vec16) * d0 + m0;
        vec16 b = __builtin_convertvector(v >> 4, vec16) * d1 + m1;
        KEEP(a);
        KEEP(b);
        *w0 = a;
        *w1 = b;
    } else {
        const vec16 d0 = *(const vec16u *)rec, d1 = *(const vec16u *)(rec + 64);
        vec16 a = __builtin_convertvector(widen_i8(rec + 128 + i * 32), vec16) * d0;
        vec16 b = __builtin_convertvector(widen_i8(rec + 128 + i * 32 + 16), vec16) * d1;
        KEEP(a);
        KEEP(b);
        *w0 = a;
        *w1 = b;
    }
}

/*
 * A tile on quantized weights. With one or two rows the adds of a running sum, not memory,
 * bound it (each input waits for the last one's FMA), so those tiles keep `sets` partial sums
 * over interleaved inputs (input i into set i % sets) and add them at the end; wider tiles
 * sum in packed_linear's order.
 */
static inline __attribute__((always_inline)) void tile_q(const float *x, int64_t in,
                                                         const uint8_t *panel, int format,
                                                         const float *bias, float *y,
                                                         int64_t out, int64_t cols, int rows,
                                                         float *store) {
    const int64_t record = format == FORMAT_Q4_1 ? Q4_1_RECORD : Q8_0_RECORD;
    const int sets = rows == 1 ? 4 : rows == 2 ? 2 : 1;
    vec16 acc[4][TILE_ROWS][2];
    for (int s = 0; s < sets; s++)
        for (int r = 0; r < rows; r++) acc[s][r][0] = acc[s][r][1] = (vec16){0};
    const int64_t blocks = in / QBLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rec = panel + b * record;
        const float *xb = x + b * QBLOCK;
        for (int i0 = 0; i0 < QBLOCK; i0 += sets) {
            for (int s = 0; s < sets; s++) {
                const int i = i0 + s;
                vec16 w0, w1;
                dequant(rec, format, i, &w0, &w1);
                if (store != NULL) { /* the weights in fp32 panel layout, for later tiles */
                    *(vec16 *)(store + (b * QBLOCK + i) * PANEL) = w0;
                    *(vec16 *)(store + (b * QBLOCK + i) * PANEL + 16) = w1;
                }
                for (int r = 0; r < rows; r++) {
                    const float xi = xb[r * in + i];
                    acc[s][r][0] += xi * w0;
                    acc[s][r][1] += xi * w1;
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int s = 1; s < sets; s++) {
            acc[0][r][0] += acc[s][r][0];
            acc[0][r][1] += acc[s][r][1];
        }
        float sums[PANEL], *yr = y + r * out;
        memcpy(sums, acc[0][r], sizeof(sums));
        for (int64_t j = 0; j < cols; j++) yr[j] = bias != NULL ? sums[j] + bias[j] : sums[j];
    }
}

/*
 * With more than DEQUANT_TILES row tiles on a panel, the first one also stores the weights it
 * dequantizes in fp32 panel layout (a per-thread buffer) and the others run packed_linear's
 * tiles on that, which costs less than dequantizing per tile; the weights and the sums are
 * the same either way.
 */
#define DEQUANT_TILES 2

static pthread_key_t panel_buffer_key;
static pthread_once_t panel_buffer_once = PTHREAD_ONCE_INIT;
static __thread float *panel_buffer;
static __thread int64_t panel_buffer_floats;

static void make_panel_buffer_key(void) { pthread_key_create(&panel_buffer_key, free); }

/* This thread's buffer of at least `floats` floats (freed when the thread ends), or NULL. */
static float *thread_panel_buffer(int64_t floats) {
    if (panel_buffer_floats >= floats) return panel_buffer;
    pthread_once(&panel_buffer_once, make_panel_buffer_key);
    free(panel_buffer);
    panel_buffer = aligned_alloc(64, (size_t)floats * sizeof(float));
    panel_buffer_floats = panel_buffer != NULL ? floats : 0;
    pthread_setspecific(panel_buffer_key, panel_buffer);
    return panel_buffer;
}

struct qlinear_job {
    const float *x;
    const uint8_t *packed;
    const float *bias;
    float *y;
    int64_t m, in, out, panels, chunks, chunk_panels;
    int format;
};

/* Rows [r0, r1) (one row block) times panels [p0, p1), as linear_block; `format` is a
 * constant in each caller below, so tile_q's branches on it fold away. */
static inline __attribute__((always_inline)) void qlinear_block(const struct qlinear_job *j,
                                                                int64_t r0, int64_t r1,
                                                                int64_t p0, int64_t p1,
                                                                int format) {
    const int64_t in = j->in, out = j->out;
    const int64_t bytes = in / QBLOCK * (format == FORMAT_Q4_1 ? Q4_1_RECORD : Q8_0_RECORD);
    float *buf = r1 - r0 > DEQUANT_TILES * TILE_ROWS ? thread_panel_buffer(in * PANEL) : NULL;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *panel = j->packed + p * bytes;
        const int64_t c0 = p * PANEL, cols = out - c0 < PANEL ? out - c0 : PANEL;
        const float *b = j->bias != NULL ? j->bias + c0 : NULL;
        const float *x = j->x;
        float *yp = j->y + c0;
        int64_t r = r0;
        if (buf != NULL) {
            /* The first tile dequantizes into buf, the others run on it; the next panel's
             * blocks come in meanwhile. */
            tile_q(x + r * in, in, panel, format, b, yp + r * out, out, cols, TILE_ROWS, buf);
            r += TILE_ROWS;
            if (p + 1 < p1)
                for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(panel + bytes + o, 0, 3);
#define TILE(n)                                                                              \
    do {                                                                                     \
        tile(x + r * in, in, buf, b, yp + r * out, out, cols, n, NULL, 0);                   \
        r += n;                                                                              \
    } while (0)
            while (r + TILE_ROWS <= r1) TILE(TILE_ROWS);
            if (r + 4 <= r1) TILE(4);
            if (r + 2 <= r1) TILE(2);
            if (r < r1) TILE(1);
#undef TILE
            continue;
        }
#define TILE(n)                                                                              \
    do {                                                                                     \
        tile_q(x + r * in, in, panel, format, b, yp + r * out, out, cols, n, NULL);          \
        r += n;                                                                              \
    } while (0)
        while (r + TILE_ROWS <= r1) TILE(TILE_ROWS);
        if (r + 4 <= r1) TILE(4);
        if (r + 2 <= r1) TILE(2);
        if (r < r1) TILE(1);
#undef TILE
    }
}

static void q4_1_block(const struct qlinear_job *j, int64_t r0, int64_t r1, int64_t p0,
                       int64_t p1) {
    qlinear_block(j, r0, r1, p0, p1, FORMAT_Q4_1);
}

static void q8_0_block(const struct qlinear_job *j, int64_t r0, int64_t r1, int64_t p0,
                       int64_t p1) {
    qlinear_block(j, r0, r1, p0, p1, FORMAT_Q8_0);
}

static void qlinear_tasks(const void *ctx, int64_t begin, int64_t end) {
    const struct qlinear_job *j = ctx;
    for (int64_t t = begin; t < end; t++) {
        const int64_t r0 = t / j->chunks * ROW_BLOCK, p0 = t % j->chunks * j->chunk_panels;
        const int64_t r1 = r0 + ROW_BLOCK < j->m ? r0 + ROW_BLOCK : j->m;
        const int64_t p1 = p0 + j->chunk_panels < j->panels ? p0 + j->chunk_panels : j->panels;
        if (j->format == FORMAT_Q4_1)
            q4_1_block(j, r0, r1, p0, p1);
        else
            q8_0_block(j, r0, r1, p0, p1);
    }
}

/* The task split of packed_linear: chunks of panels per row block. */
static void split_panels(int64_t m, int64_t panels, int64_t *chunks, int64_t *chunk_panels) {
    const int64_t row_blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t wanted = TASKS_PER_THREAD * (int64_t)pool.threads;
    int64_t c = (wanted + row_blocks - 1) / row_blocks;
    c = c < panels ? c : panels;
    *chunk_panels = (panels + c - 1) / c;
    *chunks = (panels + *chunk_panels - 1) / *chunk_panels;
}

static void quantized_linear(const float *x, const uint8_t *packed, const float *bias, float *y,
                             int64_t m, int64_t in, int64_t out, int format) {
    const int64_t panels = (out + PANEL - 1) / PANEL;
    int64_t chunks, chunk_panels;
    split_panels(m, panels, &chunks, &chunk_panels);
    const struct qlinear_job job = {x, packed, bias, y, m, in, out, panels, chunks, chunk_panels,
                                    format};
    parallel_for(qlinear_tasks, &job, (m + ROW_BLOCK - 1) / ROW_BLOCK * chunks, 1);
}

/* y = x @ w^T + bias on Q4_1 / Q8_0 panels; `in` is a multiple of QBLOCK. */
void packed_linear_q4_1(const float *x, const uint8_t *packed, const float *bias, float *y,
                        int64_t m, int64_t in, int64_t out) {
    quantized_linear(x, packed, bias, y, m, in, out, FORMAT_Q4_1);
}

void packed_linear_q8_0(const float *x, const uint8_t *packed, const float *bias, float *y,
                        int64_t m, int64_t in, int64_t out) {
    quantized_linear(x, packed, bias, y, m, in, out, FORMAT_Q8_0);
}

/*
 * The per-row kernels below split their rows over the pool only when a grab gets at least
 * MIN_ROW_WORK floats of work: a decode step's few rows cost less than handing them over.
 */
#define MIN_ROW_WORK 16384

static int64_t row_grain(int64_t rows, int64_t floats_per_row) {
    return grain_for(rows, (MIN_ROW_WORK + floats_per_row - 1) / floats_per_row);
}

/* out[r] = x[r] / rms(x[r]) * weight, rms(v) = sqrt(mean(v^2) + eps). */
static void rms_norm_row(const float *x, const float *weight, float *out, int64_t hidden,
                         float eps) {
    float sum_sq = 0.0f;
    for (int64_t i = 0; i < hidden; i++) sum_sq += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
    for (int64_t i = 0; i < hidden; i++) out[i] = x[i] * inv * weight[i];
}

struct norm_job {
    float *x;
    const float *residual, *weight;
    float *out;
    int64_t hidden;
    float eps;
};

static void norm_rows(const void *ctx, int64_t begin, int64_t end) {
    const struct norm_job *j = ctx;
    const int64_t hidden = j->hidden;
    for (int64_t r = begin; r < end; r++) {
        float *xr = j->x + r * hidden;
        if (j->residual != NULL) {
            const float *res = j->residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++) xr[i] += res[i];
        }
        rms_norm_row(xr, j->weight, j->out + r * hidden, hidden, j->eps);
    }
}

/*
 * For each of `rows` rows of `hidden`: x += residual (when residual is not NULL), then
 * out = rms_norm(x) * weight. x ends up holding the new residual stream.
 */
void add_rms_norm(float *x, const float *residual, const float *weight, float *out, int64_t rows,
                  int64_t hidden, float eps) {
    const struct norm_job job = {x, residual, weight, out, hidden, eps};
    parallel_for(norm_rows, &job, rows, row_grain(rows, 3 * hidden));
}

struct silu_job {
    const float *gate_up;
    float *out;
    int64_t inter;
};

static void silu_rows(const void *ctx, int64_t begin, int64_t end) {
    const struct silu_job *j = ctx;
    for (int64_t r = begin; r < end; r++) {
        const float *gate = j->gate_up + r * 2 * j->inter;
        const float *up = gate + j->inter;
        float *o = j->out + r * j->inter;
        for (int64_t i = 0; i < j->inter; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:], silu(g) = g / (1 + exp(-g)). */
void silu_and_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
    const struct silu_job job = {gate_up, out, inter};
    parallel_for(silu_rows, &job, rows, row_grain(rows, 3 * inter));
}

struct rotary_job {
    float *x;
    const float *cos, *sin;
    int64_t heads, row_stride, d;
};

static void rotary_rows(const void *ctx, int64_t begin, int64_t end) {
    const struct rotary_job *j = ctx;
    const int64_t half = j->d / 2;
    for (int64_t r = begin; r < end; r++) {
        const float *c = j->cos + r * half;
        const float *s = j->sin + r * half;
        for (int64_t h = 0; h < j->heads; h++) {
            float *x1 = j->x + r * j->row_stride + h * j->d;
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
 * Rotates the first `heads` heads of each row in place (rotate-half pairs: element i with
 * element i + d/2) by that row's cos/sin tables, which hold d/2 values each.
 */
void rotary_in_place(float *x, const float *cos, const float *sin, int64_t rows, int64_t heads,
                     int64_t row_stride, int64_t d) {
    const struct rotary_job job = {x, cos, sin, heads, row_stride, d};
    parallel_for(rotary_rows, &job, rows, row_grain(rows, heads * d + d));
}

/*
 * A KV cache holds fp32 elements or, with `bf16` set, bf16 ones: the upper half of an fp32,
 * rounded to nearest even on the way in, as torch's .to(torch.bfloat16) rounds (NaN stays a
 * NaN). Reading one back is exact: its 16 bits shifted up.
 */
static inline uint16_t bf16_of(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float float_of_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

/* The address of element `i` of a cache of fp32 or bf16 elements. */
static inline const void *kv_at(const void *cache, int64_t i, int bf16) {
    return (const char *)cache + i * (bf16 ? 2 : 4);
}

struct kv_job {
    const float *k, *v;
    int64_t k_stride, v_stride;
    void *k_cache, *v_cache;
    const int64_t *slots;
    int64_t kv_heads, d, cache_slots;
    int bf16;
};

static void kv_rows(const void *ctx, int64_t begin, int64_t end) {
    const struct kv_job *j = ctx;
    const int64_t d = j->d;
    for (int64_t r = begin; r < end; r++) {
        for (int64_t h = 0; h < j->kv_heads; h++) {
            const int64_t dst = (h * j->cache_slots + j->slots[r]) * d;
            const float *k = j->k + r * j->k_stride + h * d, *v = j->v + r * j->v_stride + h * d;
            if (j->bf16) {
                uint16_t *kc = (uint16_t *)j->k_cache + dst, *vc = (uint16_t *)j->v_cache + dst;
                for (int64_t i = 0; i < d; i++) {
                    kc[i] = bf16_of(k[i]);
                    vc[i] = bf16_of(v[i]);
                }
            } else {
                memcpy((float *)j->k_cache + dst, k, sizeof(float) * (size_t)d);
                memcpy((float *)j->v_cache + dst, v, sizeof(float) * (size_t)d);
            }
        }
    }
}

/*
 * Stores each row's keys and values (rows of `kv_heads` heads at row strides `k_stride`,
 * `v_stride`) into the caches [kv_heads, cache_slots, d] (fp32, or bf16 when `bf16`) at that
 * row's flat slot.
 */
void write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
              void *k_cache, void *v_cache, const int64_t *slots, int64_t rows,
              int64_t kv_heads, int64_t d, int64_t cache_slots, int64_t bf16) {
    const struct kv_job job = {k, v, k_stride, v_stride, k_cache, v_cache, slots, kv_heads, d,
                               cache_slots, bf16 != 0};
    parallel_for(kv_rows, &job, rows, row_grain(rows, 4 * kv_heads * d));
}

/*
 * One new token per sequence attending over its paged cache.
 *
 * q:            [n, heads, d] at row stride q_stride (floats)
 * k/v cache:    [kv_heads, num_blocks, block_size, d], fp32 or (bf16 set) bf16 elements
 * block_tables: [n, max_blocks]; context_lens: [n], the new token's own key included
 * out:          [n, heads, d] contiguous
 *
 * Query heads h * group .. h * group + group - 1 share KV head h, so each key and value is
 * read once for its whole group. A sequence sees its last `window` keys when window > 0;
 * softcap > 0 squashes scores to softcap * tanh(score / softcap) (Gemma).
 */
/*
 * Attention's vectors: AW floats, one register of the CPU (64 bytes with AVX-512, 32 bytes
 * with AVX/AVX2 only, where GCC lowers 64-byte arithmetic through the stack, see tile8).
 * attn_vecu: such vectors at any float boundary, as query rows inside the fused qkv output.
 */
#if !defined(__AVX512F__) && defined(__AVX__)
#define AW 8
typedef vec8 attn_vec;
typedef float attn_vecu __attribute__((vector_size(32), aligned(4)));

static inline float lane_sum(attn_vec v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}
#else
#define AW 16
typedef vec16 attn_vec;
typedef vec16u attn_vecu;

static inline float lane_sum(attn_vec v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}
#endif

/* AW cache elements from element i of p (fp32, or bf16 widened to fp32). */
static inline __attribute__((always_inline)) attn_vec kv_vec(const void *p, int64_t i, int bf16) {
    if (!bf16) return *(const attn_vecu *)((const float *)p + i);
    const uint16_t *h = (const uint16_t *)p + i;
#if defined(__AVX512F__)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h));
    return (attn_vec)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#elif defined(__AVX2__)
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h));
    return (attn_vec)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#else
    attn_vec v;
    for (int l = 0; l < AW; l++) v[l] = float_of_bf16(h[l]);
    return v;
#endif
}

/*
 * Asks for 64-byte lines first .. first + count - 1 (below end) of p into L2. A fetch into L2
 * (locality 1) does not hold one of L1's few miss buffers while it waits on memory, so many
 * more lines are in flight at once: 1.4-1.6x the bandwidth of an L1 fetch on long contexts.
 */
static inline void prefetch_lines(const void *p, int64_t first, int64_t count, int64_t end) {
    for (int64_t l = first; l < first + count && l < end; l++)
        __builtin_prefetch((const char *)p + 64 * l, 0, 1);
}

/*
 * Query row qg's scores against the n keys at k (rows of d floats): n sums side by side, so
 * the multiply-adds of different keys overlap instead of each waiting on the one before.
 */
#define KEYS_AT_ONCE 4

static inline __attribute__((always_inline)) void key_scores(const float *qg, const void *k,
                                                             int64_t d, int vecs, int n, int bf16,
                                                             float scale, float softcap,
                                                             float *out) {
    attn_vec sum[KEYS_AT_ONCE];
    for (int i = 0; i < n; i++) sum[i] = *(const attn_vecu *)qg * kv_vec(k, i * d, bf16);
    for (int v = 1; v < vecs; v++) {
        const attn_vec q = *(const attn_vecu *)(qg + AW * v);
        for (int i = 0; i < n; i++) sum[i] += q * kv_vec(k, i * d + AW * v, bf16);
    }
    for (int i = 0; i < n; i++) {
        float dot = lane_sum(sum[i]) * scale;
        if (softcap > 0.0f) dot = softcap * tanhf(dot / softcap);
        out[i] = dot;
    }
}

/*
 * o[0 .. n vectors) += p[t] * val_t[0 .. n vectors) for t < keys (rows of d floats), in order
 * of t, the sums held in registers across the keys rather than stored after each.
 */
#define VALUE_VECS 4

static inline __attribute__((always_inline)) void add_values(const float *p, const void *val,
                                                             int64_t keys, int64_t d, int n,
                                                             int bf16, float *o) {
    attn_vec acc[VALUE_VECS];
    for (int i = 0; i < n; i++) acc[i] = *(const attn_vecu *)(o + AW * i);
    for (int64_t t = 0; t < keys; t++) {
        const float pt = p[t];
        for (int i = 0; i < n; i++) acc[i] += pt * kv_vec(val, t * d + AW * i, bf16);
    }
    for (int i = 0; i < n; i++) *(attn_vecu *)(o + AW * i) = acc[i];
}

/*
 * One KV head of one sequence: its `group` query heads (qh, contiguous) over keys first..ctx-1,
 * writing [group, d] to out. One pass, block by block through the sequence's table: a block's
 * scores, then its values weighted by them, with the softmax kept online (each head's running
 * max `top` and sum `total`; earlier sums are rescaled when the max grows). Reading a block's
 * keys and values back to back keeps both in flight from memory together. `vecs` is d / AW; the
 * callers pass it as a constant so the loops over a row unroll. scores holds group x block_size.
 * The last block fetches the first `after_lines` lines of after_k / after_v, the next head's
 * first block (NULL for none).
 */
static inline __attribute__((always_inline)) void attend_kv_head(
    const float *qh, const void *kh, const void *vh, const int64_t *table, int64_t first,
    int64_t ctx, int64_t block_size, int64_t group, int vecs, int bf16, float scale,
    float softcap, const void *after_k, const void *after_v, int64_t after_lines, float *scores,
    float *top, float *total, float *out) {
    const int64_t d = (int64_t)vecs * AW;
    for (int64_t g = 0; g < group; g++) {
        total[g] = 0.0f;
        for (int v = 0; v < vecs; v++) *(attn_vecu *)(out + g * d + AW * v) = (attn_vec){0};
    }
    for (int64_t j = first; j < ctx;) {
        const int64_t offset = j % block_size;
        const int64_t keys = (ctx < j - offset + block_size ? ctx : j - offset + block_size) - j;
        const int64_t row = (table[j / block_size] * block_size + offset) * d;
        const void *k = kv_at(kh, row, bf16), *val = kv_at(vh, row, bf16);
        /* Blocks lie anywhere in the cache, and the hardware does not stream from one block
         * into another: each key scored here fetches a share of the next block's lines. */
        const void *next_k = after_k, *next_v = after_v;
        int64_t lines = after_lines;
        if (j + keys < ctx) {
            const int64_t next_row = table[j / block_size + 1] * block_size * d;
            next_k = kv_at(kh, next_row, bf16);
            next_v = kv_at(vh, next_row, bf16);
            lines = block_size * d * (bf16 ? 2 : 4) / 64;
        }
        const int64_t share = (lines + keys - 1) / keys;
        for (int64_t t = 0; t < keys;) {  /* scores[g][t] = q_g . k_t */
            const int n = keys - t >= KEYS_AT_ONCE ? KEYS_AT_ONCE : 1;
            if (next_k != NULL) {
                prefetch_lines(next_k, t * share, n * share, lines);
                prefetch_lines(next_v, t * share, n * share, lines);
            }
            for (int64_t g = 0; g < group; g++) {
                float *out_scores = scores + g * block_size + t;
                if (n == KEYS_AT_ONCE)
                    key_scores(qh + g * d, k, d, vecs, KEYS_AT_ONCE, bf16, scale, softcap,
                               out_scores);
                else
                    key_scores(qh + g * d, k, d, vecs, 1, bf16, scale, softcap, out_scores);
            }
            t += n;
            k = kv_at(k, n * d, bf16);
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
                for (int v = 0; v < vecs; v++) *(attn_vecu *)(out + g * d + AW * v) *= shrink;
            }
            total[g] += sum;
            top[g] = m;
        }
        for (int64_t g = 0; g < group; g++) {  /* out[g] += p[g][t] v_t */
            const float *p = scores + g * block_size;
            float *o = out + g * d;
            int v = 0;
            for (; v + VALUE_VECS <= vecs; v += VALUE_VECS)
                add_values(p, kv_at(val, AW * v, bf16), keys, d, VALUE_VECS, bf16, o + AW * v);
            for (; v < vecs; v++) add_values(p, kv_at(val, AW * v, bf16), keys, d, 1, bf16, o + AW * v);
        }
        j += keys;
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.0f / total[g];
        for (int v = 0; v < vecs; v++) *(attn_vecu *)(out + g * d + AW * v) *= inv;
    }
}

/* The same for any head size: plain loops over d. */
/* Element i of a cache of fp32 or bf16 elements. */
static inline float kv_get(const void *cache, int64_t i, int bf16) {
    return bf16 ? float_of_bf16(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}

static void attend_kv_head_any(const float *qh, const void *kh, const void *vh,
                               const int64_t *table, int64_t first, int64_t ctx,
                               int64_t block_size, int64_t group, int64_t d, int bf16,
                               float scale, float softcap, float *scores, float *out) {
    const int64_t len = ctx - first;
    for (int64_t j = first; j < ctx; j++) {
        const int64_t k = (table[j / block_size] * block_size + j % block_size) * d;
        for (int64_t g = 0; g < group; g++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < d; i++) dot += qh[g * d + i] * kv_get(kh, k + i, bf16);
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
        const int64_t val = (table[j / block_size] * block_size + j % block_size) * d;
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < d; i++)
                out[g * d + i] += scores[g * len + (j - first)] * kv_get(vh, val + i, bf16);
    }
}

/* A sequence's first key in attention: all of them, or the last `window` (0 for none). */
static inline int64_t first_key(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

struct attention_job {
    const float *q;
    const void *k_cache, *v_cache;
    const int64_t *block_tables, *context_lens;
    float *out;
    int64_t q_stride, n, heads, kv_heads, d, block_size, max_blocks, head_stride, score_len;
    float scale, softcap;
    int64_t window;
    int bf16;
};

/* One (sequence, KV head) pair; bf16 is a constant in each caller. */
static inline __attribute__((always_inline)) void attend_pair(const struct attention_job *j,
                                                              int64_t t, int64_t end, int bf16,
                                                              float *scores) {
    const int64_t kv_heads = j->kv_heads, d = j->d, block_size = j->block_size;
    const int64_t group = j->heads / kv_heads;
    float *top = scores + group * j->score_len, *total = top + group;
    const int64_t b = t / kv_heads, h = t % kv_heads;
    const int64_t ctx_len = j->context_lens[b];
    const int64_t first = first_key(ctx_len, j->window);
    const int64_t *table = j->block_tables + b * j->max_blocks;
    const float *qh = j->q + b * j->q_stride + h * group * d;
    const void *kh = kv_at(j->k_cache, h * j->head_stride, bf16);
    const void *vh = kv_at(j->v_cache, h * j->head_stride, bf16);
    float *o = j->out + (b * j->heads + h * group) * d;
    /* The (sequence, KV head) this thread takes next, whose first block this one's last
     * block fetches: no hardware stream carries over from one to the next. */
    const void *after_k = NULL, *after_v = NULL;
    int64_t after_lines = 0;
    if (t + 1 < end) {
        const int64_t nb = (t + 1) / kv_heads, nh = (t + 1) % kv_heads;
        const int64_t nctx = j->context_lens[nb], nfirst = first_key(nctx, j->window);
        const int64_t skip = nfirst % block_size;
        const int64_t keys = nctx - nfirst < block_size - skip ? nctx - nfirst
                                                               : block_size - skip;
        const int64_t row = (j->block_tables[nb * j->max_blocks + nfirst / block_size] *
                             block_size + skip) * d + nh * j->head_stride;
        after_k = kv_at(j->k_cache, row, bf16);
        after_v = kv_at(j->v_cache, row, bf16);
        after_lines = keys * d * (bf16 ? 2 : 4) / 64;
    }
    /* Head sizes of whole vectors take the vector kernel, the common ones with a
     * constant size. */
    if (d == 64)
        attend_kv_head(qh, kh, vh, table, first, ctx_len, block_size, group, 64 / AW, bf16,
                       j->scale, j->softcap, after_k, after_v, after_lines, scores, top, total,
                       o);
    else if (d == 128)
        attend_kv_head(qh, kh, vh, table, first, ctx_len, block_size, group, 128 / AW, bf16,
                       j->scale, j->softcap, after_k, after_v, after_lines, scores, top, total,
                       o);
    else if (d % 16 == 0)
        attend_kv_head(qh, kh, vh, table, first, ctx_len, block_size, group, (int)(d / AW),
                       bf16, j->scale, j->softcap, after_k, after_v, after_lines, scores, top,
                       total, o);
    else
        attend_kv_head_any(qh, kh, vh, table, first, ctx_len, block_size, group, d, bf16,
                           j->scale, j->softcap, scores, o);
}

/* Task t: sequence t / kv_heads, KV head t % kv_heads. */
static void attention_pairs(const void *ctx, int64_t begin, int64_t end) {
    const struct attention_job *j = ctx;
    const int64_t group = j->heads / j->kv_heads;
    float *scores = malloc(sizeof(float) * (size_t)(group * (j->score_len + 2)));
    if (scores == NULL) abort();
    for (int64_t t = begin; t < end; t++) {
        if (j->bf16)
            attend_pair(j, t, end, 1, scores);
        else
            attend_pair(j, t, end, 0, scores);
    }
    free(scores);
}

/* Threads split the (sequence, KV head) pairs; each pair is computed as on one thread. */
void paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache,
                            const void *v_cache, const int64_t *block_tables,
                            const int64_t *context_lens, float *out, int64_t n, int64_t heads,
                            int64_t kv_heads, int64_t d, int64_t num_blocks, int64_t block_size,
                            int64_t max_blocks, float scale, int64_t window, float softcap,
                            int64_t bf16) {
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < n; b++)
        if (context_lens[b] > max_ctx) max_ctx = context_lens[b];
    /* The one-pass kernel needs group x block_size scores, the any-size one group x max_ctx. */
    const int64_t score_len = max_ctx > block_size ? max_ctx : block_size;
    const struct attention_job job = {
        q, k_cache, v_cache, block_tables, context_lens, out, q_stride, n, heads, kv_heads, d,
        block_size, max_blocks, num_blocks * block_size * d /* one KV head's whole cache */,
        score_len, scale, softcap, window, bf16 != 0};
    parallel_for(attention_pairs, &job, n * kv_heads, grain_for(n * kv_heads, 1));
}

/*
 * out[r] = the first column of row r holding the row's largest value (torch.argmax over finite
 * values). Greedy decoding takes it over the vocabulary for every row, where torch's argmax
 * runs at a few GB/s. One vector pass finds the maximum, a second stops at its first
 * occurrence. Built with -ffast-math, so NaN is not looked for: the model runner fails rows
 * whose hidden state holds NaN.
 */
struct argmax_job {
    const float *x;
    int64_t cols;
    int64_t *out;
};

static void argmax_tasks(const void *ctx, int64_t begin, int64_t end) {
    const struct argmax_job *j = ctx;
    const float *x = j->x;
    const int64_t cols = j->cols;
    int64_t *out = j->out;
    for (int64_t r = begin; r < end; r++) {
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

void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out) {
    const struct argmax_job job = {x, cols, out};
    parallel_for(argmax_tasks, &job, rows, row_grain(rows, cols));
}

/*
 * A Llama-family decode step in one call: every row is one sequence's next token.
 *
 * It calls the kernels above in the order the model's modules call them (models/llama.py,
 * backends/cpu_ops.py), on the same inputs, so each row's hidden state and logits are the
 * same bits as the module path's; what it saves is the Python between them (about 400 kernel
 * calls a step for a 30-layer model), and in a served replica the GIL: the whole step runs
 * without it, so the replica's event loop never holds up a kernel call's return.
 *
 * The residual stream stays in `residual`: the module path adds a layer's output into it
 * (x += residual, then residual = x), this adds it the other way (residual += x), which is
 * the same float sum. Buffers are the model's workspace for at least `rows` rows
 * (backends/cpu_decode.py sizes them).
 */
struct step_linear {
    const void *packed;
    const float *bias; /* or NULL */
    int64_t in, out, format;
};

struct step_layer {
    const float *input_norm, *post_norm;
    struct step_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [kv_heads, num_blocks, block_size, d], fp32 or bf16 */
    int64_t window;           /* 0: every key */
    double softcap;           /* 0: none */
};

struct step_model {
    int64_t num_layers, vocab, hidden, heads, kv_heads, head_dim, inter;
    int64_t num_blocks, block_size, rope_positions, kv_bf16;
    double eps, scale;
    const float *embed;               /* [vocab, hidden] */
    const float *rope_cos, *rope_sin; /* [rope_positions, head_dim / 2] */
    const float *final_norm;
    struct step_linear head;
    const struct step_layer *layers;
    /* workspace, [capacity, width] each */
    float *residual, *normed, *qkv, *attn, *mlp, *act, *out, *cos, *sin;
};

static int64_t step_linear(const struct step_linear *l, const float *x, float *y, int64_t rows) {
    switch (l->format) {
    case FORMAT_F32:
        packed_linear(x, l->packed, l->bias, y, rows, l->in, l->out);
        return 0;
    case FORMAT_BF16:
        return packed_linear_bf16(x, l->packed, l->bias, y, rows, l->in, l->out);
    case FORMAT_Q4_1:
        packed_linear_q4_1(x, l->packed, l->bias, y, rows, l->in, l->out);
        return 0;
    case FORMAT_Q8_0:
        packed_linear_q8_0(x, l->packed, l->bias, y, rows, l->in, l->out);
        return 0;
    }
    return -2;
}

/*
 * ids, positions, slots, lens: [rows]; tables: [rows, table_width] block ids. Writes the
 * final norm's output to hidden [rows, hidden] and the logits to logits [rows, head.out].
 * Returns 0, -1 when a bf16 layer found no memory, -2 for an unknown weight format, -3 for a
 * position past the rotary table, -4 for a token id past the embedding (nothing computed for
 * the last two).
 */
int64_t decode_step(const struct step_model *m, int64_t rows, const int64_t *ids,
                    const int64_t *positions, const int64_t *slots, const int64_t *tables,
                    int64_t table_width, const int64_t *lens, float *hidden, float *logits) {
    const int64_t h = m->hidden, d = m->head_dim, half = m->head_dim / 2;
    const int64_t qkv_width = (m->heads + 2 * m->kv_heads) * d;
    for (int64_t r = 0; r < rows; r++) {
        if (positions[r] < 0 || positions[r] >= m->rope_positions) return -3;
        if (ids[r] < 0 || ids[r] >= m->vocab) return -4;
    }
    for (int64_t r = 0; r < rows; r++) {
        memcpy(m->residual + r * h, m->embed + ids[r] * h, sizeof(float) * (size_t)h);
        memcpy(m->cos + r * half, m->rope_cos + positions[r] * half, sizeof(float) * (size_t)half);
        memcpy(m->sin + r * half, m->rope_sin + positions[r] * half, sizeof(float) * (size_t)half);
    }
    const float eps = (float)m->eps;
    int64_t status = 0;
    for (int64_t i = 0; i < m->num_layers && status == 0; i++) {
        const struct step_layer *l = &m->layers[i];
        add_rms_norm(m->residual, i ? m->out : NULL, l->input_norm, m->normed, rows, h, eps);
        if ((status = step_linear(&l->qkv, m->normed, m->qkv, rows))) break;
        rotary_in_place(m->qkv, m->cos, m->sin, rows, m->heads + m->kv_heads, qkv_width, d);
        const float *k = m->qkv + m->heads * d, *v = k + m->kv_heads * d;
        write_kv(k, qkv_width, v, qkv_width, l->k_cache, l->v_cache, slots, rows, m->kv_heads, d,
                 m->num_blocks * m->block_size, m->kv_bf16);
        paged_decode_attention(m->qkv, qkv_width, l->k_cache, l->v_cache, tables, lens, m->attn,
                               rows, m->heads, m->kv_heads, d, m->num_blocks, m->block_size,
                               table_width, (float)m->scale, l->window, (float)l->softcap,
                               m->kv_bf16);
        if ((status = step_linear(&l->o, m->attn, m->out, rows))) break;
        add_rms_norm(m->residual, m->out, l->post_norm, m->normed, rows, h, eps);
        if ((status = step_linear(&l->gate_up, m->normed, m->mlp, rows))) break;
        silu_and_mul(m->mlp, m->act, rows, m->inter);
        status = step_linear(&l->down, m->act, m->out, rows);
    }
    if (status) return status;
    add_rms_norm(m->residual, m->num_layers ? m->out : NULL, m->final_norm, hidden, rows, h, eps);
    return step_linear(&m->head, hidden, logits, rows);
}
