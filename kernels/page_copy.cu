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
// Bit 1 of to_host (PAGE_COPY_ITEMS) makes a backup walk work items like a load does: the staged path sets
// it, since its "host" side is a device staging slot, where the item walk is bound by memory and the
// flat walk's per-vector divisions are not (the gentleness on compute that the flat walk buys only
// matters when writing host memory over the link). Such a gather reads L1 with evict-first loads
// (__ldcs), so the staging slots it writes stay in L2 until the copy engine reads them: a device-to-host
// DMA reading L2 instead of HBM keeps its rate while gathers run beside it (H200, 4 KiB pieces, with
// 8 MiB slots: 0.92 -> 0.95 of the link).
// The host base is the device-visible address of pinned (or cudaHostRegister'ed) memory, so the
// kernel reads and writes host memory directly over the link.
//
// Loads: work is the list of (piece, 32 * UNROLL-vector sub-range) items, walked by warps with a grid
// stride, so any grid size is correct. A warp computes an item's two addresses once and its lanes copy
// consecutive vectors (coalesced, no per-vector index arithmetic). Each lane issues UNROLL independent
// loads before its stores, keeping enough reads in flight over PCIe for a small grid to fill the link,
// and leaving a device-to-device copy (the staged path) bound by memory, not by integer division.
// Backups walk the flat range of vectors with a grid stride instead (page_copy_vectors: gentler on
// concurrent compute when writing host memory). All offsets are 64-bit.
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
#define PAGE_COPY_ITEMS 2  // flag bit of to_host: walk work items in both directions
#define PAGE_COPY_CG 4  // flag bit of to_host: read the source past L1 (it may change during the launch)
#define PAGE_COPY_MAX_THREADS 1024  // blocks of up to 1024 threads: registers capped to fit

template <typename V>
__device__ __forceinline__ void page_copy_vectors(const u64* __restrict__ dev_ptrs, u64 host_base,
                                               i64 host_page_stride, i64 host_lc_stride,
                                               const i64* __restrict__ dev_idx,
                                               const i64* __restrict__ host_idx, i64 n_pages,
                                               int lc_begin, int n_lc, i64 piece_vecs, int to_host) {
    // Flat range of vectors with a grid stride: each thread's UNROLL vectors lie a grid apart, in
    // different pieces. Used for backups: measured next to a GEMM, these scattered writes to host
    // memory slowed it far less (+6%) than the item walk below (+41%) at the same bandwidth.
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

template <typename V>
__device__ __forceinline__ void page_copy_items(const u64* __restrict__ dev_ptrs, u64 host_base,
                                               i64 host_page_stride, i64 host_lc_stride,
                                               const i64* __restrict__ dev_idx,
                                               const i64* __restrict__ host_idx, i64 n_pages,
                                               int lc_begin, int n_lc, i64 piece_vecs, int to_host) {
    // Work items are (piece, sub-range of 32 * UNROLL vectors) pairs, walked by warps with a grid stride.
    // A warp computes its item's two addresses once (two divisions per item, not per vector); each lane
    // then issues up to UNROLL independent loads of consecutive-by-lane vectors before its stores.
    const i64 chunk = 32 * PAGE_COPY_UNROLL;
    const int lane = threadIdx.x & 31;
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 n_warps = ((i64)gridDim.x * blockDim.x) >> 5;
    const i64 n_sub = (piece_vecs + chunk - 1) / chunk;
    const i64 n_items = n_pages * (i64)n_lc * n_sub;
    const bool cg = (to_host & PAGE_COPY_CG) != 0;
    to_host &= 1;
    for (i64 it = warp; it < n_items; it += n_warps) {
        const i64 pc = it / n_sub;
        const i64 e0 = (it - pc * n_sub) * chunk + lane;
        const i64 lc_off = pc / n_pages;
        const i64 p = pc - lc_off * n_pages;
        const i64 lc = (i64)lc_begin + lc_off;
        V* dptr = reinterpret_cast<V*>(dev_ptrs[lc]) + dev_idx[p] * piece_vecs;
        V* hptr = reinterpret_cast<V*>(host_base + (u64)(host_idx[p] * host_page_stride) +
                                       (u64)(lc * host_lc_stride));
        const V* src = to_host ? dptr : hptr;
        V* dst = to_host ? hptr : dptr;
        V buf[PAGE_COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < PAGE_COPY_UNROLL; ++u) {
            const i64 i = e0 + (i64)u * 32;
            if (i < piece_vecs) {
                // A gather into a staging slot (to_host here only in the staged path) reads L1 pages once:
                // evict-first loads keep them from pushing out of L2 the slots that DMA reads next.
                // A resident staged scatter reads slots the copy engine refills during the launch: past L1.
                buf[u] = to_host ? __ldcs(src + i) : (cg ? __ldcg(src + i) : src[i]);
            }
        }
#pragma unroll
        for (int u = 0; u < PAGE_COPY_UNROLL; ++u) {
            const i64 i = e0 + (i64)u * 32;
            if (i < piece_vecs) {
                dst[i] = buf[u];
            }
        }
    }
}

template <typename V>
__device__ __forceinline__ void page_copy_impl(const u64* __restrict__ dev_ptrs, u64 host_base,
                                               i64 host_page_stride, i64 host_lc_stride,
                                               const i64* __restrict__ dev_idx,
                                               const i64* __restrict__ host_idx, i64 n_pages,
                                               int lc_begin, int n_lc, i64 piece_vecs, int to_host) {
    if ((to_host & 1) && !(to_host & PAGE_COPY_ITEMS)) {
        page_copy_vectors<V>(dev_ptrs, host_base, host_page_stride, host_lc_stride, dev_idx, host_idx, n_pages,
                             lc_begin, n_lc, piece_vecs, 1);
    } else {
        page_copy_items<V>(dev_ptrs, host_base, host_page_stride, host_lc_stride, dev_idx, host_idx, n_pages,
                           lc_begin, n_lc, piece_vecs, to_host & (1 | PAGE_COPY_CG));
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

// staged_resident_W: the device-side half of a whole staged transfer in ONE launch that stays resident on
// a few SMs, instead of one launch per staging chunk. Per-chunk launches must each win SMs from running
// compute, and a GEMM's persistent kernels hold every SM until they end (~1.4 ms for a bf16 8192^3 GEMM on
// an H200), so the scatter of each chunk can wait that long; resident blocks never give their SMs back
// until the transfer is done.
//
// Chunk c is desc[c * STAGED_DESC_WORDS ...] = {slot, wait, done, slot address, index offset, pages,
// lc_begin, n_lc}. The blocks take the chunks in order; for each one, thread 0 of every block spins
// until slot_ready[slot] >= wait (the copy engine's stream writes slot_ready with cuStreamWriteValue32:
// after a load's DMA into the slot, or after a backup's DMA out of it), then the grid copies the chunk
// between the slot and the L1 pool exactly as page_copy does (slot reads of a load bypass L1: the slot
// is refilled during the launch). Each block then counts itself done on counters[slot]; the last one
// resets the counter, publishes slot_done[slot] = done (the DMA stream waits for it with
// cuStreamWaitValue32 before reusing the slot, or before a backup's DMA out of it), and, for loads,
// layer_flags[l] = layer_seq for every layer l whose layer_chunk[l] is c. A block finishes chunk c before
// it starts c + 1, so when chunk c's count completes, every earlier chunk's data is in place as well.
// Counters are zero at launch and left zero; launches on one stream never overlap.
#define STAGED_DESC_WORDS 8

template <typename V>
__device__ __forceinline__ void staged_resident_impl(const u64* __restrict__ dev_ptrs, i64 piece_vecs,
                                                     const i64* __restrict__ desc, int n_chunks,
                                                     const i64* __restrict__ dev_idx,
                                                     const i64* __restrict__ pos_idx, unsigned int* slot_ready,
                                                     unsigned int* slot_done, unsigned int* counters,
                                                     const int* __restrict__ layer_chunk, int n_layers,
                                                     unsigned int* layer_flags, unsigned int layer_seq,
                                                     int to_host) {
    const i64 piece_bytes = piece_vecs * (i64)sizeof(V);
    for (int c = 0; c < n_chunks; ++c) {
        const i64* d = desc + (i64)c * STAGED_DESC_WORDS;
        const int slot = (int)d[0];
        if (threadIdx.x == 0) {
            const volatile unsigned int* ready = slot_ready + slot;
            const unsigned int want = (unsigned int)d[1];
            while (*ready < want) {
                __nanosleep(128);
            }
            __threadfence();
        }
        __syncthreads();
        const int lc_begin = (int)d[6];
        const int n_lc = (int)d[7];
        const u64 base = (u64)d[3] - (u64)((i64)lc_begin * piece_bytes);  // the copy adds lc * piece back
        page_copy_items<V>(dev_ptrs, base, (i64)n_lc * piece_bytes, piece_bytes, dev_idx + d[4], pos_idx, d[5],
                           lc_begin, n_lc, piece_vecs, to_host ? 1 : PAGE_COPY_CG);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned int prev = atomicAdd(&counters[slot], 1u);
            if (prev == gridDim.x - 1) {
                counters[slot] = 0u;
                __threadfence_system();
                atomicExch(&slot_done[slot], (unsigned int)d[2]);
                for (int l = 0; l < n_layers; ++l) {
                    if (layer_chunk[l] == c) {
                        atomicExch(&layer_flags[l], layer_seq);
                    }
                }
            }
        }
    }
}

#define DEFINE_STAGED_RESIDENT(NAME, V)                                                               \
    extern "C" __global__ void __launch_bounds__(PAGE_COPY_MAX_THREADS)                             \
    NAME(const u64* __restrict__ dev_ptrs, i64 piece_vecs, const i64* __restrict__ desc, int n_chunks, \
         const i64* __restrict__ dev_idx, const i64* __restrict__ pos_idx, unsigned int* slot_ready,   \
         unsigned int* slot_done, unsigned int* counters, const int* __restrict__ layer_chunk,         \
         int n_layers, unsigned int* layer_flags, unsigned int layer_seq, int to_host) {               \
        staged_resident_impl<V>(dev_ptrs, piece_vecs, desc, n_chunks, dev_idx, pos_idx, slot_ready,      \
                                slot_done, counters, layer_chunk, n_layers, layer_flags, layer_seq, to_host); \
    }

DEFINE_STAGED_RESIDENT(staged_resident_16, uint4)
DEFINE_STAGED_RESIDENT(staged_resident_8, uint2)
DEFINE_STAGED_RESIDENT(staged_resident_4, unsigned int)
DEFINE_STAGED_RESIDENT(staged_resident_2, unsigned short)
DEFINE_STAGED_RESIDENT(staged_resident_1, unsigned char)

// fetch_indices: copy n int64 values from pinned host memory (device-visible address) to device memory
// with the SMs. Index arrays reach the GPU this way rather than by a copy-engine memcpy, which would queue
// behind bulk DMA already in flight in the same direction: a backup submitted during a large load would
// otherwise not start its gather until the load's queued copies had drained.
extern "C" __global__ void fetch_indices(const i64* __restrict__ src, i64* __restrict__ dst, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}
