/* CPU kernels of the fast decoder path (services/worker/fast_decoder.py), for float32 and
 * bfloat16 tensors. services/worker/kernels/__init__.py compiles this file on first use with
 * -O3 -fopenmp -ffp-contract=off and -march=native (or the x86-64 level that
 * ATEN_CPU_CAPABILITY caps it to) and loads it with ctypes. Only the matmuls and the bfloat16
 * prompt attention name an instruction set (amx_linear.inc, bf16_dot_linear.inc,
 * f32_linear.inc, attention_dot.inc; each built where its own is targeted) and the rounding
 * of vectors to bfloat16 (storew_bf16): the other loops are written over vectors of the
 * widest width the build holds (vecw), or left to the compiler to vectorize.
 *
 * The element-wise kernels round where transformers' modeling code rounds (every bfloat16
 * op computes in float32 and rounds its result), with no fused multiply-adds
 * (-ffp-contract=off), so their outputs equal the eager ops'. The attention kernel
 * accumulates in float32 in its own order, as any attention kernel does.
 *
 * The KV cache: the worker allocates each layer's keys and values as [num_slots, num_kv_heads,
 * head_dim] (slot = block * block_size + offset); the fast decoder, its only reader and
 * writer, lays a block out head-major instead, keys transposed so that KEY_TILE consecutive
 * keys of one dimension are contiguous:
 *
 *     k_cache: [num_blocks, num_kv_heads, head_dim, block_size]   (key j, dim d: [..., d, j])
 *     v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
 *
 * OpenMP: libgomp.so.1 is already loaded by torch when this library is, so these parallel
 * regions use torch's own thread team (a second team would fight it for the cores). */

#include <math.h>
/* the AMX matmul (amx_linear.inc): its tiles, and AVX512-BF16 for its rounding */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAS_AMX_LINEAR 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
/* the AVX512 bfloat16 matmul (bf16_dot_linear.inc) where AMX is not built: its widened FMAs on
 * AVX512F and BW, its dot products too where AVX512-BF16 is built */
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(HAS_AMX_LINEAR)
#define HAS_BF16_DOT_LINEAR 1
#if defined(__AVX512BF16__)
#define HAS_BF16_DOT_PRODUCTS 1
#endif
#include <immintrin.h>
#include <time.h> /* bf16_widen_gain's clock */
#endif
/* the float32 matmul (f32_linear.inc): AVX2 FMA, or AVX512F where it is built (every level
 * but the default one) */
#if defined(__AVX2__) && defined(__FMA__)
#define HAS_F32_LINEAR 1
#include <immintrin.h>
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

/* The matmuls' requests for a later weight panel (f32_linear.inc, bf16_dot_linear.inc), and
 * the attention kernel's for a later tile's values: the cache lines from `at` up to `end`
 * still to ask memory for. */
typedef struct {
    const char *at, *end;
} line_run;

/* ask memory for the next `count` lines of `run` (prefetcht0), as far as it goes */
static inline void ask_lines(line_run *run, int count) {
    for (int line = 0; line < count && run->at < run->end; line++) {
        __builtin_prefetch(run->at);
        run->at += 64;
    }
}

/* the same into the outer caches (prefetcht2), not L1 */
static inline void ask_lines_outer(line_run *run, int count) {
    for (int line = 0; line < count && run->at < run->end; line++) {
        __builtin_prefetch(run->at, 0, 1);
        run->at += 64;
    }
}

/* The attention kernel's requests for one KV head's keys and values of the next tile, made a
 * line or two at a time while the current tile computes (paged_attention.inc) */
typedef struct {
    const char *keys;      /* its dimension 0 key row; NULL: nothing to ask for */
    int64_t key_row_bytes; /* bytes from one dimension's key row to the next */
    int64_t rows_per_line; /* key rows per cache line (a power of 2) */
    line_run values;       /* its values, one run */
    int values_per_step;   /* value lines asked for per step of the values' loop */
} tile_ahead;

/* The matmuls' share of work between their threads: items (a chunk of rows x a block of
 * columns, a chunk's blocks numbered in a row) claimed from one shared count `*claimed`, up
 * to `most` consecutive items of one chunk at a time, and fewer once fewer than 2 x threads x
 * that are left, so that the threads end together (a whole take left over made one of two
 * threads compute 10 of a matmul's 18 blocks while the other waited after 8). Dynamic, not a
 * static split: a static one made the whole matmul wait whenever another process took one of
 * the cores for a moment (float32 matmuls of 30 layers at 32 rows, 2 AVX2 cores: 82.5 ms
 * against 77.5 beside a process busy 2 ms in every 22; taken dynamically 74-75 either way).
 * Returns the take's first item and sets *size, or -1 when every item
 * is taken. */
static inline int64_t claim_take(int64_t *claimed, int64_t total, int64_t per_chunk,
                                 int64_t most, int num_threads, int64_t *size) {
    int64_t first = __atomic_load_n(claimed, __ATOMIC_RELAXED), take;
    do {
        if (first >= total) return -1;
        int64_t in_chunk = per_chunk - first % per_chunk;
        take = (total - first) / (2 * (int64_t)num_threads);
        if (take > most) take = most;
        if (take > in_chunk) take = in_chunk;
        if (take < 1) take = 1;
    } while (!__atomic_compare_exchange_n(claimed, &first, first + take, 0, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED));
    *size = take;
    return first;
}

#if defined(HAS_AMX_LINEAR) || defined(HAS_BF16_DOT_LINEAR)
/* 16 floats rounded to bfloat16 as float_to_bf16 rounds them (nearest even, NaN 0x7FC0) */
static inline __m256i floats_to_bf16x16(__m512 floats) {
    __m512i bits = _mm512_castps_si512(floats);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(floats, floats, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}

/* 32 floats (low's, then high's) rounded to bfloat16: vcvtne2ps2bf16 where AVX512-BF16 is
 * built, the same rounding on AVX512F elsewhere */
static inline __m512i floats_to_bf16x32(__m512 high, __m512 low) {
#ifdef __AVX512BF16__
    return (__m512i)_mm512_cvtne2ps_pbh(high, low);
#else
    return _mm512_inserti64x4(_mm512_castsi256_si512(floats_to_bf16x16(low)),
                              floats_to_bf16x16(high), 1);
#endif
}

/* 32 bfloat16 values as two float32 vectors (masked: n may end inside a pair of panels, so
 * `columns` says which to read); the bfloat16 matmuls' bias */
static inline void bf16x32_to_floats(const bf16_t *values, __mmask32 columns, __m512 *floats) {
    __m512i raw = _mm512_maskz_loadu_epi16(columns, values);
    __m512i low16 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw));
    __m512i high16 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1));
    floats[0] = _mm512_castsi512_ps(_mm512_slli_epi32(low16, 16));
    floats[1] = _mm512_castsi512_ps(_mm512_slli_epi32(high16, 16));
}
#endif
/* The attention and LoRA kernels' vectors: the widest this build's instruction set holds in
 * one register. A 64-byte vector without AVX512 makes GCC shuffle every operation through the
 * stack (movq/vpinsrq): the AVX2 build's batch-32 attention ran at 4 GB/s from L3. */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vecw __attribute__((vector_size(LANES * 4)));
typedef uint16_t u16xw __attribute__((vector_size(LANES * 2)));
typedef uint32_t u32xw __attribute__((vector_size(LANES * 4)));

static inline vecw loadw_float(const float *p) {
    vecw v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* whether any lane of v is above x */
static inline int any_above(vecw v, float x) {
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(x), _CMP_GT_OQ) != 0;
#elif defined(__AVX__)
    return _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(x), _CMP_GT_OQ)) != 0;
#else
    int above = 0;
    for (int lane = 0; lane < LANES; lane++) above |= v[lane] > x;
    return above;
#endif
}

/* the sum of v's lanes, halves added pairwise (the same order every time) */
static inline float sum_lanes(vecw v) {
    float lanes[LANES];
    memcpy(lanes, &v, sizeof v);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) lanes[i] += lanes[i + width];
    return lanes[0];
}

/* LANES bfloat16 widened to floats. GCC 12 built __builtin_convertvector of 16 as two halves
 * (a load, vpmovzxwd of each half, vinserti64x4): one vpmovzxwd from memory here made a
 * 1024-token bfloat16 prompt's attention x0.92 (30 layers, 2 Zen 5 cores, kernel_ab) */
static inline vecw loadw_bf16(const bf16_t *p) {
#if defined(__AVX512F__)
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p));
    return (vecw)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#elif defined(__AVX2__)
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p));
    return (vecw)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#else
    u16xw raw;
    memcpy(&raw, p, sizeof raw);
    u32xw wide = __builtin_convertvector(raw, u32xw) << 16;
    vecw v;
    memcpy(&v, &wide, sizeof v);
    return v;
#endif
}

static inline float bf16_to_float(bf16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

/* round to nearest even, as torch's c10::BFloat16 does; NaN stays a NaN */
static inline bf16_t float_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t rounded = (v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16;
    return f != f ? (bf16_t)0x7FC0 : (bf16_t)rounded;
}

/* The element-wise kernels' vectors of T (cpu_kernels.inc): STOREW(p, v) rounds LANES floats to
 * T and stores them, ROUNDW(v) rounds them to T and widens them back (LOAD(STORE(x)) of each).
 * For bfloat16 the compiler's own vectors of float_to_bf16 took ~8 instructions a vector, which
 * made the bfloat16 kernels ~2.5x the float32 ones' time on the same rows; AVX512-BF16 rounds
 * a vector in one (vcvtneps2bf16: nearest even as float_to_bf16, a NaN stays a NaN, a
 * subnormal float becomes a signed zero) and elsewhere integer vectors do it as float_to_bf16
 * does. */
static inline void storew_float(float *p, vecw v) { memcpy(p, &v, sizeof v); }

static inline vecw roundw_float(vecw v) { return v; }

#if defined(__AVX512BF16__)
static inline __m256i bf16w_bits(vecw v) { return (__m256i)_mm512_cvtneps_pbh((__m512)v); }

static inline void storew_bf16(bf16_t *p, vecw v) { _mm256_storeu_si256((void *)p, bf16w_bits(v)); }

static inline vecw roundw_bf16(vecw v) {
    __m512i wide = _mm512_cvtepu16_epi32(bf16w_bits(v));
    return (vecw)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#else
/* v rounded to nearest even, in the high half of each lane's bits (NaN: 0x7FC0) */
static inline u32xw bf16w_high(vecw v) {
    u32xw bits;
    memcpy(&bits, &v, sizeof bits);
    u32xw rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    u32xw nan = (u32xw)(v != v);
    return (rounded & ~nan) | (nan & 0x7FC00000u);
}

static inline void storew_bf16(bf16_t *p, vecw v) {
    u16xw narrow = __builtin_convertvector(bf16w_high(v) >> 16, u16xw);
    memcpy(p, &narrow, sizeof narrow);
}

static inline vecw roundw_bf16(vecw v) {
    u32xw high = bf16w_high(v);
    memcpy(&v, &high, sizeof v);
    return v;
}
#endif

/* e^x for x in [-87, 88] (clamped outside), within 2 ulp: Cody-Waite reduction and a
 * degree-6 polynomial, written so that loops over it vectorize */
#define EXP_LN2_HIGH 0.693359375f /* ln 2 = EXP_LN2_HIGH + EXP_LN2_LOW */
#define EXP_LN2_LOW -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f /* the polynomial's coefficients, highest power first */
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x; /* not fminf/fmaxf: those do not vectorize */
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (floorf does not vectorize) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * EXP_LN2_HIGH;
    r = r - n * EXP_LN2_LOW;
    float p = EXP_P0;
    p = p * r + EXP_P1;
    p = p * r + EXP_P2;
    p = p * r + EXP_P3;
    p = p * r + EXP_P4;
    p = p * r + EXP_P5;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

#define PARALLEL_MIN_ELEMENTS 4096 /* smaller element-wise work runs on one thread (a decode
                                     batch of 32 rows of 576 splits: -4% of a bfloat16 step) */
#define SILU_SPAN 512 /* gate values whose exponentials silu_mul computes at once */
#define KEY_TILE 16                  /* keys scored together in the attention kernel */
#define PARTS (KEY_TILE / LANES)     /* vecws of a tile's scores */
/* query rows the attention kernel computes together. AVX512: a prompt chunk's 48 rows per KV
 * head (16 queries x 3 heads) in 8 groups of 6 instead of 12 of 4 read each key and value tile
 * fewer times (4 prompts of 128 tokens, 30 layers, 2 Zen 4 cores, kernel_ab in turns:
 * x0.897-0.944; 8 rows: x0.991, 5: x0.993, 7: x0.949); 6 of 8 rows, with the scores' 8
 * independent FMA chains where 6 left the FMA units waiting on their latency, once a tile's
 * softmax cost less (paged_attention.inc): a 1024-token bfloat16 prompt x0.956, 4 prompts of
 * 128 x0.98 (2 Zen 5 cores), decodes unchanged (3 rows). AVX2's 16 vector registers do not hold
 * 6 rows' scores and sums: on 2 Zen 3 cores 4 rows took x0.856-0.889 of 6's time (5: x1.11),
 * though the AVX2 build on a Zen 4 core liked 6 (x0.939) */
#ifdef __AVX512F__
#define ROWS_MAX 8
#else
#define ROWS_MAX 4
#endif
#ifndef DOT_MIN_ROWS
#define DOT_MIN_ROWS 8 /* a work item's fewest rows per KV head for the dot products */
#endif
#define MAX_TILE_ROWS 48             /* query rows (queries x heads of a KV group) per item */
#define MAX_QUERY_TILE 16            /* queries of one request per attention work item */
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 1 /* tiles ahead whose keys and values the attention kernel asks for */
#endif
#define MAX_HEAD_DIM 256             /* the attention kernel's largest head dimension, a
                                        multiple of KEY_TILE as every head dimension must be */
#define MAX_LORA_COLS 1024           /* a LoRA op's parts x rank (services/worker/lora.py) */
#define LORA_PARALLEL_MIN_MACS 65536 /* smaller LoRA work runs on one thread */
#define LORA_TILE 8                  /* rows of one adapter a LoRA weight row is applied to */

#define CONCAT_(a, b) a##_##b
#define CONCAT(a, b) CONCAT_(a, b)
#define FN(name) CONCAT(name, SUFFIX)

#define T float
#define SUFFIX f32
#define LOAD(x) (x)
#define STORE(x) (x)
#define LOADW(p) loadw_float(p) /* LANES consecutive elements as floats */
#define STOREW(p, v) storew_float(p, v)
#define ROUNDW(v) roundw_float(v)
#include "cpu_kernels.inc"
#include "paged_attention.inc"
#include "lora.inc"
#undef T
#undef SUFFIX
#undef LOAD
#undef STORE
#undef LOADW
#undef STOREW
#undef ROUNDW

#define T bf16_t
#define SUFFIX bf16
#define LOAD(x) bf16_to_float(x)
#define STORE(x) float_to_bf16(x)
#define LOADW(p) loadw_bf16(p)
#define STOREW(p, v) storew_bf16(p, v)
#define ROUNDW(v) roundw_bf16(v)
#if defined(HAS_BF16_DOT_PRODUCTS)
#define ATTENTION_DOTS 1 /* prompt chunks' attention on dot products, where asked */
#endif
#include "cpu_kernels.inc"
#include "paged_attention.inc"
#ifdef ATTENTION_DOTS
#include "attention_dot.inc"
#undef ATTENTION_DOTS
#endif
#include "lora.inc"
#undef T
#undef SUFFIX
#undef LOAD
#undef STORE
#undef LOADW
#undef STOREW
#undef ROUNDW

#include "amx_linear.inc"
#include "amx_attention.inc"
#include "bf16_dot_linear.inc"
#include "f32_linear.inc"
