// Page gather/scatter between L2 (pinned host memory) and L1 (device memory).
//
// Compiled at run time through NVRTC (CuPy RawModule); no headers, no build step.
//
// A transfer moves, for every selected (layer, k) slot lc in [lc_begin, lc_begin + n_lc) and every
// page pair i in [0, n_pages), one "piece" of piece_vecs vectors of type V:
//
//   device address  = dev_ptrs[lc] + dev_idx[i] * piece_bytes        (L1: kv[layer][k] is [P, S, H, D])
//   host address    = host_base + host_idx[i] * host_page_stride
//                               + lc * host_lc_stride               (L2: page-first or layer-first)
//
//   page-first  [P, L, C, S, H, D]: host_page_stride = L*C*piece_bytes, host_lc_stride = piece_bytes
//   layer-first [L, C, P, S, H, D]: host_page_stride = piece_bytes,     host_lc_stride = P*piece_bytes
//
// to_host = 0 reads host and writes device (load); to_host = 1 reads device and writes host (backup).
// The host base is the device-visible address of pinned (or cudaHostRegister'ed) memory, so the
// kernel reads and writes host memory directly over the link.
//
// Work is the flat range [0, n_lc * n_pages * piece_vecs) of vectors, walked with a grid stride, so any
// grid size is correct and consecutive threads touch consecutive 16-byte vectors of one piece
// (coalesced). Each thread issues UNROLL independent loads before its stores, keeping enough reads in
// flight over PCIe for a small grid (2 blocks x 1024 threads) to fill the link. All offsets are 64-bit.
//
// page_load_layers_W: a whole layer-by-layer load in one launch. Blocks walk the layers in order and,
// after each layer, count themselves done on counters[layer]; the last block of a layer resets the
// counter and publishes flags[layer] = seq. A consumer stream waits for flags[layer] >= seq with a
// stream memory wait (cuStreamWaitValue32), so compute on layer i starts as soon as layer i has landed
// without a host round trip, and the copy needs to win SMs from running compute only once, not once
// per layer. seq grows by one per load; the launches of one stream never overlap, so the counters are
// zero at every launch.
//
// One entry point per vector width: 16, 8, 4, 2 and 1 bytes. The caller picks the widest width that
// divides the piece size, every base address and both host strides, so the widths are a pure speed
// choice: the 1-byte kernel is correct for any piece size and alignment.

typedef long long i64;
typedef unsigned long long u64;

#define PAGE_COPY_UNROLL 8
#define PAGE_COPY_MAX_THREADS 1024  // blocks of up to 1024 threads: registers capped to fit

template <typename V>
__device__ __forceinline__ void page_copy_impl(const u64* __restrict__ dev_ptrs, u64 host_base,
                                               i64 host_page_stride, i64 host_lc_stride,
                                               const i64* __restrict__ dev_idx,
                                               const i64* __restrict__ host_idx, i64 n_pages,
                                               int lc_begin, int n_lc, i64 piece_vecs, int to_host) {
    const i64 per_lc = n_pages * piece_vecs;
    const i64 total = per_lc * (i64)n_lc;
    const i64 stride = (i64)gridDim.x * (i64)blockDim.x;
    for (i64 v = (i64)blockIdx.x * blockDim.x + threadIdx.x; v < total; v += stride * PAGE_COPY_UNROLL) {
        V buf[PAGE_COPY_UNROLL];
        V* dst[PAGE_COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < PAGE_COPY_UNROLL; ++u) {
            const i64 w = v + (i64)u * stride;
            dst[u] = 0;
            if (w < total) {
                const i64 lc_off = w / per_lc;
                const i64 r = w - lc_off * per_lc;
                const i64 p = r / piece_vecs;
                const i64 e = r - p * piece_vecs;
                const i64 lc = (i64)lc_begin + lc_off;
                V* dptr = reinterpret_cast<V*>(dev_ptrs[lc]) + dev_idx[p] * piece_vecs + e;
                V* hptr = reinterpret_cast<V*>(host_base + (u64)(host_idx[p] * host_page_stride) +
                                               (u64)(lc * host_lc_stride)) + e;
                const V* src = to_host ? dptr : hptr;
                dst[u] = to_host ? hptr : dptr;
                buf[u] = *src;
            }
        }
#pragma unroll
        for (int u = 0; u < PAGE_COPY_UNROLL; ++u) {
            if (dst[u] != 0) {
                *dst[u] = buf[u];
            }
        }
    }
}

#define DEFINE_PAGE_COPY(NAME, V)                                                                     \
    extern "C" __global__ void __launch_bounds__(PAGE_COPY_MAX_THREADS)                             \
    NAME(const u64* __restrict__ dev_ptrs, u64 host_base,                                             \
                                    i64 host_page_stride, i64 host_lc_stride,                        \
                                    const i64* __restrict__ dev_idx, const i64* __restrict__ host_idx, \
                                    i64 n_pages, int lc_begin, int n_lc, i64 piece_vecs, int to_host) { \
        page_copy_impl<V>(dev_ptrs, host_base, host_page_stride, host_lc_stride, dev_idx, host_idx,  \
                          n_pages, lc_begin, n_lc, piece_vecs, to_host);                             \
    }

DEFINE_PAGE_COPY(page_copy_16, uint4)
DEFINE_PAGE_COPY(page_copy_8, uint2)
DEFINE_PAGE_COPY(page_copy_4, unsigned int)
DEFINE_PAGE_COPY(page_copy_2, unsigned short)
DEFINE_PAGE_COPY(page_copy_1, unsigned char)

template <typename V>
__device__ __forceinline__ void page_load_layers_impl(const u64* __restrict__ dev_ptrs, u64 host_base,
                                                      i64 host_page_stride, i64 host_lc_stride,
                                                      const i64* __restrict__ dev_idx,
                                                      const i64* __restrict__ host_idx, i64 n_pages,
                                                      int n_layers, int kv_count, i64 piece_vecs,
                                                      unsigned int* counters, unsigned int* flags,
                                                      unsigned int seq) {
    for (int layer = 0; layer < n_layers; ++layer) {
        page_copy_impl<V>(dev_ptrs, host_base, host_page_stride, host_lc_stride, dev_idx, host_idx, n_pages,
                          layer * kv_count, kv_count, piece_vecs, 0);
        __threadfence();  // this thread's stores of the layer are visible device-wide ...
        __syncthreads();  // ... before thread 0 counts the block done
        if (threadIdx.x == 0) {
            const unsigned int prev = atomicAdd(&counters[layer], 1u);
            if (prev == gridDim.x - 1) {
                counters[layer] = 0u;
                __threadfence_system();
                atomicExch(&flags[layer], seq);
            }
        }
    }
}

#define DEFINE_PAGE_LOAD_LAYERS(NAME, V)                                                              \
    extern "C" __global__ void __launch_bounds__(PAGE_COPY_MAX_THREADS)                             \
    NAME(const u64* __restrict__ dev_ptrs, u64 host_base,                                             \
                                    i64 host_page_stride, i64 host_lc_stride,                        \
                                    const i64* __restrict__ dev_idx, const i64* __restrict__ host_idx, \
                                    i64 n_pages, int n_layers, int kv_count, i64 piece_vecs,         \
                                    unsigned int* counters, unsigned int* flags, unsigned int seq) {  \
        page_load_layers_impl<V>(dev_ptrs, host_base, host_page_stride, host_lc_stride, dev_idx,     \
                                 host_idx, n_pages, n_layers, kv_count, piece_vecs, counters, flags, seq); \
    }

DEFINE_PAGE_LOAD_LAYERS(page_load_layers_16, uint4)
DEFINE_PAGE_LOAD_LAYERS(page_load_layers_8, uint2)
DEFINE_PAGE_LOAD_LAYERS(page_load_layers_4, unsigned int)
DEFINE_PAGE_LOAD_LAYERS(page_load_layers_2, unsigned short)
DEFINE_PAGE_LOAD_LAYERS(page_load_layers_1, unsigned char)
