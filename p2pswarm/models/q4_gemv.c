/* 4-bit matrix-vector product on fbgemm's embedding_bag_4bit rows (p2pswarm/models/quant.py).
 *
 * The weight's transpose is cut into rows of G outputs for one input: row (j, k) holds G/2
 * bytes of codes (output j*G + 2t in the low nibble of byte t, 2t + 1 in the high one), then
 * a float16 scale s and a float16 offset b. So
 *     y[j*G + i] = sum_k x[k] * (s * c[i] + b) = sum_k (x[k] * s) * c[i] + sum_k x[k] * b:
 * per (j, k) one multiply-add of G codes by x[k] * s, and one scalar sum per group added to
 * all of its outputs at the end. Decode reads each byte once: 0.5 + 4/G bytes a weight.
 *
 * Portable C that gcc -O3 vectorises (NEON on aarch64), and an AVX2 path for x86-64 (where
 * gcc 12 widens byte vectors to floats one element at a time: 3.5x slower), chosen by what
 * -march=native enables; -DQ4_PORTABLE forces the portable one. Every row of activations
 * takes the same operations whatever the batch, so a session's numbers do not depend on who
 * shares its batch; a group is computed by one thread whatever the thread count, so they do
 * not depend on that either.
 *
 * Threads: a small pool of pthreads that sleep on a condition variable between calls (never
 * spin). The caller works too, taking chunks of groups from a shared counter; a helper the
 * scheduler has not woken yet simply finds nothing left, so a loaded machine costs no wait.
 */

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define Q4_ABI_VERSION 1
#define Q4_MAX_ROWS 8
#define Q4_MAX_GROUP 64
#define Q4_MAX_THREADS 64

#if defined(__GNUC__)
#define Q4_INLINE static inline __attribute__((always_inline))
#else
#define Q4_INLINE static inline
#endif

int q4_abi_version(void) { return Q4_ABI_VERSION; }

Q4_INLINE float half_to_float(const uint8_t *p) {
#if defined(__FLT16_MAX__) && !defined(Q4_PORTABLE_HALF)
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
#else
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8); /* little-endian, as fbgemm writes */
    uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (exponent == 0) {
        f = (float)mantissa * (1.0f / 16777216.0f); /* subnormal: mantissa * 2^-24 */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(Q4_PORTABLE)
#include <immintrin.h>
#define Q4_PATH "avx2"

/* One group of G outputs for one row of x: 8 codes widened to 32 bits at a time, the low
 * and high nibbles converted and multiplied-added (gcc does not vectorise the portable loop
 * below this well: byte vectors widened to floats come out scalar). */
Q4_INLINE void q4_group_row(const uint8_t *row, int64_t in, const float *x, float *out,
                            const int G) {
    const int V = G / 32;
    const int64_t stride = G / 2 + 4;
    __m256 acc[Q4_MAX_GROUP / 16][2];
    for (int v = 0; v < 2 * V; v++)
        acc[v][0] = acc[v][1] = _mm256_setzero_ps();
    __m128 offsets = _mm_setzero_ps();
    const __m256i mask = _mm256_set1_epi32(15);
    for (int64_t k = 0; k < in; k++, row += stride) {
        int32_t scale_offset;
        memcpy(&scale_offset, row + G / 2, sizeof scale_offset);
        /* lanes 0 and 1: x[k] * scale, x[k] * offset */
        const __m128 products = _mm_mul_ps(_mm_set1_ps(x[k]),
                                           _mm_cvtph_ps(_mm_cvtsi32_si128(scale_offset)));
        offsets = _mm_add_ps(offsets, products);
        const __m256 xs = _mm256_broadcastss_ps(products);
        for (int v = 0; v < V; v++) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + 16 * v));
            const __m256i w0 = _mm256_cvtepu8_epi32(bytes);
            const __m256i w1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
            acc[2 * v][0] = _mm256_fmadd_ps(
                xs, _mm256_cvtepi32_ps(_mm256_and_si256(w0, mask)), acc[2 * v][0]);
            acc[2 * v][1] = _mm256_fmadd_ps(
                xs, _mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4)), acc[2 * v][1]);
            acc[2 * v + 1][0] = _mm256_fmadd_ps(
                xs, _mm256_cvtepi32_ps(_mm256_and_si256(w1, mask)), acc[2 * v + 1][0]);
            acc[2 * v + 1][1] = _mm256_fmadd_ps(
                xs, _mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4)), acc[2 * v + 1][1]);
        }
    }
    const float offset = _mm_cvtss_f32(_mm_shuffle_ps(offsets, offsets, 1));
    for (int v = 0; v < 2 * V; v++) {
        float lo[8], hi[8];
        _mm256_storeu_ps(lo, acc[v][0]);
        _mm256_storeu_ps(hi, acc[v][1]);
        for (int t = 0; t < 8; t++) {
            out[16 * v + 2 * t] = lo[t] + offset;
            out[16 * v + 2 * t + 1] = hi[t] + offset;
        }
    }
}

#else
#define Q4_PATH "portable"

/* One group of G outputs for one row of x, in plain C for the auto-vectoriser (NEON on
 * aarch64): the codes widened into a float array, then one multiply-add loop per nibble. */
Q4_INLINE void q4_group_row(const uint8_t *row, int64_t in, const float *x, float *out,
                            const int G) {
    const int H = G / 2;
    const int64_t stride = H + 4;
    float lo[Q4_MAX_GROUP / 2], hi[Q4_MAX_GROUP / 2], offset = 0.0f;
    for (int t = 0; t < H; t++)
        lo[t] = hi[t] = 0.0f;
    for (int64_t k = 0; k < in; k++, row += stride) {
        const float xk = x[k], xs = xk * half_to_float(row + H);
        offset += xk * half_to_float(row + H + 2);
        float clo[Q4_MAX_GROUP / 2], chi[Q4_MAX_GROUP / 2];
        for (int t = 0; t < H; t++) {
            clo[t] = (float)(row[t] & 15);
            chi[t] = (float)(row[t] >> 4);
        }
        for (int t = 0; t < H; t++) {
            lo[t] += xs * clo[t];
            hi[t] += xs * chi[t];
        }
    }
    for (int t = 0; t < H; t++) {
        out[2 * t] = lo[t] + offset;
        out[2 * t + 1] = hi[t] + offset;
    }
}
#endif

const char *q4_path(void) { return Q4_PATH; }

typedef struct {
    const uint8_t *packed;
    int64_t groups, in, rows;
    const float *x;
    float *y;
    int group_size;
    int64_t chunk; /* groups per claim */
} q4_job;

/* Groups [j0, j1), every row of x: a group's packed bytes are read once from memory and
 * again from cache for the further rows, and each row takes the same operations whatever
 * the batch. */
static void q4_run(const q4_job *job, int64_t j0, int64_t j1) {
    const int G = job->group_size;
    const int64_t y_stride = job->groups * G, group_bytes = job->in * (G / 2 + 4);
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *rows = job->packed + j * group_bytes;
        for (int64_t r = 0; r < job->rows; r++) {
            float *out = job->y + r * y_stride + j * G;
            if (G == 32)
                q4_group_row(rows, job->in, job->x + r * job->in, out, 32);
            else
                q4_group_row(rows, job->in, job->x + r * job->in, out, 64);
        }
    }
}

/* --- the pool ---------------------------------------------------------------------------- */

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_idle = PTHREAD_COND_INITIALIZER;
static int pool_size;          /* helpers started */
static uint64_t pool_round;    /* bumped per call that wants helpers */
static q4_job pool_job;
static int64_t pool_chunks;    /* chunks in this round's job */
static int64_t pool_next;      /* next chunk to claim (under pool_lock) */
static int64_t pool_done;      /* chunks finished */
static uint64_t helper_born[Q4_MAX_THREADS];

/* Claims the next chunk of round `round`; -1 when none is left (or the round is over). */
static int64_t q4_claim(uint64_t round) {
    int64_t chunk = -1;
    pthread_mutex_lock(&pool_lock);
    if (pool_round == round && pool_next < pool_chunks)
        chunk = pool_next++;
    pthread_mutex_unlock(&pool_lock);
    return chunk;
}

static void q4_work(const q4_job *job, uint64_t round) {
    int64_t chunk, finished = 0;
    while ((chunk = q4_claim(round)) >= 0) {
        int64_t j0 = chunk * job->chunk, j1 = j0 + job->chunk;
        q4_run(job, j0, j1 < job->groups ? j1 : job->groups);
        finished++;
    }
    pthread_mutex_lock(&pool_lock);
    pool_done += finished;
    pthread_cond_broadcast(&pool_idle);
    pthread_mutex_unlock(&pool_lock);
}

static void *q4_helper(void *arg) {
    uint64_t seen = helper_born[(intptr_t)arg];
    pthread_mutex_lock(&pool_lock);
    for (;;) {
        while (pool_round == seen)
            pthread_cond_wait(&pool_wake, &pool_lock);
        seen = pool_round;
        q4_job job = pool_job;
        pthread_mutex_unlock(&pool_lock);
        q4_work(&job, seen);
        pthread_mutex_lock(&pool_lock);
    }
    return NULL;
}

/* A child of fork() has no helpers, whatever its parent had. */
static void q4_after_fork_child(void) {
    pthread_mutex_init(&call_lock, NULL);
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_wake, NULL);
    pthread_cond_init(&pool_idle, NULL);
    pool_size = 0;
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void q4_register_fork(void) { pthread_atfork(NULL, NULL, q4_after_fork_child); }

static int q4_grow(int helpers) {
    pthread_once(&fork_once, q4_register_fork);
    while (pool_size < helpers) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        pthread_mutex_lock(&pool_lock);
        helper_born[pool_size] = pool_round;
        pthread_mutex_unlock(&pool_lock);
        int failed = pthread_create(&thread, &attr, q4_helper, (void *)(intptr_t)pool_size);
        pthread_attr_destroy(&attr);
        if (failed)
            break;
        pool_size++;
    }
    return pool_size;
}

/* y (rows x groups*group_size) = x (rows x in) times the packed weight (groups*in rows of
 * group_size/2 + 4 bytes). 0 on success, -1 for arguments it does not take (the caller
 * then uses another kernel). `threads` counts the caller; `min_chunk_bytes` is the least
 * packed bytes worth handing to another thread. */
int q4_gemv(const uint8_t *packed, int64_t groups, int64_t in, int32_t group_size,
            const float *x, int64_t rows, float *y, int32_t threads, int64_t min_chunk_bytes) {
    if ((group_size != 32 && group_size != 64) || rows < 1 || rows > Q4_MAX_ROWS || groups < 0
        || in < 0)
        return -1;
    if (groups == 0)
        return 0;
    if (in == 0) {
        memset(y, 0, (size_t)(rows * groups * group_size) * sizeof(float));
        return 0;
    }
    q4_job job = {packed, groups, in, rows, x, y, group_size, groups};
    const int64_t group_bytes = in * (group_size / 2 + 4);
    if (threads > Q4_MAX_THREADS)
        threads = Q4_MAX_THREADS;
    /* a few chunks per thread, so the one that is woken late takes fewer */
    int64_t chunk = groups / (4 * (int64_t)(threads > 1 ? threads : 1));
    const int64_t least = min_chunk_bytes / group_bytes + 1;
    if (chunk < least)
        chunk = least;
    if (threads <= 1 || chunk >= groups) {
        q4_run(&job, 0, groups);
        return 0;
    }
    job.chunk = chunk;
    pthread_mutex_lock(&call_lock);
    if (q4_grow(threads - 1) == 0) {
        pthread_mutex_unlock(&call_lock);
        q4_run(&job, 0, groups);
        return 0;
    }
    pthread_mutex_lock(&pool_lock);
    uint64_t round = ++pool_round;
    pool_job = job;
    pool_chunks = (groups + chunk - 1) / chunk;
    pool_next = 0;
    pool_done = 0;
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_lock);
    q4_work(&job, round);
    pthread_mutex_lock(&pool_lock);
    /* every chunk done; a helper woken after this finds the round over and claims
     * nothing, so it never reads x or y once the caller has them back */
    while (pool_done < pool_chunks)
        pthread_cond_wait(&pool_idle, &pool_lock);
    pool_round++; /* ends the round: a helper that wakes late claims nothing */
    pthread_mutex_unlock(&pool_lock);
    pthread_mutex_unlock(&call_lock);
    return 0;
}
