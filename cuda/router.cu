/* The router, one block per token row (docs/router.md for the options). Sigmoid scores, or softmax: fp32 exponentials around the row max, their sum
 * in double, one fp32 division, as src/cpu/cpu_router.c. Top-k: k rounds of a block arg-max over
 * the experts not yet taken, ordered by (score descending, expert id ascending), so ties go to the
 * lower id exactly as the CPU's strict '>' scan. The small sequential parts (group masking,
 * renormalisation, the backward through it) run on one thread in the CPU's order. */
#include "router.cuh"
#include "rmsnorm.cuh"

enum { RT_BLOCK = 128, STATS_MAX_CHUNKS = 4096 };

/* (s2, e2) ranks before (s1, e1): a higher score, or the same score and a lower id */
__device__ __forceinline__ bool ranks_before(float s2, int e2, float s1, int e1)
{
    return e2 >= 0 && (e1 < 0 || s2 > s1 || (s2 == s1 && e2 < e1));
}

/* One thread marks the experts outside the best o.topk_group groups as taken (the CPU's
 * mask_groups: a group scores the sum of its two best choice scores, ties to the lower group). */
__device__ void mask_groups(unsigned char *taken, const float *sp, const float *bias, int E,
                            const struct router_opts &o)
{
    const int G = o.n_group, per = E / G;
    unsigned long long keep = 0; /* G <= 64 (config.c) */
    for (int j = 0; j < o.topk_group; j++) {
        int best = -1;
        float best_s = 0.0f;
        for (int g = 0; g < G; g++) {
            if (keep >> g & 1ull) continue;
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; e++) {
                const float s = bias ? sp[e] + bias[e] : sp[e];
                if (s > b1) b2 = b1, b1 = s;
                else if (s > b2) b2 = s;
            }
            const float gs = per > 1 ? b1 + b2 : b1;
            if (best < 0 || gs > best_s) best = g, best_s = gs;
        }
        keep |= 1ull << best;
    }
    for (int e = 0; e < E; e++) taken[e] = !(keep >> (e / per) & 1ull);
}

__global__ void __launch_bounds__(RT_BLOCK)
router_fwd_kernel(int32_t *topk_idx, float *topk_w, float *probs, const float *logits,
                  const float *bias, int E, int k, struct router_opts o)
{
    extern __shared__ float sp[];          /* p[E] */
    int *sel_idx = (int *)(sp + E);        /* [k] */
    float *sel_w = (float *)(sel_idx + k); /* [k] */
    unsigned char *taken = (unsigned char *)(sel_w + k); /* [E] */
    __shared__ float shf[32];
    __shared__ double shd[32];
    __shared__ float warp_s[32];
    __shared__ int warp_e[32];
    const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const float *z = logits + (size_t)t * E;

    if (o.sigmoid) {
        for (int e = tid; e < E; e += blockDim.x) {
            sp[e] = 1.0f / (1.0f + expf(-z[e]));
            probs[(size_t)t * E + e] = sp[e];
            taken[e] = 0;
        }
    } else {
        float mx = -INFINITY;
        for (int e = tid; e < E; e += blockDim.x) mx = fmaxf(mx, z[e]);
        mx = block_max(mx, shf);
        double sum = 0.0;
        for (int e = tid; e < E; e += blockDim.x) {
            const float pe = expf(z[e] - mx);
            sp[e] = pe;
            sum += pe;
        }
        sum = block_sum(sum, shd);
        const float denom = (float)sum;
        for (int e = tid; e < E; e += blockDim.x) {
            sp[e] /= denom;
            probs[(size_t)t * E + e] = sp[e];
            taken[e] = 0;
        }
    }
    __syncthreads();
    if (o.force_balance) {
        if (tid == 0)
            for (int j = 0; j < k; j++) {
                sel_idx[j] = (int)(((long long)t * k + j) % E);
                sel_w[j] = sp[sel_idx[j]];
            }
        __syncthreads();
    } else {
        if (o.n_group > 1) {
            if (tid == 0) mask_groups(taken, sp, bias, E, o);
            __syncthreads();
        }
        for (int j = 0; j < k; j++) {
            float bs = 0.0f;
            int be = -1;
            for (int e = tid; e < E; e += blockDim.x) {
                if (taken[e]) continue;
                const float s = bias ? sp[e] + bias[e] : sp[e];
                if (ranks_before(s, e, bs, be)) bs = s, be = e;
            }
            for (int off = 16; off > 0; off >>= 1) {
                const float os = __shfl_xor_sync(0xffffffffu, bs, off);
                const int oe = __shfl_xor_sync(0xffffffffu, be, off);
                if (ranks_before(os, oe, bs, be)) bs = os, be = oe;
            }
            if (lane == 0) warp_s[wid] = bs, warp_e[wid] = be;
            __syncthreads();
            if (tid == 0) {
                for (int w = 1; w < (int)(blockDim.x >> 5); w++)
                    if (ranks_before(warp_s[w], warp_e[w], bs, be)) bs = warp_s[w], be = warp_e[w];
                taken[be] = 1;
                sel_idx[j] = be;
                sel_w[j] = sp[be];
            }
            __syncthreads();
        }
    }

    if (tid == 0) {
        float ws = 1.0f;
        if (o.norm_topk) {
            double wsum = 0.0;
            for (int j = 0; j < k; j++) wsum += sel_w[j];
            ws = (float)wsum;
        }
        for (int j = 0; j < k; j++) {
            float w = o.norm_topk ? sel_w[j] / ws : sel_w[j];
            if (o.route_scale != 1.0f) w *= o.route_scale;
            topk_idx[(size_t)t * k + j] = sel_idx[j];
            topk_w[(size_t)t * k + j] = w;
        }
    }
}

__global__ void __launch_bounds__(RT_BLOCK)
router_bwd_kernel(float *dlogits, const float *dtopk_w, const float *probs, const int32_t *topk_idx,
                  const float *aux_dp, int E, int k, struct router_opts o)
{
    extern __shared__ float dp[]; /* [E] */
    __shared__ double shd[32];
    const int t = blockIdx.x, tid = threadIdx.x;
    const float *p = probs + (size_t)t * E;
    const float rs = o.route_scale;
    for (int e = tid; e < E; e += blockDim.x) dp[e] = aux_dp ? aux_dp[e] : 0.0f;
    __syncthreads();
    if (tid == 0) {
        const int32_t *idx = topk_idx + (size_t)t * k;
        const float *dw = dtopk_w + (size_t)t * k;
        if (o.norm_topk) {
            /* w_j = rs p_j / S_k: dp_m = rs (dw_m − Σ_j dw_j ŵ_j) / S_k for the selected m */
            double sk = 0.0;
            for (int j = 0; j < k; j++) sk += p[idx[j]];
            const float s = (float)sk;
            double proj = 0.0;
            for (int j = 0; j < k; j++) proj += (double)dw[j] * (p[idx[j]] / s);
            const float pr = (float)proj;
            for (int j = 0; j < k; j++) dp[idx[j]] += rs * (dw[j] - pr) / s;
        } else {
            for (int j = 0; j < k; j++) dp[idx[j]] += rs * dw[j];
        }
    }
    __syncthreads();
    float *dz = dlogits + (size_t)t * E;
    if (o.sigmoid) {
        for (int e = tid; e < E; e += blockDim.x) dz[e] = dp[e] * p[e] * (1.0f - p[e]);
        return;
    }
    double pdp = 0.0;
    for (int e = tid; e < E; e += blockDim.x) pdp += (double)p[e] * dp[e];
    pdp = block_sum(pdp, shd);
    const float c = (float)pdp;
    for (int e = tid; e < E; e += blockDim.x) dz[e] = p[e] * (dp[e] - c);
}

/* partial[chunk, e] = Σ over the chunk's rows of probs[t, e]; block (32 experts × 8 rows) */
__global__ void probs_partial_kernel(double *partial, const float *probs, int T_, int E,
                                     int rows_per_chunk)
{
    __shared__ double sh[8][33];
    const int e = blockIdx.x * 32 + threadIdx.x;
    const int r0 = blockIdx.y * rows_per_chunk, r1 = min(T_, r0 + rows_per_chunk);
    double acc = 0.0;
    if (e < E)
        for (int t = r0 + threadIdx.y; t < r1; t += 8) acc += probs[(size_t)t * E + e];
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && e < E) {
        double s = 0.0;
        for (int i = 0; i < 8; i++) s += sh[i][threadIdx.x];
        partial[(size_t)blockIdx.y * E + e] = s;
    }
}

/* count[e] += #(t, j) with idx = e: integer counts in shared memory (exact, order-free), added
 * once; indices outside [0, E) are not counted. */
__global__ void count_kernel(float *count, const int32_t *topk_idx, size_t n, int E)
{
    extern __shared__ int hist[];
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    __syncthreads();
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
        const int32_t e = topk_idx[i];
        if (e >= 0 && e < E) atomicAdd(&hist[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] += (float)hist[e];
}

/* one thread per token, the CPU's arithmetic (double sum, one fp32 division) */
__global__ void gather_weights_kernel(float *topk_w, const float *probs, const int32_t *topk_idx,
                                      int T_, int E, int k, struct router_opts o)
{
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T_) return;
    const float *p = probs + (size_t)t * E;
    const int32_t *idx = topk_idx + (size_t)t * k;
    float *w = topk_w + (size_t)t * k;
    for (int j = 0; j < k; j++) w[j] = p[idx[j]];
    if (o.norm_topk) {
        double wsum = 0.0;
        for (int j = 0; j < k; j++) wsum += w[j];
        const float ws = (float)wsum;
        for (int j = 0; j < k; j++) w[j] /= ws;
    }
    if (o.route_scale != 1.0f)
        for (int j = 0; j < k; j++) w[j] *= o.route_scale;
}

static void check_router(const char *what, int T_, int E, int k)
{
    MT_CHECK(T_ >= 0 && E > 0 && k > 0 && k <= E, "%s: need T >= 0 and 0 < k <= E, got T=%d k=%d E=%d",
             what, T_, k, E);
}

void cu_router_forward(int32_t *topk_idx, float *topk_w, float *probs, const float *logits,
                       const float *bias, int T_, int E, int k, const struct router_opts *o)
{
    check_router("router", T_, E, k);
    if (T_ == 0) return;
    const size_t smem = (size_t)E * sizeof(float) + (size_t)k * 8 + (size_t)E;
    MT_CHECK(smem <= 48 * 1024, "router: %d experts do not fit the kernel's shared memory", E);
    router_fwd_kernel<<<T_, RT_BLOCK, smem, g_cuda.stream>>>(topk_idx, topk_w, probs, logits,
                                                                     bias, E, k, *o);
    CUDA_LAUNCH_CHECK("router forward");
}

void cu_router_backward(float *dlogits, const float *dtopk_w, const float *probs,
                        const int32_t *topk_idx, const float *aux_dp, int T_, int E, int k,
                        const struct router_opts *o)
{
    check_router("router backward", T_, E, k);
    if (T_ == 0) return;
    router_bwd_kernel<<<T_, RT_BLOCK, (size_t)E * sizeof(float), g_cuda.stream>>>(
        dlogits, dtopk_w, probs, topk_idx, aux_dp, E, k, *o);
    CUDA_LAUNCH_CHECK("router backward");
}

void cu_router_gather_weights(float *topk_w, const float *probs, const int32_t *topk_idx, int T_,
                              int E, int k, const struct router_opts *o)
{
    check_router("router_gather_weights", T_, E, k);
    if (T_ == 0) return;
    gather_weights_kernel<<<(T_ + 127) / 128, 128, 0, g_cuda.stream>>>(topk_w, probs, topk_idx, T_, E,
                                                                       k, *o);
    CUDA_LAUNCH_CHECK("router_gather_weights");
}

void cu_router_stats(float *psum, float *count, const float *probs, const int32_t *topk_idx, int T_,
                     int E, int k)
{
    check_router("router_stats", T_, E, k);
    if (T_ == 0) return;
    const int rows_per_chunk = MT_MAX(256, (T_ + STATS_MAX_CHUNKS - 1) / STATS_MAX_CHUNKS);
    const int nchunks = (T_ + rows_per_chunk - 1) / rows_per_chunk;
    double *partial = (double *)cuda_scratch(SCRATCH_REDUCE, (size_t)nchunks * E * sizeof(double));
    probs_partial_kernel<<<dim3((E + 31) / 32, nchunks), dim3(32, 8), 0, g_cuda.stream>>>(
        partial, probs, T_, E, rows_per_chunk);
    CUDA_LAUNCH_CHECK("router_stats psum");
    cuda_add_column_partials(psum, partial, nchunks, E);
    count_kernel<<<1, 1024, (size_t)E * sizeof(int), g_cuda.stream>>>(count, topk_idx,
                                                                       (size_t)T_ * k, E);
    CUDA_LAUNCH_CHECK("router_stats count");
}
