/* Shared by every CUDA source file: the checked-call macros, the backend's device context (one stream,
 * the cuBLAS/cuBLASLt handles and their workspace), grow-only scratch buffers, the element-type
 * helpers that let each kernel be written once as a template on T (float or __nv_bfloat16), and
 * deterministic warp/block reductions.
 *
 * Every op runs on g_cuda.stream; nothing here synchronises except where ops.h says an op waits. */
#ifndef MT_CUDA_COMMON_CUH
#define MT_CUDA_COMMON_CUH

#define OMPI_SKIP_MPICXX 1 /* comm.h includes mpi.h: keep Open MPI's C++ bindings out */
#define MPICH_SKIP_MPICXX 1

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* common.h spells the C11 keyword _Noreturn, which nvcc's C++ front end does not accept. */
#define _Noreturn __attribute__((noreturn))
extern "C" {
#include "common.h"
#include "mem_track.h"
#include "ops.h"
}
#undef _Noreturn

typedef __nv_bfloat16 bf16;

/* ---------------------------------------------------------------- checked calls
 * Each prints the call, file:line and rank (mt_fatal) with the library's own message, then aborts
 * every rank. */
#define CUDA_CHECK(call)                                                                        \
    do {                                                                                        \
        cudaError_t mt_ce_ = (call);                                                            \
        if (mt_ce_ != cudaSuccess)                                                              \
            mt_fatal("%s: CUDA error %s: %s", #call, cudaGetErrorName(mt_ce_),                 \
                     cudaGetErrorString(mt_ce_));                                               \
    } while (0)

#define CUBLAS_CHECK(call)                                                                      \
    do {                                                                                        \
        cublasStatus_t mt_cs_ = (call);                                                         \
        if (mt_cs_ != CUBLAS_STATUS_SUCCESS)                                                    \
            mt_fatal("%s: cuBLAS error %d: %s", #call, (int)mt_cs_,                            \
                     cublasGetStatusString(mt_cs_));                                            \
    } while (0)

#define NCCL_CHECK(call)                                                                        \
    do {                                                                                        \
        ncclResult_t mt_nr_ = (call);                                                           \
        if (mt_nr_ != ncclSuccess)                                                              \
            mt_fatal("%s: NCCL error %d: %s (%s)", #call, (int)mt_nr_,                         \
                     ncclGetErrorString(mt_nr_), ncclGetLastError(NULL));                      \
    } while (0)

/* After every kernel launch: a bad configuration or an earlier asynchronous fault shows here. */
#define CUDA_LAUNCH_CHECK(what) CUDA_CHECK(cudaGetLastError())

/* ---------------------------------------------------------------- device context */
struct cuda_ctx {
    bool ready;
    int device;
    int num_sms;
    /* take the Hopper kernels (wgmma, TMA): compute capability 9.0 and MT_FORCE_SM80 unset.
     * Otherwise every op takes its sm_80 path (mma.sync attention, cuBLAS expert GEMMs). */
    bool hopper;
    /* launch our kernels with programmatic dependent launch (launch.cuh): 9.0+, unless MT_PDL=0 */
    bool pdl;
    cudaStream_t stream;
    cublasHandle_t blas;
    cublasLtHandle_t lt;
    void *workspace; /* shared by cuBLAS and cuBLASLt: every call is ordered on the one stream */
    size_t workspace_bytes;
};
extern struct cuda_ctx g_cuda; /* backend_cuda.cu */

/* Grow-only device scratch, one buffer per slot. Reuse across ops is safe because every op is
 * ordered on the one stream; an op never holds two pointers from the same slot. Growing frees the
 * old buffer after a stream sync. */
enum cuda_scratch_slot {
    SCRATCH_REDUCE,     /* sumsq partials, column-sum partials */
    SCRATCH_SORT_KEYS,  /* scatter: sorted destination rows */
    SCRATCH_SORT_VALS,  /* scatter: source rows, iota then sorted */
    SCRATCH_SORT_TEMP,  /* scatter: CUB temporary storage */
    SCRATCH_ATTN,       /* attention backward: rowsum(dO ⊙ O) */
    SCRATCH_ATTN_DS,    /* attention backward: the dS tiles, when the caller lends no memory */
    SCRATCH_ATTN_DKDV,  /* attention backward: the dK/dV parts' sums, when the lent memory is short */
    SCRATCH_HIST,       /* router_stats: integer counts */
    SCRATCH_CHUNK_HIST, /* moe route/pair plans: per-chunk counts [chunks, n + 1] */
    SCRATCH_ROUTER_PARTS, /* router_matmul_backward: dlogits as three bf16 parts [T, 3E] */
    SCRATCH_ROUTER_W3,    /* router_matmul_backward: the router weight stacked three times */
    SCRATCH_ROUTER_DW3,   /* router_matmul_backward: the three parts' fp32 dw products [3, E, H] */
    SCRATCH_ADAMW,        /* adamw_update_multi: the segment table */
    SCRATCH_GEMM_PTRS,    /* expert_matmul on cuBLAS: the grouped call's A, B, C pointer arrays */
    SCRATCH_GG_SUMSQ,     /* grouped wgrad: each dw tile's sum of squares */
    SCRATCH_COUNT
};
void *cuda_scratch(enum cuda_scratch_slot slot, size_t bytes);

/* Launch helpers: a 1-D grid for n items at `block` threads, capped (kernels use grid-stride
 * loops, so the cap only limits parallelism, never coverage). */
static inline unsigned cuda_grid(size_t n, int block)
{
    size_t g = (n + (size_t)block - 1) / (size_t)block;
    if (g < 1) g = 1;
    if (g > 65536) g = 65536;
    return (unsigned)g;
}

/* ---------------------------------------------------------------- element types
 * to_f / from_f convert a compute-dtype element to and from fp32 (round to nearest even for
 * bf16); round_x rounds an fp32 value to the compute dtype and back (a no-op for float), used at
 * the bf16 rounding points of spec §7. */
template <typename T> struct xtype;
template <> struct xtype<float> {
    static constexpr cudaDataType_t cuda = CUDA_R_32F;
};
template <> struct xtype<bf16> {
    static constexpr cudaDataType_t cuda = CUDA_R_16BF;
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }

template <typename T> __device__ __forceinline__ float round_x(float x) { return to_f(from_f<T>(x)); }

/* ---------------------------------------------------------------- 8-element vectors
 * Memory-bound kernels move rows in chunks of 8 consecutive elements: one 16-byte access in bf16,
 * two in fp32, so one chunk index serves both dtypes. pack8<T> holds a chunk as raw words (half
 * the registers of 8 floats in bf16); ld8/st8 need a 16-byte aligned address, which callers check
 * once per op with aligned16 (row lengths a multiple of 8 keep every row aligned). */
template <typename T> struct pack8;
template <> struct pack8<bf16> {
    uint4 v;
};
template <> struct pack8<float> {
    uint4 a, b;
};

static inline bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

__device__ __forceinline__ pack8<bf16> ld8(const bf16 *p)
{
    pack8<bf16> r;
    r.v = *reinterpret_cast<const uint4 *>(p);
    return r;
}
__device__ __forceinline__ pack8<float> ld8(const float *p)
{
    pack8<float> r;
    r.a = reinterpret_cast<const uint4 *>(p)[0];
    r.b = reinterpret_cast<const uint4 *>(p)[1];
    return r;
}
__device__ __forceinline__ void st8(bf16 *p, const pack8<bf16> &x) { *reinterpret_cast<uint4 *>(p) = x.v; }
__device__ __forceinline__ void st8(float *p, const pack8<float> &x)
{
    reinterpret_cast<uint4 *>(p)[0] = x.a;
    reinterpret_cast<uint4 *>(p)[1] = x.b;
}

/* a bf16 is the high half of the fp32 with the same bits: widening is a shift or a mask */
__device__ __forceinline__ void unpack8(const pack8<bf16> &x, float (&f)[8])
{
    const uint32_t w[4] = {x.v.x, x.v.y, x.v.z, x.v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void unpack8(const pack8<float> &x, float (&f)[8])
{
    f[0] = __uint_as_float(x.a.x), f[1] = __uint_as_float(x.a.y);
    f[2] = __uint_as_float(x.a.z), f[3] = __uint_as_float(x.a.w);
    f[4] = __uint_as_float(x.b.x), f[5] = __uint_as_float(x.b.y);
    f[6] = __uint_as_float(x.b.z), f[7] = __uint_as_float(x.b.w);
}

/* rounds to the element type as from_f does (nearest even) */
template <typename T> __device__ __forceinline__ pack8<T> pack8_of(const float (&f)[8]);
template <> __device__ __forceinline__ pack8<bf16> pack8_of<bf16>(const float (&f)[8])
{
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t *>(&h);
    }
    pack8<bf16> r;
    r.v = make_uint4(w[0], w[1], w[2], w[3]);
    return r;
}
template <> __device__ __forceinline__ pack8<float> pack8_of<float>(const float (&f)[8])
{
    pack8<float> r;
    r.a = make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                     __float_as_uint(f[3]));
    r.b = make_uint4(__float_as_uint(f[4]), __float_as_uint(f[5]), __float_as_uint(f[6]),
                     __float_as_uint(f[7]));
    return r;
}

/* the chunk of the lane o away (lane ^ o), among the lanes of mask, which all call it */
__device__ __forceinline__ pack8<bf16> shfl_xor8(unsigned mask, const pack8<bf16> &x, int o)
{
    pack8<bf16> r;
    r.v = make_uint4(__shfl_xor_sync(mask, x.v.x, o), __shfl_xor_sync(mask, x.v.y, o),
                     __shfl_xor_sync(mask, x.v.z, o), __shfl_xor_sync(mask, x.v.w, o));
    return r;
}
__device__ __forceinline__ pack8<float> shfl_xor8(unsigned mask, const pack8<float> &x, int o)
{
    pack8<float> r;
    r.a = make_uint4(__shfl_xor_sync(mask, x.a.x, o), __shfl_xor_sync(mask, x.a.y, o),
                     __shfl_xor_sync(mask, x.a.z, o), __shfl_xor_sync(mask, x.a.w, o));
    r.b = make_uint4(__shfl_xor_sync(mask, x.b.x, o), __shfl_xor_sync(mask, x.b.y, o),
                     __shfl_xor_sync(mask, x.b.z, o), __shfl_xor_sync(mask, x.b.w, o));
    return r;
}

template <typename T> __device__ __forceinline__ void load8f(const T *p, float (&f)[8]) { unpack8(ld8(p), f); }
template <typename T> __device__ __forceinline__ void store8f(T *p, const float (&f)[8])
{
    st8(p, pack8_of<T>(f));
}

/* ---------------------------------------------------------------- approximate maths */
/* e^x as __expf computes it (x·log2e rounded, then the MUFU's 2^y) but with subnormal results
 * flushed to zero. Plain __expf (ex2.approx without .ftz) wraps each exponential in a compare and
 * two predicated multiplies for results under 2^-126, issue slots that made the fused loss kernel
 * issue-bound (Nsight Compute: 76% of issue slots busy at 53% of the DRAM peak). Above 2^-126 the
 * two give the same bits. */
__device__ __forceinline__ float exp_ftz(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(__fmul_rn(x, 1.44269504088896341f)));
    return y;
}

/* 1/x from the MUFU alone (about 1 ulp; 0 for |x| > 2^126) */
__device__ __forceinline__ float rcp_approx(float x)
{
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* ---------------------------------------------------------------- reductions
 * Fixed shuffle trees: the result depends only on the block shape, never on timing. */
template <typename V> __device__ __forceinline__ V warp_sum(V v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over aligned groups of G lanes (G a power of two, at most 32), returned to every lane of the
 * group; all 32 lanes of the warp must call it. */
template <int G, typename V> __device__ __forceinline__ V group_sum(V v)
{
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
 * `sh` is 32 elements of shared memory; the leading barrier lets callers reuse it back to back. */
template <typename V> __device__ V block_sum(V v, V *sh)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : (V)0;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float *sh)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : -INFINITY;
    return warp_max(v);
}

#include "launch.cuh" /* needs g_cuda and CUDA_CHECK */

#endif
