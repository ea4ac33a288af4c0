// One-launch gather/scatter of whole KV pages between device memory and mapped pinned host memory.
//
// NVRTC-clean: no headers, extern "C" entry points, fixed-width types spelled out. Loaded at run time through
// CuPy (kernels/cupy_kernel.py); CI compiles it with nvcc (scripts/check-kernels) and NVRTC (tests).
//
// Work decomposition (mirrored by kernels/workplan.py, whose numpy emulator the tests run):
//   item = (segment, page i, tensor j, chunk c), chunk fastest, then tensor, then page; a segment is one KV cache
//   group; items are numbered across segments by the per-call segment table's item_begin prefix sums.
//   A whole warp owns an item (warp-uniform control flow) and moves its chunk with UNROLL independent vector loads
//   per lane before the stores, so each warp keeps 32 * UNROLL * sizeof(V) bytes in flight. The grid is persistent:
//   warps stride over the items, so a few CTAs cover any transfer and leave the other SMs to the forward pass.
//
// Tables (all int64):
//   tensors[8*t + 0..4]  = src_base, src_stride, dst_base, dst_stride, page_bytes     (per direction, uploaded once)
//   seg_tensors[k]       = tensor index; a segment's tensors are seg_tensors[tbegin .. tbegin + n_tensors)
//   call[8*s + 0..5]     = item_begin, tbegin, n_tensors, id_begin, n_ids, chunks_per_page  (per call)
//   call[8*num_segs ..]  = src ids (num_ids), then dst ids (num_ids)
// Host pointers are device-usable addresses of registered (mapped) host memory.

typedef long long i64;

#define WARP 32
#define UNROLL 4
#define THREADS 512

struct alignas(16) V16 { unsigned int a, b, c, d; };
struct alignas(8) V8 { unsigned int a, b; };

// Streaming (.cs) loads and stores: each byte is touched once, so keep it out of L1/L2 for the forward pass.
template <typename V> __device__ __forceinline__ V load_cs(const V* p);
template <typename V> __device__ __forceinline__ void store_cs(V* p, V v);

template <> __device__ __forceinline__ V16 load_cs<V16>(const V16* p) {
  V16 v;
  asm("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
  return v;
}
template <> __device__ __forceinline__ void store_cs<V16>(V16* p, V16 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.a), "r"(v.b), "r"(v.c), "r"(v.d)
               : "memory");
}
template <> __device__ __forceinline__ V8 load_cs<V8>(const V8* p) {
  V8 v;
  asm("ld.global.cs.v2.u32 {%0, %1}, [%2];" : "=r"(v.a), "=r"(v.b) : "l"(p));
  return v;
}
template <> __device__ __forceinline__ void store_cs<V8>(V8* p, V8 v) {
  asm volatile("st.global.cs.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.a), "r"(v.b) : "memory");
}
template <> __device__ __forceinline__ unsigned int load_cs<unsigned int>(const unsigned int* p) {
  unsigned int v;
  asm("ld.global.cs.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
template <> __device__ __forceinline__ void store_cs<unsigned int>(unsigned int* p, unsigned int v) {
  asm volatile("st.global.cs.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Byte fallback for pages or bases that are not 4-byte aligned: plain accesses (rare, never the fast path).
template <> __device__ __forceinline__ unsigned char load_cs<unsigned char>(const unsigned char* p) { return *p; }
template <> __device__ __forceinline__ void store_cs<unsigned char>(unsigned char* p, unsigned char v) { *p = v; }

// One warp copies nbytes (a multiple of sizeof(V)); lane L handles elements L, L + 32, ... so every warp access is
// 32 consecutive elements (fully coalesced on both sides).
template <typename V>
__device__ __forceinline__ void copy_span(const char* src, char* dst, i64 nbytes, int lane) {
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  const i64 n = nbytes / (i64)sizeof(V);
  for (i64 base = 0; base < n; base += WARP * UNROLL) {
    V r[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const i64 idx = base + k * WARP + lane;
      if (idx < n) r[k] = load_cs<V>(s + idx);
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
      const i64 idx = base + k * WARP + lane;
      if (idx < n) store_cs<V>(d + idx, r[k]);
    }
  }
}

template <typename V>
__device__ __forceinline__ void gather_scatter(const i64* __restrict__ tensors, const i64* __restrict__ seg_tensors,
                                               const i64* __restrict__ call, int num_segs, i64 num_ids,
                                               i64 total_items, i64 chunk_bytes) {
  const i64* src_ids = call + 8 * (i64)num_segs;
  const i64* dst_ids = src_ids + num_ids;
  const int lane = threadIdx.x & (WARP - 1);
  const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
  const i64 num_warps = ((i64)gridDim.x * blockDim.x) / WARP;
  for (i64 item = warp; item < total_items; item += num_warps) {
    // Segments are few (one per KV cache group), so a linear scan beats a search.
    int s = 0;
    while (s + 1 < num_segs && item >= call[8 * (s + 1)]) ++s;
    const i64* seg = call + 8 * s;
    const i64 local = item - seg[0];
    const i64 chunks = seg[5];
    const i64 n_tensors = seg[2];
    const i64 c = local % chunks;
    const i64 rest = local / chunks;
    const i64 j = rest % n_tensors;
    const i64 i = rest / n_tensors;
    const i64* row = tensors + 8 * seg_tensors[seg[1] + j];
    const i64 page = row[4];
    const i64 off = c * chunk_bytes;
    // chunks_per_page covers the segment's largest page; smaller pages have no bytes in their last chunks.
    if (off >= page) continue;
    const i64 n = (page - off < chunk_bytes) ? page - off : chunk_bytes;
    const i64 id = seg[3] + i;
    const char* src = reinterpret_cast<const char*>(row[0] + src_ids[id] * row[1] + off);
    char* dst = reinterpret_cast<char*>(row[2] + dst_ids[id] * row[3] + off);
    copy_span<V>(src, dst, n, lane);
  }
}

#define ENTRY(NAME, V)                                                                                         \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                        \
      NAME(const i64* __restrict__ tensors, const i64* __restrict__ seg_tensors, const i64* __restrict__ call, \
           int num_segs, i64 num_ids, i64 total_items, i64 chunk_bytes) {                                      \
    gather_scatter<V>(tensors, seg_tensors, call, num_segs, num_ids, total_items, chunk_bytes);              \
  }

ENTRY(kv_gather_scatter_v16, V16)
ENTRY(kv_gather_scatter_v8, V8)
ENTRY(kv_gather_scatter_v4, unsigned int)
ENTRY(kv_gather_scatter_v1, unsigned char)
