/* Grouped expert matmul through cuBLAS: one cublasGemmGroupedBatchedEx call per GEMM kind with one
 * group per expert that has rows (the same column-major mapping as matmul.cu), or, where cuBLAS
 * declines that call, a loop of cublasGemmEx. Not cuBLASLt: the row count of each expert changes
 * every step, which would defeat a plan cache keyed by shape. Experts with no rows are skipped:
 * their dw is not touched. In bf16 on Hopper the grouped kernel of grouped_gemm.cu does the work
 * instead wherever it supports the shapes; this is the sm_80 path (A100, MT_FORCE_SM80=1) and
 * fp32's. At ~512 rows an expert one cublasGemmEx fills a fraction of the GPU, so the loop left
 * most SMs idle; the grouped call schedules every expert's tiles together. The offsets are device
 * memory (ops.h); this path downloads them and waits, the grouped kernel does not. */
#include "expert_matmul.cuh"
#include "elementwise.cuh"
#include "grouped_gemm.cuh"
#include "matmul.cuh"

#include <type_traits>
#include <vector>

namespace {

/* the GEMMs of one grouped call (column-major, as cuda_gemm_ex takes them) */
struct gemm_list {
    std::vector<cublasOperation_t> ta, tb;
    std::vector<int> m, n, k, lda, ldb, ldc;
    std::vector<float> alpha, beta;
    std::vector<const void *> ptrs; /* A of every GEMM, then B, then C */
    std::vector<int> one;
    std::vector<const void *> a, b;
    std::vector<void *> c;
    void clear()
    {
        ta.clear(), tb.clear(), m.clear(), n.clear(), k.clear(), lda.clear(), ldb.clear();
        ldc.clear(), alpha.clear(), beta.clear(), a.clear(), b.clear(), c.clear();
    }
    void add(cublasOperation_t ta_, cublasOperation_t tb_, int m_, int n_, int k_, const void *A,
             int lda_, const void *B, int ldb_, void *C, int ldc_, float beta_)
    {
        ta.push_back(ta_), tb.push_back(tb_), m.push_back(m_), n.push_back(n_), k.push_back(k_);
        lda.push_back(lda_), ldb.push_back(ldb_), ldc.push_back(ldc_);
        alpha.push_back(1.0f), beta.push_back(beta_);
        a.push_back(A), b.push_back(B), c.push_back(C);
    }
};

/* cuBLAS refused the grouped call for these types once: loop from then on. [A/B fp32][C fp32] */
bool g_grouped_declined[2][2];

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* One cublasGemmGroupedBatchedEx over the list (each GEMM its own group), or the cublasGemmEx
 * loop. The pointer arrays go to the device through an async copy from pageable memory, which
 * stages them before returning, so the list may be refilled at once. */
void run_gemms(gemm_list &g, cudaDataType_t ab, cudaDataType_t ct)
{
    const int count = (int)g.m.size();
    if (count == 0) return;
    bool &declined = g_grouped_declined[ab == CUDA_R_32F][ct == CUDA_R_32F];
    /* The grouped call only where every GEMM is non-trivial (cuda_gemm_ex handles a zero
     * dimension) and every pointer and leading dimension is 16-byte aligned: on an H100 with cuBLAS
     * 13.0 bf16 weights 2 bytes off alignment made it fault (cudaErrorMisalignedAddress,
     * gpu/expert_matmul_grouped's "unaligned w" case, 2026-11-25) instead of declining. */
    const size_t ab_size = ab == CUDA_R_32F ? 4 : 2, c_size = ct == CUDA_R_32F ? 4 : 2;
    bool plain = true;
    for (int i = 0; i < count && plain; i++)
        plain = g.m[i] > 0 && g.n[i] > 0 && g.k[i] > 0 && aligned16(g.a[i]) && aligned16(g.b[i]) &&
                aligned16(g.c[i]) && (g.lda[i] * ab_size) % 16 == 0 &&
                (g.ldb[i] * ab_size) % 16 == 0 && (g.ldc[i] * c_size) % 16 == 0;
    if (!declined && plain) {
        g.ptrs.clear();
        g.ptrs.insert(g.ptrs.end(), g.a.begin(), g.a.end());
        g.ptrs.insert(g.ptrs.end(), g.b.begin(), g.b.end());
        g.ptrs.insert(g.ptrs.end(), g.c.begin(), g.c.end());
        g.one.assign(count, 1);
        const size_t bytes = g.ptrs.size() * sizeof(void *);
        const void **d = (const void **)cuda_scratch(SCRATCH_GEMM_PTRS, bytes);
        CUDA_CHECK(cudaMemcpyAsync(d, g.ptrs.data(), bytes, cudaMemcpyHostToDevice, g_cuda.stream));
        const cublasStatus_t st = cublasGemmGroupedBatchedEx(
            g_cuda.blas, g.ta.data(), g.tb.data(), g.m.data(), g.n.data(), g.k.data(),
            g.alpha.data(), d, ab, g.lda.data(), d + count, ab, g.ldb.data(), g.beta.data(),
            (void *const *)(d + 2 * count), ct, g.ldc.data(), count, g.one.data(),
            CUBLAS_COMPUTE_32F);
        if (st == CUBLAS_STATUS_SUCCESS) return;
        MT_CHECK(st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE,
                 "cublasGemmGroupedBatchedEx: cuBLAS error %d: %s", (int)st,
                 cublasGetStatusString(st));
        declined = true;
        mt_warn0("expert GEMMs: cuBLAS declined the grouped call (%s); one cublasGemmEx per expert\n",
                 cublasGetStatusString(st));
    }
    for (int i = 0; i < count; i++)
        cuda_gemm_ex(g.ta[i], g.tb[i], g.m[i], g.n[i], g.k[i], g.a[i], g.lda[i], g.b[i], g.ldb[i],
                     ab, g.c[i], g.ldc[i], ct, g.beta[i]);
}

gemm_list g_list;

} // namespace

/* The cuBLAS path needs the offsets on the host: a download, and the wait for it (the grouped
 * kernel reads them where they are). Valid until the next call. */
static const int64_t *offsets_on_host(const int64_t *off_dev, int n_exp)
{
    static std::vector<int64_t> host;
    MT_CHECK(n_exp >= 0, "expert_matmul: %d experts", n_exp);
    host.resize((size_t)n_exp + 1);
    CUDA_CHECK(cudaMemcpyAsync(host.data(), off_dev, ((size_t)n_exp + 1) * sizeof(int64_t),
                               cudaMemcpyDeviceToHost, g_cuda.stream));
    CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
    return host.data();
}

static void check_offsets(const char *what, const int64_t *off, int64_t R, int n_exp)
{
    MT_CHECK(n_exp >= 0 && (n_exp == 0 || off[0] >= 0), "%s: bad expert count or first offset",
             what);
    MT_CHECK(n_exp == 0 || off[n_exp] <= R, "%s: the offsets end at row %lld of %lld", what,
             (long long)off[n_exp], (long long)R);
    for (int e = 0; e < n_exp; e++) {
        MT_CHECK(off[e + 1] >= off[e], "%s: offsets decrease at expert %d (%lld > %lld)", what, e,
                 (long long)off[e], (long long)off[e + 1]);
        MT_CHECK(off[e + 1] - off[e] <= INT32_MAX, "%s: expert %d has too many rows", what, e);
    }
}

template <typename T>
void cu_expert_matmul_forward(void *out, const void *in, const void *w, const int64_t *off_dev,
                              const int64_t *end_dev, int64_t R, int n_exp, int I, int O)
{
    /* bf16: the grouped Hopper kernel, unless the shapes are outside what it handles */
    if (std::is_same<T, bf16>::value && grouped_gemm_forward(out, in, w, off_dev, end_dev, R, n_exp, I, O))
        return;
    const int64_t *off = offsets_on_host(off_dev, n_exp);
    check_offsets("expert_matmul", off, R, n_exp);
    /* each expert's [off[e], end[e]): the ends downloaded beside the offsets */
    static std::vector<int64_t> ends;
    ends.assign(off + 1, off + 1 + n_exp);
    if (end_dev && n_exp > 0) {
        CUDA_CHECK(cudaMemcpyAsync(ends.data(), end_dev, (size_t)n_exp * sizeof(int64_t),
                                   cudaMemcpyDeviceToHost, g_cuda.stream));
        CUDA_CHECK(cudaStreamSynchronize(g_cuda.stream));
        for (int e = 0; e < n_exp; e++)
            MT_CHECK(ends[e] >= off[e] && ends[e] <= off[e + 1],
                     "expert_matmul: expert %d's rows end at %lld, outside [%lld, %lld]", e,
                     (long long)ends[e], (long long)off[e], (long long)off[e + 1]);
    }
    const cudaDataType_t dt = xtype<T>::cuda;
    g_list.clear();
    for (int e = 0; e < n_exp; e++) {
        const int64_t r0 = off[e], n = ends[e] - off[e];
        if (n == 0) continue;
        g_list.add(CUBLAS_OP_T, CUBLAS_OP_N, O, (int)n, I, (const T *)w + (size_t)e * O * I, I,
                   (const T *)in + r0 * I, I, (T *)out + r0 * O, O, 0.0f);
    }
    run_gemms(g_list, dt, dt);
}

template <typename T>
void cu_expert_matmul_backward(void *din, float *dw, const void *dout, const void *in,
                               const void *w, const int64_t *off_dev, int64_t R, int n_exp, int I,
                               int O, bool dw_overwrite)
{
    if (std::is_same<T, bf16>::value) { /* what the grouped kernel did, the loop below skips */
        if (din && grouped_gemm_dgrad(din, dout, w, off_dev, R, n_exp, I, O)) din = NULL;
        if (dw && grouped_gemm_wgrad(dw, dout, in, off_dev, R, n_exp, I, O, dw_overwrite)) dw = NULL;
    }
    if (!din && !dw) return;
    const int64_t *off = offsets_on_host(off_dev, n_exp);
    check_offsets("expert_matmul backward", off, R, n_exp);
    /* the cuBLAS loop accumulates: overwriting is zeroing first (no saving on this path) */
    if (dw && dw_overwrite)
        CUDA_CHECK(cudaMemsetAsync(dw, 0, (size_t)n_exp * O * I * sizeof(float), g_cuda.stream));
    const cudaDataType_t dt = xtype<T>::cuda;
    if (din) {
        g_list.clear();
        for (int e = 0; e < n_exp; e++) {
            const int64_t r0 = off[e], n = off[e + 1] - off[e];
            if (n == 0) continue;
            g_list.add(CUBLAS_OP_N, CUBLAS_OP_N, I, (int)n, O, (const T *)w + (size_t)e * O * I, I,
                       (const T *)dout + r0 * O, O, (T *)din + r0 * I, I, 0.0f);
        }
        run_gemms(g_list, dt, dt);
    }
    if (dw) {
        g_list.clear();
        for (int e = 0; e < n_exp; e++) {
            const int64_t r0 = off[e], n = off[e + 1] - off[e];
            if (n == 0) continue;
            g_list.add(CUBLAS_OP_N, CUBLAS_OP_T, I, O, (int)n, (const T *)in + r0 * I, I,
                       (const T *)dout + r0 * O, O, dw + (size_t)e * O * I, I, 1.0f);
        }
        run_gemms(g_list, dt, CUDA_R_32F);
    }
}

/* Several row sets' weight gradients at once: the grouped kernel reads and writes dw once for
 * all; elsewhere they are added one after the other (the same sums, rounded in another order). */
template <typename T>
void cu_expert_matmul_wgrad_sets(float *dw, const struct expert_rows *sets, int n_sets, int n_exp,
                                 int I, int O, bool dw_overwrite, double *dw_sumsq)
{
    if (std::is_same<T, bf16>::value &&
        grouped_gemm_wgrad_sets(dw, sets, n_sets, n_exp, I, O, dw_overwrite, dw_sumsq))
        return;
    for (int s = 0; s < n_sets; s++)
        cu_expert_matmul_backward<T>(NULL, dw, sets[s].dout, sets[s].in, NULL, sets[s].off,
                                     sets[s].rows, n_exp, I, O, dw_overwrite && s == 0);
    if (dw_sumsq) cu_sumsq_f32_to(dw, (size_t)n_exp * O * I, dw_sumsq);
}

/* In parts where the grouped kernel runs; elsewhere whole in the last part (until NULL) */
template <typename T>
void cu_expert_matmul_wgrad_part(float *dw, const struct expert_rows *sets, int n_sets, int n_exp, int I,
                                 int O, bool dw_overwrite, int32_t *cursor, const struct exchange_arrival *until)
{
    if (std::is_same<T, bf16>::value &&
        grouped_gemm_wgrad_part(dw, sets, n_sets, n_exp, I, O, dw_overwrite, cursor, until))
        return;
    if (!until) cu_expert_matmul_wgrad_sets<T>(dw, sets, n_sets, n_exp, I, O, dw_overwrite, nullptr);
}

template void cu_expert_matmul_forward<float>(void *, const void *, const void *, const int64_t *,
                                              const int64_t *, int64_t, int, int, int);
template void cu_expert_matmul_forward<bf16>(void *, const void *, const void *, const int64_t *,
                                             const int64_t *, int64_t, int, int, int);
template void cu_expert_matmul_backward<float>(void *, float *, const void *, const void *,
                                               const void *, const int64_t *, int64_t, int, int,
                                               int, bool);
template void cu_expert_matmul_backward<bf16>(void *, float *, const void *, const void *,
                                              const void *, const int64_t *, int64_t, int, int,
                                              int, bool);
template void cu_expert_matmul_wgrad_sets<float>(float *, const struct expert_rows *, int, int, int,
                                                 int, bool, double *);
template void cu_expert_matmul_wgrad_sets<bf16>(float *, const struct expert_rows *, int, int, int,
                                                int, bool, double *);
template void cu_expert_matmul_wgrad_part<float>(float *, const struct expert_rows *, int, int, int, int,
                                                 bool, int32_t *, const struct exchange_arrival *);
template void cu_expert_matmul_wgrad_part<bf16>(float *, const struct expert_rows *, int, int, int, int,
                                                bool, int32_t *, const struct exchange_arrival *);
