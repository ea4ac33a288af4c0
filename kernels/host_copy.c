/* Page gather/scatter between two host buffers: the data path of vLLM's CPU backend ("host" copy backend).
 *
 * Built at run time by kernels/host_copy.py with the system C compiler and called through ctypes (which releases
 * the GIL for the call). One call copies every page of one KV cache group (all its tensors) for a list of blocks.
 *
 * Why not memcpy per page: glibc's memcpy switches to non-temporal stores only above a large threshold (a fraction
 * of the last-level cache), so per-page copies of 16 KiB - 2.5 MiB pages write through the cache, pay a
 * read-for-ownership on every destination line and reach ~0.6 of one large memmove. Streaming stores skip both.
 * The hardware prefetcher also restarts at every page of a random gather; touching the first lines of the next
 * source page while the current one streams hides part of that restart (measured at 16 KiB pages: +0.06 of memmove
 * for device->host, where the source is the KV cache's 4 KiB-paged memory; neutral host->device; 0.5-2 KiB ahead
 * all alike, 4 KiB and more worse).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* -DOC_PORTABLE builds the memcpy-only path that non-x86 hosts get (CI compiles it on x86 too). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(OC_PORTABLE)
#include <immintrin.h>
#define OC_X86 1
#endif

enum { OC_ISA_MEMCPY = 0, OC_ISA_SSE2 = 1, OC_ISA_AVX2 = 2, OC_ISA_AVX512 = 3 };

/* Pages smaller than this go through memcpy: a few lines do not repay the store fence. */
#define OC_STREAM_MIN 256
/* Bytes of the next source page touched ahead. */
#define OC_PREFETCH_AHEAD 1024

int oc_best_isa(void) {
#ifdef OC_X86
    /* GCC and clang check the OS-enabled register state (XCR0) here, not only the CPUID bit. */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return OC_ISA_AVX512;
    if (__builtin_cpu_supports("avx2")) return OC_ISA_AVX2;
    return OC_ISA_SSE2; /* baseline of x86-64 */
#else
    return OC_ISA_MEMCPY;
#endif
}

#ifdef OC_X86
/* Each body copies n bytes, n a multiple of 64, to a destination aligned for its stores. */
__attribute__((target("avx512f"))) static void stream_avx512(uint8_t *d, const uint8_t *s, size_t n) {
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m512i a = _mm512_loadu_si512((const void *)(s + i));
        __m512i b = _mm512_loadu_si512((const void *)(s + i + 64));
        _mm512_stream_si512((void *)(d + i), a);
        _mm512_stream_si512((void *)(d + i + 64), b);
    }
    if (i < n) _mm512_stream_si512((void *)(d + i), _mm512_loadu_si512((const void *)(s + i)));
}

__attribute__((target("avx2"))) static void stream_avx2(uint8_t *d, const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
    }
}

static void stream_sse2(uint8_t *d, const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
}

static void copy_streaming(int isa, uint8_t *d, const uint8_t *s, size_t n) {
    size_t align = isa == OC_ISA_AVX512 ? 64 : isa == OC_ISA_AVX2 ? 32 : 16;
    size_t head = (align - ((uintptr_t)d & (align - 1))) & (align - 1);
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    if (isa == OC_ISA_AVX512) stream_avx512(d, s, body);
    else if (isa == OC_ISA_AVX2) stream_avx2(d, s, body);
    else stream_sse2(d, s, body);
    memcpy(d + body, s + body, n - body);
}
#endif

static void copy_page(int isa, uint8_t *d, const uint8_t *s, size_t bytes) {
#ifdef OC_X86
    if (isa != OC_ISA_MEMCPY && bytes >= OC_STREAM_MIN) {
        copy_streaming(isa, d, s, bytes);
        return;
    }
#else
    (void)isa;
#endif
    memcpy(d, s, bytes);
}

/* For every pair k and every tensor t: copy size[t] bytes from src[t] + src_ids[k] * src_stride[t] to
 * dst[t] + dst_ids[k] * dst_stride[t]. Block-major on purpose: the host tier is block-first, so one block's pages
 * of all tensors are one contiguous run on the host side (measured +0.05 of memmove speed over tensor-major).
 * Returns 0, or -1 when `isa` is not available on this CPU (nothing is copied then). */
int oc_copy_blocks(int isa, int64_t n_tensors, uint8_t *const *dst, const uint8_t *const *src,
                   const int64_t *dst_stride, const int64_t *src_stride, const int64_t *size,
                   const int64_t *dst_ids, const int64_t *src_ids, int64_t n) {
    if (isa < OC_ISA_MEMCPY || isa > oc_best_isa()) return -1;
    for (int64_t k = 0; k < n; k++) {
        for (int64_t t = 0; t < n_tensors; t++) {
#ifdef OC_X86
            /* The next page in copy order: the next tensor of this block, else the first of the next block. */
            int64_t nt = t + 1 < n_tensors ? t + 1 : 0, nk = t + 1 < n_tensors ? k : k + 1;
            if (isa != OC_ISA_MEMCPY && nk < n) {
                const char *next = (const char *)(src[nt] + src_ids[nk] * src_stride[nt]);
                size_t ahead = (size_t)size[nt] < OC_PREFETCH_AHEAD ? (size_t)size[nt] : OC_PREFETCH_AHEAD;
                for (size_t j = 0; j < ahead; j += 64) _mm_prefetch(next + j, _MM_HINT_T0);
            }
#endif
            copy_page(isa, dst[t] + dst_ids[k] * dst_stride[t], src[t] + src_ids[k] * src_stride[t],
                      (size_t)size[t]);
        }
    }
#ifdef OC_X86
    /* Streaming stores are weakly ordered: make them visible before the caller reports the copy complete. */
    if (isa != OC_ISA_MEMCPY) _mm_sfence();
#endif
    return 0;
}
