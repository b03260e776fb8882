/* The CUDA backend table. backend_cuda() sets up the device context once per process (device
 * local_rank % count, one stream, cuBLAS + cuBLASLt handles and their workspace) and returns one of
 * two static tables: bf16 compute (x_size 2) or fp32 compute (x_size 4, for parity runs). Both
 * tables point at the same kernels instantiated for the two element types. */
#include "adamw.cuh"
#include "attention.cuh"
#include "attention_tc.cuh"
#include "elementwise.cuh"
#include "embedding.cuh"
#include "expert_matmul.cuh"
#include "loss.cuh"
#include "matmul.cuh"
#include "memory.cuh"
#include "moe_rows.cuh"
#include "rmsnorm.cuh"
#include "rope.cuh"
#include "router.cuh"
#include "moe_route.cuh"
#include "swiglu.cuh"
#include "env_flag.h"
#include "matmul_tune.cuh"
#include "moe_timeline.h"

#include <string.h>

struct cuda_ctx g_cuda;

enum { WORKSPACE_BYTES = 32 << 20 };

/* Dense bf16 tensor-core peak for MFU, and the fp32 (non-tensor) rate: H100/H200 (SXM) and A100;
 * unknown (0) on other GPUs. The hardware's peak, also when MT_FORCE_SM80 takes the sm_80 paths. */
static double peak_flops(bool fp32, const cudaDeviceProp *p)
{
    if (p->major == 9 && p->minor == 0) return fp32 ? 67e12 : 989e12;
    if (p->major == 8 && p->minor == 0) return fp32 ? 19.5e12 : 312e12;
    return 0.0;
}

template <typename T> static struct backend make_table(double peak)
{
    struct backend b;
    memset(&b, 0, sizeof b);
    b.name = "cuda";
    b.x_size = sizeof(T);
    b.peak_flops = peak;
    b.alloc = cu_alloc;
    b.free = cu_free;
    b.zero = cu_zero;
    b.copy = cu_copy;
    b.copy_aside = cu_copy_aside;
    b.copy_aside_join = cu_copy_aside_join;
    b.upload = cu_upload;
    b.download = cu_download;
    b.sync = cu_sync;
    b.device_used = cu_device_used;
    b.cast_f32_to_x = cu_cast_f32_to_x<T>;
    b.cast_x_to_f32 = cu_cast_x_to_f32<T>;
    b.add_inplace = cu_add_inplace<T>;
    b.scale_f32 = cu_scale_f32;
    b.add_f32 = cu_add_f32;
    b.sumsq_f32 = cu_sumsq_f32;
    b.embedding_forward = cu_embedding_forward<T>;
    b.embedding_backward = cu_embedding_backward<T>;
    b.rmsnorm_forward = cu_rmsnorm_forward<T>;
    b.rmsnorm_backward = cu_rmsnorm_backward<T>;
    b.matmul_forward = cu_matmul_forward<T>;
    b.matmul_forward_residual = cu_matmul_forward_residual<T>;
    b.matmul_backward = cu_matmul_backward<T>;
    b.matmul2_forward = cu_matmul2_forward<T>;
    b.matmul2_backward = cu_matmul2_backward<T>;
    b.router_matmul_forward = cu_router_matmul_forward<T>;
    b.router_matmul_backward = cu_router_matmul_backward<T>;
    b.rope_forward = cu_rope_forward<T>;
    b.rope_backward = cu_rope_backward<T>;
    b.rmsnorm_rope_forward = cu_rmsnorm_rope_forward<T>;
    b.rmsnorm_rope_backward = cu_rmsnorm_rope_backward<T>;
    b.attention_forward = cu_attention_tc_forward<T>;   /* bf16: tensor cores; fp32: attention.cu */
    b.attention_backward = cu_attention_tc_backward<T>;
    b.router_forward = cu_router_forward;
    b.router_backward = cu_router_backward;
    b.router_gather_weights = cu_router_gather_weights;
    b.router_stats = cu_router_stats;
    b.aux_grad_from_stats = cu_aux_grad_from_stats;
    b.moe_route_plan = cu_moe_route_plan;
    b.moe_pair_plan = cu_moe_pair_plan;
    b.moe_rows_cap = cu_moe_rows_cap;
    b.moe_rows_split = cu_moe_rows_split;
    b.gather_f32 = cu_gather_f32;
    b.gather_rows = cu_gather_rows<T>;
    b.gather_rows_part = cu_gather_rows_part<T>;
    b.gather_rows_backward = cu_gather_rows_backward<T>;
    b.dispatch_rows = cu_dispatch_rows<T>;
    b.moe_combine_forward = cu_moe_combine_forward<T>;
    b.moe_combine_backward = cu_moe_combine_backward<T>;
    b.expert_matmul_forward = cu_expert_matmul_forward<T>;
    b.expert_matmul_backward = cu_expert_matmul_backward<T>;
    b.expert_matmul_wgrad_sets = cu_expert_matmul_wgrad_sets<T>;
    b.expert_matmul_wgrad_part = cu_expert_matmul_wgrad_part<T>;
    b.swiglu_forward = cu_swiglu_forward<T>;
    b.swiglu_backward = cu_swiglu_backward<T>;
    b.cross_entropy_forward = cu_cross_entropy_forward<T>;
    b.cross_entropy_backward = cu_cross_entropy_backward<T>;
    b.cross_entropy_fused = cu_cross_entropy_fused<T>;
    b.adamw_update = cu_adamw_update<T>;
    b.adamw_update_m16 = cu_adamw_update_m16<T>;
    b.adamw_update_multi = cu_adamw_update_multi<T>;
    return b;
}

static struct backend table_bf16, table_fp32;

/* MT_MOE_TIMELINE's clock: events on the compute stream (NULL) or the stream given */
static void *event_record(void *stream)
{
    cudaEvent_t ev;
    CUDA_CHECK(cudaEventCreate(&ev));
    CUDA_CHECK(cudaEventRecord(ev, stream ? (cudaStream_t)stream : g_cuda.stream));
    return (void *)ev;
}

static double event_ms(void *from, void *to)
{
    float ms = 0;
    CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)to));
    CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)from));
    CUDA_CHECK(cudaEventElapsedTime(&ms, (cudaEvent_t)from, (cudaEvent_t)to));
    return ms;
}

static void event_release(void *ev) { CUDA_CHECK(cudaEventDestroy((cudaEvent_t)ev)); }

static const struct moe_timeline_clock event_clock = {1, event_record, event_ms, event_release};

static void context_init(int local_rank, int count)
{
    g_cuda.device = local_rank % count;
    CUDA_CHECK(cudaSetDevice(g_cuda.device));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, g_cuda.device));
    g_cuda.num_sms = prop.multiProcessorCount;
    /* the build holds sm_90a machine code for the Hopper kernels, which runs on 9.0 only */
    g_cuda.hopper = prop.major == 9 && prop.minor == 0 && !mt_env_flag("MT_FORCE_SM80");
    /* our kernels scheduled as the grid before them exits (launch.cuh); MT_PDL=0 turns it off */
    static const char *const off_on[] = {"0", "1"};
    g_cuda.pdl = prop.major >= 9 && mt_env_choice("MT_PDL", off_on, 2, 1) == 1;
    /* the 7-product attention backward, which needs no dS scratch (same bits) */
    if (mt_env_flag("MT_ATTN_BWD_RECOMPUTE")) attention_tc_set_bwd_variant(1 + ATTN_BWD_KINDS * 1);
    (void)lt_tune_level(); /* a bad MT_GEMM_TUNE stops every rank here, not in a step */
    CUDA_CHECK(cudaStreamCreateWithFlags(&g_cuda.stream, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&g_cuda.blas));
    CUBLAS_CHECK(cublasSetStream(g_cuda.blas, g_cuda.stream));
    CUBLAS_CHECK(cublasLtCreate(&g_cuda.lt));
    g_cuda.workspace_bytes = WORKSPACE_BYTES;
    CUDA_CHECK(cudaMalloc(&g_cuda.workspace, g_cuda.workspace_bytes));
    CUBLAS_CHECK(cublasSetWorkspace(g_cuda.blas, g_cuda.workspace, g_cuda.workspace_bytes));
    table_bf16 = make_table<bf16>(peak_flops(false, &prop));
    table_fp32 = make_table<float>(peak_flops(true, &prop));
    table_bf16.mem_bytes = table_fp32.mem_bytes = (double)prop.totalGlobalMem;
    moe_timeline_set_clock(&event_clock);
    g_cuda.ready = true;
}

extern "C" const struct backend *backend_cuda(bool fp32, int local_rank)
{
    if (!g_cuda.ready) {
        int count = 0;
        if (cudaGetDeviceCount(&count) != cudaSuccess || count <= 0) {
            (void)cudaGetLastError(); /* no driver or no device: the CPU backend takes over */
            return NULL;
        }
        MT_CHECK(local_rank >= 0, "backend_cuda: negative local rank %d", local_rank);
        context_init(local_rank, count);
    }
    return fp32 ? &table_fp32 : &table_bf16;
}
