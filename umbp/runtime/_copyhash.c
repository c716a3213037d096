/* Copy bytes and compute their xxh3-64 in the same pass: each 64-byte stripe is loaded
 * once, stored to the destination and fed to the hash from the same registers.
 *
 * Why native: in Python the hash is a second pass over the bytes (from cache at best,
 * docs/performance.md "Checksums while copying"), which costs ~0.2 of the copy's time;
 * inside the copy loop the hash's arithmetic rides the memory traffic the copy waits on.
 *
 * The value is exactly xxhash's XXH3_64bits (seed 0, default secret) of the bytes copied,
 * for objects longer than XXH3_MIDSIZE_MAX (240) bytes, which take XXH3's long-input
 * path: 8 accumulators, one 64-byte stripe at a time against a sliding window of the
 * secret, scrambled after every 16 stripes, the last stripe taken at len - 64 with its
 * own secret offset, then merged. Shorter objects are left to the Python caller (the
 * `xxhash` package), as is any object this module refuses. tests/unit/test_paged_copy.py
 * and tests/property/test_copy_hash_properties.py check every path against
 * `xxhash.xxh3_64_intdigest`.
 *
 * An object may be scattered: `copy_hash_regions` copies between (offset, length)
 * regions of one pool and a contiguous buffer, hashing the bytes in object order; a
 * stripe that straddles two regions is gathered into a small buffer.
 *
 * Where the destination is 32-byte aligned the AVX2 kernel streams its stores past the
 * cache: a copy then does not read each destination line before writing it (as plain
 * stores and glibc's `rep movsb` do), nor evict what other threads and the server keep
 * in cache; it measured 1.4-1.9x numpy's memcpy, against 0.9-1.2x with plain stores.
 * An `sfence` ends each copy, so it is complete before anything reads it. `Hashes` built
 * with stream=False keeps plain stores: for a destination read again at once (a staging
 * row a transport copies out next), which then finds it in cache.
 *
 * The GIL is released while bytes move (every function), so transfer threads copy
 * beside the thread that drives the model.
 *
 * `move_ranges` is a plain batch of copies between raw addresses (no hash): the pieces
 * of a restore whose checksums are verified apart, which Python would otherwise move one
 * call (and one round of the GIL) per piece.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define UMBP_X86 1
#endif

#define STRIPE 64
#define STRIPES_PER_BLOCK 16
#define SECRET_SIZE 192
#define MIDSIZE_MAX 240

static const uint8_t kSecret[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define PRIME32_1 0x9E3779B1U
#define PRIME32_2 0x85EBCA77U
#define PRIME32_3 0xC2B2AE3DU
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL
#define PRIME_MX1 0x165667919E3779F9ULL

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* One stripe: copy `src` to `dst` (64 bytes) and accumulate what was copied. */
typedef void (*stripes_fn)(uint64_t *acc, uint8_t *dst, const uint8_t *src,
                           const uint8_t *secret, size_t count, int stream);

static void stripes_scalar(uint64_t *acc, uint8_t *dst, const uint8_t *src,
                           const uint8_t *secret, size_t count, int stream) {
    (void)stream;
    for (size_t n = 0; n < count; n++) {
        uint8_t stripe[STRIPE];
        memcpy(stripe, src + n * STRIPE, STRIPE);
        memcpy(dst + n * STRIPE, stripe, STRIPE);
        const uint8_t *key = secret + n * 8;
        for (int lane = 0; lane < 8; lane++) {
            uint64_t data = read64(stripe + 8 * lane);
            uint64_t keyed = data ^ read64(key + 8 * lane);
            acc[lane ^ 1] += data;
            acc[lane] += (keyed & 0xFFFFFFFFULL) * (keyed >> 32);
        }
    }
}

#ifdef UMBP_X86
__attribute__((target("avx2"), always_inline))
static inline void stripes_avx2_impl(uint64_t *acc, uint8_t *dst, const uint8_t *src,
                                     const uint8_t *secret, size_t count, int stream) {
    __m256i acc0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i acc1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    for (size_t n = 0; n < count; n++) {
        const uint8_t *in = src + n * STRIPE;
        uint8_t *out = dst + n * STRIPE;
        const uint8_t *key = secret + n * 8;
        __m256i data0 = _mm256_loadu_si256((const __m256i *)in);
        __m256i data1 = _mm256_loadu_si256((const __m256i *)(in + 32));
        if (stream) {
            _mm256_stream_si256((__m256i *)out, data0);
            _mm256_stream_si256((__m256i *)(out + 32), data1);
        } else {
            _mm256_storeu_si256((__m256i *)out, data0);
            _mm256_storeu_si256((__m256i *)(out + 32), data1);
        }
        __m256i keyed0 = _mm256_xor_si256(data0, _mm256_loadu_si256((const __m256i *)key));
        __m256i keyed1 = _mm256_xor_si256(data1, _mm256_loadu_si256((const __m256i *)(key + 32)));
        /* low 32 bits of each keyed lane times its high 32 bits */
        __m256i product0 = _mm256_mul_epu32(keyed0, _mm256_srli_epi64(keyed0, 32));
        __m256i product1 = _mm256_mul_epu32(keyed1, _mm256_srli_epi64(keyed1, 32));
        /* acc[lane ^ 1] += data[lane]: swap the 64-bit halves of each 128-bit pair */
        __m256i swapped0 = _mm256_shuffle_epi32(data0, _MM_SHUFFLE(1, 0, 3, 2));
        __m256i swapped1 = _mm256_shuffle_epi32(data1, _MM_SHUFFLE(1, 0, 3, 2));
        acc0 = _mm256_add_epi64(acc0, _mm256_add_epi64(product0, swapped0));
        acc1 = _mm256_add_epi64(acc1, _mm256_add_epi64(product1, swapped1));
    }
    _mm256_storeu_si256((__m256i *)acc, acc0);
    _mm256_storeu_si256((__m256i *)(acc + 4), acc1);
}

__attribute__((target("avx2")))
static void stripes_avx2(uint64_t *acc, uint8_t *dst, const uint8_t *src,
                         const uint8_t *secret, size_t count, int stream) {
    if (stream && ((uintptr_t)dst & 31) == 0 && count >= 4) {
        stripes_avx2_impl(acc, dst, src, secret, count, 1);
    } else {
        stripes_avx2_impl(acc, dst, src, secret, count, 0);
    }
}
#endif

static stripes_fn copy_stripes = stripes_scalar;

static void scramble(uint64_t *acc) {
    const uint8_t *key = kSecret + SECRET_SIZE - STRIPE;
    for (int lane = 0; lane < 8; lane++) {
        uint64_t value = acc[lane];
        value ^= value >> 47;
        value ^= read64(key + 8 * lane);
        value *= PRIME32_1;
        acc[lane] = value;
    }
}

static uint64_t mul128_fold64(uint64_t lhs, uint64_t rhs) {
    __uint128_t product = (__uint128_t)lhs * rhs;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static uint64_t merge(const uint64_t *acc, uint64_t length) {
    const uint8_t *secret = kSecret + 11;
    uint64_t result = length * PRIME64_1;
    for (int i = 0; i < 4; i++) {
        result += mul128_fold64(acc[2 * i] ^ read64(secret + 16 * i),
                                acc[2 * i + 1] ^ read64(secret + 16 * i + 8));
    }
    result ^= result >> 37;
    result *= PRIME_MX1;
    result ^= result >> 32;
    return result;
}

/* The hash of one object copied piece by piece, its total length known up front: the
 * stripes before the last (len - 1) / 64 are accumulated as they are copied; the last
 * 64 bytes are hashed at the end from where they landed. */
typedef struct {
    uint64_t acc[8];
    size_t total;
    size_t normal;   /* stripes accumulated in order: (total - 1) / 64 */
    size_t done;     /* of those, accumulated so far */
    uint8_t partial[STRIPE];
    size_t partial_bytes;
    int stream;      /* stores may stream past the cache (see the top of the file) */
} Hashing;

static void hashing_start(Hashing *h, size_t total, int stream) {
    static const uint64_t init[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3,
                                     PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
    memcpy(h->acc, init, sizeof init);
    h->total = total;
    h->normal = (total - 1) / STRIPE;
    h->done = 0;
    h->partial_bytes = 0;
    h->stream = stream;
}

/* Accumulate `count` stripes (copying them), scrambling at every block's end. */
static void hashing_stripes(Hashing *h, uint8_t *dst, const uint8_t *src, size_t count) {
    while (count > 0) {
        size_t in_block = h->done % STRIPES_PER_BLOCK;
        size_t run = STRIPES_PER_BLOCK - in_block;
        if (run > count) {
            run = count;
        }
        copy_stripes(h->acc, dst, src, kSecret + in_block * 8, run, h->stream);
        h->done += run;
        dst += run * STRIPE;
        src += run * STRIPE;
        count -= run;
        if (h->done % STRIPES_PER_BLOCK == 0) {
            scramble(h->acc);
        }
    }
}

static void hashing_piece(Hashing *h, uint8_t *dst, const uint8_t *src, size_t length) {
    if (h->partial_bytes > 0) { /* a stripe begun in the previous piece */
        size_t take = STRIPE - h->partial_bytes;
        if (take > length) {
            take = length;
        }
        memcpy(dst, src, take);
        memcpy(h->partial + h->partial_bytes, dst, take);
        h->partial_bytes += take;
        dst += take;
        src += take;
        length -= take;
        if (h->partial_bytes == STRIPE) {
            uint8_t scratch[STRIPE];
            hashing_stripes(h, scratch, h->partial, 1);
            h->partial_bytes = 0;
        }
    }
    size_t wanted = h->normal - h->done;
    size_t whole = length / STRIPE;
    if (whole > wanted) {
        whole = wanted;
    }
    hashing_stripes(h, dst, src, whole);
    dst += whole * STRIPE;
    src += whole * STRIPE;
    length -= whole * STRIPE;
    if (length == 0) {
        return;
    }
    memcpy(dst, src, length);
    if (h->done < h->normal) { /* the start of a stripe that ends in the next piece */
        memcpy(h->partial, dst, length);
        h->partial_bytes = length;
    }
}

static uint64_t hashing_finish(Hashing *h, const uint8_t *last_stripe) {
    uint8_t scratch[STRIPE];
    copy_stripes(h->acc, scratch, last_stripe, kSecret + SECRET_SIZE - STRIPE - 7, 1, 0);
    return merge(h->acc, h->total);
}

typedef struct {
    Py_ssize_t offset;
    Py_ssize_t length;
} Region;

/* Copy an object of `total` bytes between its `regions` of the pool at `base` and the
 * contiguous `flat` (into the pool when `into_pool`), hashing it in region order; its
 * xxh3-64. The streamed stores are drained (`sfence`) before the last stripe is read
 * back from where it landed. No GIL needed. */
static uint64_t copy_object(uint8_t *base, const Region *regions, Py_ssize_t count,
                            size_t total, uint8_t *flat, int into_pool) {
    Hashing h;
    hashing_start(&h, total, 1);
    size_t at = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint8_t *in_pool = base + regions[i].offset;
        size_t length = (size_t)regions[i].length;
        if (into_pool) {
            hashing_piece(&h, in_pool, flat + at, length);
        } else {
            hashing_piece(&h, flat + at, in_pool, length);
        }
        at += length;
    }
#ifdef UMBP_X86
    _mm_sfence();
#endif
    if (!into_pool) {
        return hashing_finish(&h, flat + total - STRIPE);
    }
    uint8_t last[STRIPE]; /* gathered across regions if need be */
    size_t wanted = STRIPE;
    for (Py_ssize_t i = count - 1; i >= 0 && wanted > 0; i--) {
        size_t length = (size_t)regions[i].length;
        size_t take = length < wanted ? length : wanted;
        memcpy(last + wanted - take, base + regions[i].offset + length - take, take);
        wanted -= take;
    }
    return hashing_finish(&h, last);
}

/* ----------------------------------------------------------------- Python side */

static int get_buffers(PyObject *destination, PyObject *source, Py_buffer *out, Py_buffer *in) {
    if (PyObject_GetBuffer(destination, out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    if (PyObject_GetBuffer(source, in, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(out);
        return -1;
    }
    return 0;
}

static PyObject *copy_hash(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *destination, *source;
    if (!PyArg_ParseTuple(args, "OO:copy_hash", &destination, &source)) {
        return NULL;
    }
    Py_buffer out, in;
    if (get_buffers(destination, source, &out, &in) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (out.len != in.len) {
        PyErr_Format(PyExc_ValueError, "copying %zd bytes into %zd", in.len, out.len);
    } else if (out.len <= MIDSIZE_MAX) {
        PyErr_Format(PyExc_ValueError, "copy_hash takes objects over %d bytes, got %zd",
                     MIDSIZE_MAX, out.len);
    } else {
        uint64_t value;
        Region whole = {0, out.len};
        Py_BEGIN_ALLOW_THREADS
        value = copy_object(out.buf, &whole, 1, (size_t)out.len, in.buf, 1);
        Py_END_ALLOW_THREADS
        result = PyLong_FromUnsignedLongLong(value);
    }
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return result;
}

/* The regions as (offset, length) pairs inside a pool of `pool_bytes`; their total. */
static Py_ssize_t parse_regions(PyObject *regions, Py_ssize_t pool_bytes, Region **parsed,
                                Py_ssize_t *count) {
    PyObject *sequence = PySequence_Fast(regions, "regions must be a sequence");
    if (sequence == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sequence);
    Region *list = PyMem_Malloc(sizeof(Region) * (size_t)(n > 0 ? n : 1));
    if (list == NULL) {
        Py_DECREF(sequence);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(sequence, i);
        Py_ssize_t offset, length;
        PyObject *pair = PySequence_Fast(item, "a region must be an (offset, length) pair");
        if (pair == NULL) {
            goto fail;
        }
        if (PySequence_Fast_GET_SIZE(pair) != 2) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_ValueError, "a region must be an (offset, length) pair");
            goto fail;
        }
        offset = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(pair, 0), PyExc_OverflowError);
        length = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(pair, 1), PyExc_OverflowError);
        Py_DECREF(pair);
        if ((offset == -1 || length == -1) && PyErr_Occurred()) {
            goto fail;
        }
        if (offset < 0 || length < 0 || offset > pool_bytes || length > pool_bytes - offset) {
            PyErr_Format(PyExc_ValueError, "region (%zd, %zd) lies outside a pool of %zd bytes",
                         offset, length, pool_bytes);
            goto fail;
        }
        list[i].offset = offset;
        list[i].length = length;
        total += length;
    }
    Py_DECREF(sequence);
    *parsed = list;
    *count = n;
    return total;
fail:
    PyMem_Free(list);
    Py_DECREF(sequence);
    return -1;
}

static PyObject *copy_hash_regions(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *memory, *regions, *flat;
    int into_memory;
    if (!PyArg_ParseTuple(args, "OOOp:copy_hash_regions", &memory, &regions, &flat,
                          &into_memory)) {
        return NULL;
    }
    Py_buffer pool, other;
    int failed = into_memory ? get_buffers(memory, flat, &pool, &other)
                             : get_buffers(flat, memory, &other, &pool);
    if (failed < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    Region *list = NULL;
    Py_ssize_t count = 0;
    Py_ssize_t total = parse_regions(regions, pool.len, &list, &count);
    if (total < 0) {
        goto done;
    }
    if (total != other.len) {
        PyErr_Format(PyExc_ValueError, "copying %zd bytes between regions of %zd", other.len,
                     total);
        goto done;
    }
    if (total <= MIDSIZE_MAX) {
        PyErr_Format(PyExc_ValueError, "copy_hash_regions takes objects over %d bytes, got %zd",
                     MIDSIZE_MAX, total);
        goto done;
    }
    uint64_t value;
    Py_BEGIN_ALLOW_THREADS
    value = copy_object(pool.buf, list, count, (size_t)total, other.buf, into_memory);
    Py_END_ALLOW_THREADS
    result = PyLong_FromUnsignedLongLong(value);
done:
    PyMem_Free(list);
    PyBuffer_Release(&other);
    PyBuffer_Release(&pool);
    return result;
}

static int uint64_arrays(PyObject *const *objects, Py_buffer *views, const char *name);

/* Plain copies between raw addresses, for copies whose checksum is checked apart (a
 * restore's pieces, layer by layer): one call and one release of the GIL for a whole
 * batch of ranges instead of a Python call (and a GIL round) per range. The caller
 * vouches for every address: they come from a copy it validated. */
static PyObject *move_ranges(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *objects[3];
    if (!PyArg_ParseTuple(args, "OOO:move_ranges", &objects[0], &objects[1], &objects[2])) {
        return NULL;
    }
    Py_buffer views[3];
    if (uint64_arrays(objects, views, "move_ranges") < 0) {
        return NULL;
    }
    const uint64_t *sources = views[0].buf;
    const uint64_t *destinations = views[1].buf;
    const uint64_t *sizes = views[2].buf;
    Py_ssize_t count = views[0].len / (Py_ssize_t)sizeof(uint64_t);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        memmove((void *)(uintptr_t)destinations[i], (const void *)(uintptr_t)sources[i],
                (size_t)sizes[i]);
    }
    Py_END_ALLOW_THREADS
    for (int held = 3; held > 0;) {
        PyBuffer_Release(&views[--held]);
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------- hashes across copies */

/* Objects copied piece by piece over several calls (a restore, one layer at a time;
 * a store, every layer at once), each hashed as its bytes move: per object a Hashing
 * state, the bytes fed so far and the last 64 of them (xxh3's last stripe, gathered
 * from where they landed). One thread at a time: a call that finds another in flight
 * raises instead of racing it. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t count;
    size_t total;
    Hashing *states;
    size_t *fed;
    uint8_t (*tails)[STRIPE];
    int busy;
} HashesObject;

static void hashes_dealloc(HashesObject *self) {
    PyMem_Free(self->states);
    PyMem_Free(self->fed);
    PyMem_Free(self->tails);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int hashes_init(HashesObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"count", "nbytes", "stream", NULL};
    Py_ssize_t count, nbytes;
    int stream = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nn|$p:Hashes", names, &count, &nbytes,
                                     &stream)) {
        return -1;
    }
    if (count < 0 || nbytes <= MIDSIZE_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "Hashes takes a count >= 0 of objects over %d bytes, got %zd of %zd",
                     MIDSIZE_MAX, count, nbytes);
        return -1;
    }
    if (self->states != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Hashes is initialised once");
        return -1;
    }
    size_t slots = (size_t)(count > 0 ? count : 1);
    self->states = PyMem_Malloc(sizeof(Hashing) * slots);
    self->fed = PyMem_Calloc(slots, sizeof(size_t));
    self->tails = PyMem_Malloc(sizeof(*self->tails) * slots);
    if (self->states == NULL || self->fed == NULL || self->tails == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->count = count;
    self->total = (size_t)nbytes;
    for (Py_ssize_t i = 0; i < count; i++) {
        hashing_start(&self->states[i], self->total, stream);
    }
    return 0;
}

/* The last bytes of one object's pieces in this call (`added` bytes in all) appended to
 * its tail, which keeps the object's last min(fed, 64) bytes right-aligned in 64. */
static void keep_tail(uint8_t *tail, size_t fed_before, size_t added,
                      const uint64_t *destinations, const uint64_t *sizes, Py_ssize_t pieces) {
    size_t wanted = added < STRIPE ? added : STRIPE;
    if (wanted < STRIPE) { /* the old tail's last bytes move left, in front of the new */
        size_t kept = fed_before < STRIPE ? fed_before : STRIPE;
        size_t stay = STRIPE - wanted < kept ? STRIPE - wanted : kept;
        memmove(tail + STRIPE - wanted - stay, tail + STRIPE - stay, stay);
    }
    size_t at = STRIPE;
    for (Py_ssize_t p = pieces - 1; p >= 0 && wanted > 0; p--) {
        size_t length = (size_t)sizes[p];
        size_t take = length < wanted ? length : wanted;
        at -= take;
        memcpy(tail + at, (const uint8_t *)(uintptr_t)destinations[p] + length - take, take);
        wanted -= take;
    }
}

static int uint64_arrays(PyObject *const *objects, Py_buffer *views, const char *name) {
    int held = 0;
    for (; held < 3; held++) {
        if (PyObject_GetBuffer(objects[held], &views[held], PyBUF_C_CONTIGUOUS) < 0) {
            goto fail;
        }
    }
    if (views[0].len == views[1].len && views[0].len == views[2].len &&
        views[0].len % (Py_ssize_t)sizeof(uint64_t) == 0) {
        return 0;
    }
    PyErr_Format(PyExc_ValueError,
                 "%s takes three uint64 arrays of one length, got %zd, %zd and %zd bytes",
                 name, views[0].len, views[1].len, views[2].len);
fail:
    while (held > 0) {
        PyBuffer_Release(&views[--held]);
    }
    return -1;
}

/* move(sources, destinations, sizes): the ranges object-major, an equal number per
 * object (each object's pieces in its byte order); copies them and feeds each object's
 * hash. Raises, before anything moves, where an object would get more than its size. */
static PyObject *hashes_move(HashesObject *self, PyObject *args) {
    PyObject *objects[3];
    if (!PyArg_ParseTuple(args, "OOO:move", &objects[0], &objects[1], &objects[2])) {
        return NULL;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Hashes is in use by another thread");
        return NULL;
    }
    Py_buffer views[3];
    if (uint64_arrays(objects, views, "move") < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    size_t *added = NULL; /* per object, the bytes this call feeds it */
    const uint64_t *sources = views[0].buf;
    const uint64_t *destinations = views[1].buf;
    const uint64_t *sizes = views[2].buf;
    Py_ssize_t ranges = views[0].len / (Py_ssize_t)sizeof(uint64_t);
    Py_ssize_t count = self->count;
    if (count == 0 ? ranges != 0 : ranges % count != 0) {
        PyErr_Format(PyExc_ValueError, "%zd ranges do not split evenly among %zd objects",
                     ranges, count);
        goto done;
    }
    Py_ssize_t per_object = count == 0 ? 0 : ranges / count;
    added = PyMem_Calloc((size_t)(count > 0 ? count : 1), sizeof(size_t));
    if (added == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        for (Py_ssize_t p = 0; p < per_object; p++) {
            added[i] += (size_t)sizes[i * per_object + p];
        }
        if (self->fed[i] + added[i] > self->total) {
            PyErr_Format(PyExc_ValueError, "object %zd would get %zu bytes of %zu", i,
                         self->fed[i] + added[i], self->total);
            goto done;
        }
    }
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < ranges; r++) {
        hashing_piece(&self->states[r / per_object],
                      (uint8_t *)(uintptr_t)destinations[r],
                      (const uint8_t *)(uintptr_t)sources[r], (size_t)sizes[r]);
    }
#ifdef UMBP_X86
    _mm_sfence();
#endif
    for (Py_ssize_t i = 0; i < count; i++) {
        keep_tail(self->tails[i], self->fed[i], added[i], destinations + i * per_object,
                  sizes + i * per_object, per_object);
        self->fed[i] += added[i];
    }
    Py_END_ALLOW_THREADS
    self->busy = 0;
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(added);
    for (int held = 3; held > 0;) {
        PyBuffer_Release(&views[--held]);
    }
    return result;
}

/* digests(): per object its xxh3-64, or None where not all of its bytes were fed. */
static PyObject *hashes_digests(HashesObject *self, PyObject *unused) {
    (void)unused;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Hashes is in use by another thread");
        return NULL;
    }
    PyObject *list = PyList_New(self->count);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->count; i++) {
        PyObject *item;
        if (self->fed[i] == self->total) {
            Hashing finished = self->states[i]; /* digests() may be asked again */
            item = PyLong_FromUnsignedLongLong(hashing_finish(&finished, self->tails[i]));
            if (item == NULL) {
                Py_DECREF(list);
                return NULL;
            }
        } else {
            item = Py_None;
            Py_INCREF(item);
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *hashes_count(HashesObject *self, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(self->count);
}

static PyObject *hashes_nbytes(HashesObject *self, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(self->total);
}

static PyMethodDef hashes_methods[] = {
    {"move", (PyCFunction)hashes_move, METH_VARARGS,
     "move(sources, destinations, sizes) -> None: copy the ranges (uint64 arrays of one "
     "length; object-major, as many per object, each object's in its byte order) without "
     "the GIL, feeding each object's hash. The addresses are trusted: only for copies the "
     "caller validated."},
    {"digests", (PyCFunction)hashes_digests, METH_NOARGS,
     "digests() -> list[int | None]: each object's xxh3-64, None where not all of its "
     "bytes were moved."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef hashes_getset[] = {
    {"count", (getter)hashes_count, NULL, "objects hashed", NULL},
    {"nbytes", (getter)hashes_nbytes, NULL, "bytes per object", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HashesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "umbp.runtime._copyhash.Hashes",
    .tp_basicsize = sizeof(HashesObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hashes(count, nbytes, *, stream=True): the xxh3-64 of `count` objects of "
              "`nbytes` each (over 240), computed while their bytes move in pieces over "
              "several calls; `stream`: stores may stream past the cache (False: the "
              "destination is read again soon, so keep it in cache).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hashes_init,
    .tp_dealloc = (destructor)hashes_dealloc,
    .tp_methods = hashes_methods,
    .tp_getset = hashes_getset,
};

static stripes_fn best_stripes = stripes_scalar; /* what this CPU runs best */

static PyObject *kernel(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyUnicode_FromString(copy_stripes == stripes_scalar ? "scalar" : "avx2");
}

/* For tests and benchmarks: run the portable loop on a CPU that has AVX2, and back. */
static PyObject *use_kernel(PyObject *module, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s:use_kernel", &name)) {
        return NULL;
    }
    PyObject *previous = kernel(module, NULL);
    if (strcmp(name, "scalar") == 0) {
        copy_stripes = stripes_scalar;
    } else if (strcmp(name, "best") == 0 ||
               (strcmp(name, "avx2") == 0 && best_stripes != stripes_scalar)) {
        copy_stripes = best_stripes;
    } else {
        Py_XDECREF(previous);
        PyErr_Format(PyExc_ValueError,
                     "kernel '%s' is not available here: 'scalar', 'best' or, with AVX2, "
                     "'avx2'", name);
        return NULL;
    }
    return previous;
}

static PyMethodDef methods[] = {
    {"copy_hash", copy_hash, METH_VARARGS,
     "copy_hash(destination, source) -> int: copy source into destination (same length, "
     "over 240 bytes); the xxh3-64 of the bytes copied."},
    {"copy_hash_regions", copy_hash_regions, METH_VARARGS,
     "copy_hash_regions(memory, regions, flat, into_memory) -> int: copy between the "
     "(offset, length) regions of memory and the contiguous flat buffer (into memory when "
     "into_memory); the xxh3-64 of the object's bytes in region order."},
    {"move_ranges", move_ranges, METH_VARARGS,
     "move_ranges(sources, destinations, sizes) -> None: sizes[i] bytes from address "
     "sources[i] to destinations[i] (three uint64 arrays of one length), without the GIL. "
     "The addresses are trusted: only for copies the caller validated."},
    {"kernel", kernel, METH_NOARGS, "kernel() -> str: the copy loop in use: 'avx2' or 'scalar'."},
    {"use_kernel", use_kernel, METH_VARARGS,
     "use_kernel(name) -> str: 'scalar' (the portable loop), 'best' (this CPU's) or a name "
     "kernel() answered; the kernel in use before."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, "umbp.runtime._copyhash",
    "Copies that compute the xxh3-64 of the bytes they copy, in one pass.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copyhash(void) {
#ifdef UMBP_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        best_stripes = stripes_avx2;
    }
#endif
    copy_stripes = best_stripes;
    if (PyType_Ready(&HashesType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&definition);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&HashesType);
    if (PyModule_AddObject(module, "Hashes", (PyObject *)&HashesType) < 0) {
        Py_DECREF(&HashesType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
