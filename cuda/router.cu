/* The router, one warp per token row (docs/router.md for the options). Sigmoid scores, or softmax:
 * fp32 exponentials around the row max, their sum in double, one fp32 division, as
 * src/cpu/cpu_router.c. Top-k: k rounds of a warp arg-max over the experts not yet taken, ordered
 * by (score descending, expert id ascending), so ties go to the lower id exactly as the CPU's
 * strict '>' scan. Lane l owns the experts e ≡ l (mod 32): only it reads or writes their keys
 * inside the rounds, so the rounds need no barrier. The small sequential parts (renormalisation,
 * the backward's scatter) run in the CPU's order. */
#include "router.cuh"

enum {
    RT_WARPS = 8,            /* tokens per block (fewer when a warp's shared memory is large) */
    RT_SMEM = 48 * 1024,     /* dynamic shared memory per block */
    STATS_THREADS = 256,
    STATS_MAX_CHUNKS = 4096, /* psum partials: chunks of rows */
    COUNT_MAX_SLICES = 256,  /* count partials: slices of topk_idx */
    BATCH = 32,              /* loads a thread issues before it waits for them */
};
constexpr unsigned FULL = 0xffffffffu;

/* A choice score as an unsigned key in the CPU's order of scores: −0 and +0 are one score, a NaN
 * ranks below every number, and 0 stays free to mark an expert as taken. Ties between equal keys
 * go to the lower expert id (warp_best). */
__device__ __forceinline__ unsigned score_key(float s)
{
    if (s != s) return 1u;
    unsigned u = __float_as_uint(s);
    if (u == 0x80000000u) u = 0u;
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

__device__ __forceinline__ float key_score(unsigned key)
{
    return __uint_as_float(key & 0x80000000u ? key & 0x7fffffffu : ~key);
}

/* Of the lanes' candidates (key, id), the lowest id among those of the highest key, on every
 * lane: two warp reductions in hardware (sm_80+), rather than a shuffle tree. */
__device__ __forceinline__ unsigned warp_best(unsigned key, unsigned id)
{
    const unsigned best = __reduce_max_sync(FULL, key);
    return __reduce_min_sync(FULL, key == best ? id : ~0u);
}

/* A row's double sum, added in the order of one 128-thread block per row, which is how this
 * router has always summed and so what its results are, bit for bit: thread i adds the
 * e ≡ i (mod 128) in ascending e (acc[s] of lane l holds those of i = 32 s + l), each warp of
 * the block reduces by a shuffle tree, and block_sum's tree adds the four warp sums, in which the
 * padding lanes' + 0.0 turns a -0 into +0. */
__device__ __forceinline__ double row_sum(double (&acc)[4])
{
    double w[4];
#pragma unroll
    for (int s = 0; s < 4; s++) w[s] = warp_sum(acc[s]) + 0.0;
    return (w[0] + w[2]) + (w[1] + w[3]);
}

/* Lane l's experts are e = l + 32 i, i < nl. Their keys live in registers when N > 0 (E <= 32 N,
 * the loops over i unrolled), else in the warp's shared memory (any E). */
template <int N> struct lane_keys {
    unsigned v[N];
    __device__ __forceinline__ lane_keys(unsigned *, int) {}
    __device__ __forceinline__ unsigned &operator[](int i) { return v[i]; }
    __device__ __forceinline__ void take(int i) /* i known at run time only */
    {
#pragma unroll
        for (int j = 0; j < N; j++)
            if (j == i) v[j] = 0u;
    }
};
template <> struct lane_keys<0> {
    unsigned *v;
    __device__ __forceinline__ lane_keys(unsigned *sh, int lane) : v(sh + lane) {}
    __device__ __forceinline__ unsigned &operator[](int i) { return v[32 * i]; }
    __device__ __forceinline__ void take(int i) { v[32 * i] = 0u; }
};

/* f(i) for each of this lane's nl experts, in ascending i */
template <int N, typename F> __device__ __forceinline__ void for_mine(int nl, F f)
{
#pragma unroll
    for (int i = 0; i < (N ? N : nl); i++) {
        if (i >= nl) break;
        f(i);
    }
}

/* This lane's two best experts left: the highest keys, the lower id first on ties (key 0: none).
 * Two, so that the lane whose best is taken rarely has to look through its experts again. */
template <int N>
__device__ __forceinline__ void lane_top2(lane_keys<N> &key, int nl, int lane, unsigned (&bk)[2],
                                          unsigned (&be)[2])
{
    bk[0] = bk[1] = 0u, be[0] = be[1] = ~0u;
    for_mine<N>(nl, [&](int i) {
        const unsigned x = key[i], e = lane + 32 * i;
        if (x > bk[0]) bk[1] = bk[0], be[1] = be[0], bk[0] = x, be[0] = e;
        else if (x > bk[1]) bk[1] = x, be[1] = e;
    });
}

/* Takes (key 0) the experts outside the best o.topk_group groups (the CPU's mask_groups). A
 * group scores the sum of its two best choice scores, read from every lane's keys in `sh`; lane l
 * scores groups l and l + 32 (G <= 64, config.c), and the best groups are found by rounds of
 * warp_best (ties to the lower group). */
template <int N>
__device__ void mask_groups(lane_keys<N> &key, const unsigned *sh, int nl, int E,
                            const struct router_opts &o, int lane)
{
    const int G = o.n_group, per = E / G;
    unsigned gk[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int g = lane + 32 * h;
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int e = g * per; g < G && e < (g + 1) * per; e++) {
            const float s = key_score(sh[e]);
            if (s > b1) b2 = b1, b1 = s;
            else if (s > b2) b2 = s;
        }
        gk[h] = g < G ? score_key(per > 1 ? b1 + b2 : b1) : 0u;
    }
    unsigned long long keep = 0;
    for (int j = 0; j < o.topk_group; j++) {
        const bool second = gk[1] > gk[0];
        const unsigned g = warp_best(second ? gk[1] : gk[0], lane + (second ? 32 : 0));
        keep |= 1ull << g;
        if (g == (unsigned)lane) gk[0] = 0u;
        if (g == (unsigned)lane + 32) gk[1] = 0u;
    }
    __syncwarp(); /* the other lanes are done reading this lane's keys */
    for_mine<N>(nl, [&](int i) {
        if (!(keep >> ((lane + 32 * i) / per) & 1ull)) key[i] = 0u;
    });
}

/* dynamic shared memory: per warp [E] words (the keys where N = 0, a copy of them for the group
 * scores, at the end the chosen experts' p), then the choices [k] ints. A round of the top-k costs
 * two warp reductions, and the lane whose best was taken moves its second up. */
template <int N>
__global__ void __launch_bounds__(RT_WARPS * 32)
router_fwd_kernel(int32_t *topk_idx, float *topk_w, float *probs, const float *logits,
                  const float *bias, int T_, int E, int k, int warp_smem, struct router_opts o)
{
    pdl_wait(); /* first: launch.cuh */
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int t = blockIdx.x * (blockDim.x >> 5) + wid;
    if (t >= T_) return;
    unsigned *sh = (unsigned *)(smem + (size_t)wid * warp_smem);
    int *sel = (int *)(sh + E);
    lane_keys<N> key(sh, lane);
    const int nl = (E - lane + 31) / 32;
    const float *z = logits + (size_t)t * E + lane;
    float *p = probs + (size_t)t * E;

    float denom = 1.0f;
    if (!o.sigmoid) {
        float mx = -INFINITY;
        for_mine<N>(nl, [&](int i) { mx = fmaxf(mx, z[32 * i]); });
        mx = warp_max(mx);
        double acc[4] = {0.0, 0.0, 0.0, 0.0};
#pragma unroll
        for (int i0 = 0; i0 < (N ? N : nl); i0 += 4)
#pragma unroll
            for (int s = 0; s < 4; s++)
                if (i0 + s < nl) {
                    const float pe = expf(z[32 * (i0 + s)] - mx);
                    key[i0 + s] = __float_as_uint(pe);
                    acc[s] += pe;
                }
        denom = (float)row_sum(acc);
    }
    for_mine<N>(nl, [&](int i) {
        const int e = lane + 32 * i;
        const float pe =
            o.sigmoid ? 1.0f / (1.0f + expf(-z[32 * i])) : __uint_as_float(key[i]) / denom;
        p[e] = pe;
        key[i] = score_key(bias ? pe + bias[e] : pe);
    });

    if (o.force_balance) {
        for (int j = lane; j < k; j += 32) sel[j] = (int)(((long long)t * k + j) % E);
    } else {
        if (o.n_group > 1) {
            if constexpr (N > 0) for_mine<N>(nl, [&](int i) { sh[lane + 32 * i] = key[i]; });
            __syncwarp();
            mask_groups<N>(key, sh, nl, E, o, lane);
        }
        unsigned bk[2], be[2];
        lane_top2<N>(key, nl, lane, bk, be);
        for (int j = 0; j < k; j++) {
            const unsigned e = warp_best(bk[0], be[0]);
            if (lane == 0) sel[j] = (int)e;
            if (lane == (int)(e & 31)) {
                key.take(e >> 5);
                bk[0] = bk[1], be[0] = be[1], bk[1] = 0u;
                if (!bk[0]) lane_top2<N>(key, nl, lane, bk, be);
            }
        }
    }
    __syncwarp();
    float *pk = (float *)sh; /* fetched by all lanes at once, then added by each in j order */
    for (int j = lane; j < k; j += 32) pk[j] = p[sel[j]];
    __syncwarp();
    float ws = 1.0f;
    if (o.norm_topk) {
        double wsum = 0.0;
        for (int j = 0; j < k; j++) wsum += pk[j];
        ws = (float)wsum;
    }
    for (int j = lane; j < k; j += 32) {
        float w = o.norm_topk ? pk[j] / ws : pk[j];
        if (o.route_scale != 1.0f) w *= o.route_scale;
        topk_idx[(size_t)t * k + j] = sel[j];
        topk_w[(size_t)t * k + j] = w;
    }
}

/* dynamic shared memory: per warp dp[E], then the choices' ids, probabilities and weight
 * gradients [k] each, fetched by all lanes at once. One lane adds into dp in j order, as the CPU
 * does: a repeated id (a replayed routing) then adds up the same way. */
__global__ void __launch_bounds__(RT_WARPS * 32)
router_bwd_kernel(float *dlogits, const float *dtopk_w, const float *probs, const int32_t *topk_idx,
                  const float *aux_dp, int T_, int E, int k, int warp_smem, struct router_opts o)
{
    pdl_wait(); /* first: launch.cuh */
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int t = blockIdx.x * (blockDim.x >> 5) + wid;
    if (t >= T_) return;
    float *dp = (float *)(smem + (size_t)wid * warp_smem);
    int *idx = (int *)(dp + E);
    float *pk = (float *)(idx + k), *dw = pk + k;
    const float *p = probs + (size_t)t * E;
    for (int e = lane; e < E; e += 32) dp[e] = aux_dp ? aux_dp[e] : 0.0f;
    for (int j = lane; j < k; j += 32) {
        const int32_t m = topk_idx[(size_t)t * k + j];
        idx[j] = m;
        pk[j] = p[m];
        dw[j] = dtopk_w[(size_t)t * k + j];
    }
    __syncwarp();
    const float rs = o.route_scale;
    if (o.norm_topk) {
        /* w_j = rs p_j / S_k: dp_m = rs (dw_m − Σ_j dw_j ŵ_j) / S_k for the selected m. Every lane
         * adds the sums in j order; the divisions are spread over the lanes. */
        double sk = 0.0;
        for (int j = 0; j < k; j++) sk += pk[j];
        const float s = (float)sk;
        __syncwarp();
        for (int j = lane; j < k; j += 32) pk[j] = pk[j] / s; /* ŵ_j */
        __syncwarp();
        double proj = 0.0;
        for (int j = 0; j < k; j++) proj += (double)dw[j] * pk[j];
        const float pr = (float)proj;
        __syncwarp();
        for (int j = lane; j < k; j += 32) dw[j] = rs * (dw[j] - pr) / s; /* the step of dp_m */
        __syncwarp();
        if (lane == 0)
            for (int j = 0; j < k; j++) dp[idx[j]] += dw[j];
    } else if (lane == 0) {
        for (int j = 0; j < k; j++) dp[idx[j]] += rs * dw[j];
    }
    __syncwarp();
    float *dz = dlogits + (size_t)t * E;
    if (o.sigmoid) {
        for (int e = lane; e < E; e += 32) dz[e] = dp[e] * p[e] * (1.0f - p[e]);
        return;
    }
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    for (int e0 = 0; e0 < E; e0 += 128)
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const int e = e0 + 32 * s + lane;
            if (e < E) acc[s] += (double)p[e] * dp[e];
        }
    const float c = (float)row_sum(acc);
    for (int e = lane; e < E; e += 32) dz[e] = p[e] * (dp[e] - c);
}

/* Σ_{i<n} src[i * stride] in ascending i, accumulated in A; a thread waits on memory once per
 * BATCH loads rather than once per load */
template <typename A, typename V>
__device__ __forceinline__ A ordered_sum(const V *src, size_t stride, int n)
{
    A s = 0;
    for (int i0 = 0; i0 < n; i0 += BATCH) {
        V v[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; u++) v[u] = i0 + u < n ? src[(size_t)(i0 + u) * stride] : V(0);
#pragma unroll
        for (int u = 0; u < BATCH; u++)
            if (i0 + u < n) s += v[u];
    }
    return s;
}

/* The first (E + 31) / 32 × nchunks blocks: partial[chunk, e] = Σ over the chunk's rows of
 * probs[t, e], 32 experts × 8 row phases a block, each phase in ascending rows, then the phases in
 * order. The other blocks: count_part[slice, e] = #(entries of the slice of topk_idx equal to e),
 * integer counts in shared memory (exact, so order-free); indices outside [0, E) are not counted.
 * One launch for both, as neither needs the other. */
__global__ void __launch_bounds__(STATS_THREADS)
stats_partial_kernel(double *partial, int *count_part, const float *probs, const int32_t *topk_idx,
                     int T_, int E, int rows_per_chunk, int nchunks, size_t n, size_t slice)
{
    pdl_wait(); /* first: launch.cuh */
    const int ecols = (E + 31) / 32, nprob = ecols * nchunks;
    if ((int)blockIdx.x < nprob) {
        __shared__ double sh[8][33];
        const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
        const int e = blockIdx.x % ecols * 32 + tx, chunk = blockIdx.x / ecols;
        const int r = chunk * rows_per_chunk + ty, r1 = min(T_, (chunk + 1) * rows_per_chunk);
        const int rows = r < r1 ? (r1 - r + 7) / 8 : 0;
        sh[ty][tx] = e < E ? ordered_sum<double>(probs + (size_t)r * E + e, (size_t)8 * E, rows) : 0.0;
        __syncthreads();
        if (ty == 0 && e < E) {
            double s = 0.0;
            for (int i = 0; i < 8; i++) s += sh[i][tx];
            partial[(size_t)chunk * E + e] = s;
        }
        return;
    }
    extern __shared__ int hist[];
    const size_t i0 = (blockIdx.x - nprob) * slice, i1 = min(n, i0 + slice);
    for (int e = threadIdx.x; e < E; e += STATS_THREADS) hist[e] = 0;
    __syncthreads();
    for (size_t i = i0 + threadIdx.x; i < i1; i += (size_t)STATS_THREADS * BATCH) {
        int32_t v[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; u++) {
            const size_t iu = i + (size_t)u * STATS_THREADS;
            v[u] = iu < i1 ? topk_idx[iu] : -1;
        }
#pragma unroll
        for (int u = 0; u < BATCH; u++)
            if (v[u] >= 0 && v[u] < E) atomicAdd(&hist[v[u]], 1);
    }
    __syncthreads();
    int *out = count_part + (blockIdx.x - nprob) * (size_t)E;
    for (int e = threadIdx.x; e < E; e += STATS_THREADS) out[e] = hist[e];
}

/* psum[e] += the chunk partials summed in double in ascending chunks, rounded once (the order of
 * cuda_add_column_partials); count[e] += the slices' integer total, rounded once */
__global__ void stats_finish_kernel(float *psum, float *count, const double *partial, int nchunks,
                                    const int *count_part, int nslices, int E)
{
    pdl_wait(); /* first: launch.cuh */
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E) return;
    psum[e] += (float)ordered_sum<double>(partial + e, E, nchunks);
    count[e] += (float)ordered_sum<int>(count_part + e, E, nslices);
}

/* one thread per token, the CPU's arithmetic (double sum, one fp32 division) */
__global__ void gather_weights_kernel(float *topk_w, const float *probs, const int32_t *topk_idx,
                                      int T_, int E, int k, struct router_opts o)
{
    pdl_wait(); /* first: launch.cuh */
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

/* tokens per block for a warp's shared memory of `bytes` (rounded up to keep the warps aligned) */
static int router_warps(const char *what, int E, size_t *bytes)
{
    *bytes = (*bytes + 15) & ~(size_t)15;
    MT_CHECK(*bytes <= RT_SMEM, "%s: %d experts do not fit the kernel's shared memory", what, E);
    int w = RT_WARPS;
    while (w > 1 && w * *bytes > RT_SMEM) w /= 2;
    return w;
}

void cu_router_forward(int32_t *topk_idx, float *topk_w, float *probs, const float *logits,
                       const float *bias, int T_, int E, int k, const struct router_opts *o)
{
    check_router("router", T_, E, k);
    if (T_ == 0) return;
    size_t bytes = ((size_t)E + k) * sizeof(unsigned);
    const int w = router_warps("router", E, &bytes);
    /* the experts' keys in registers up to 512 experts, in shared memory past that */
    auto fwd = E <= 128 ? router_fwd_kernel<4> : E <= 256 ? router_fwd_kernel<8>
             : E <= 512 ? router_fwd_kernel<16> : router_fwd_kernel<0>;
    cuda_launch(fwd, (T_ + w - 1) / w, 32 * w, w * bytes, topk_idx, topk_w, probs, logits, bias,
        T_, E, k, (int)bytes, *o);
    CUDA_LAUNCH_CHECK("router forward");
}

void cu_router_backward(float *dlogits, const float *dtopk_w, const float *probs,
                        const int32_t *topk_idx, const float *aux_dp, int T_, int E, int k,
                        const struct router_opts *o)
{
    check_router("router backward", T_, E, k);
    if (T_ == 0) return;
    size_t bytes = (size_t)E * sizeof(float) + (size_t)k * (sizeof(int) + 2 * sizeof(float));
    const int w = router_warps("router backward", E, &bytes);
    cuda_launch(router_bwd_kernel, (T_ + w - 1) / w, 32 * w, w * bytes,
        dlogits, dtopk_w, probs, topk_idx, aux_dp, T_, E, k, (int)bytes, *o);
    CUDA_LAUNCH_CHECK("router backward");
}

void cu_router_gather_weights(float *topk_w, const float *probs, const int32_t *topk_idx, int T_,
                              int E, int k, const struct router_opts *o)
{
    check_router("router_gather_weights", T_, E, k);
    if (T_ == 0) return;
    cuda_launch(gather_weights_kernel, (T_ + 127) / 128, 128, 0, topk_w, probs, topk_idx, T_, E,
        k, *o);
    CUDA_LAUNCH_CHECK("router_gather_weights");
}

/* one thread an expert; fp64 as on the host (train.c), so the bits are the host's */
__global__ void aux_grad_kernel(float *aux_dp, const float *stats, int L, int E, double scale, double rows)
{
    pdl_wait(); /* first: launch.cuh */
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E) return;
    double cnt = 0;
    for (int l = 0; l < L; l++) cnt = __dadd_rn(cnt, (double)stats[(size_t)l * 2 * E + E + e]);
    aux_dp[e] = __double2float_rn(__ddiv_rn(__dmul_rn(__dmul_rn(scale, (double)E), cnt), __dmul_rn(rows, rows)));
}

void cu_aux_grad_from_stats(float *aux_dp, const float *stats, int L, int E, double scale, double rows)
{
    if (E <= 0) return;
    cuda_launch(aux_grad_kernel, (E + 127) / 128, 128, 0, aux_dp, stats, L, E, scale, rows);
    CUDA_LAUNCH_CHECK("aux_grad_from_stats");
}

void cu_router_stats(float *psum, float *count, const float *probs, const int32_t *topk_idx, int T_,
                     int E, int k)
{
    check_router("router_stats", T_, E, k);
    if (T_ == 0) return;
    MT_CHECK((size_t)E * sizeof(int) <= RT_SMEM,
             "router_stats: %d experts do not fit the kernel's shared memory", E);
    /* the chunks fix psum's order of additions: they depend on T alone */
    const int rows_per_chunk = MT_MAX(256, (T_ + STATS_MAX_CHUNKS - 1) / STATS_MAX_CHUNKS);
    const int nchunks = (T_ + rows_per_chunk - 1) / rows_per_chunk;
    const size_t n = (size_t)T_ * k, batch = (size_t)STATS_THREADS * BATCH;
    const size_t slice = (n + batch * COUNT_MAX_SLICES - 1) / (batch * COUNT_MAX_SLICES) * batch;
    const int nslices = (int)((n + slice - 1) / slice);
    const size_t pbytes = (size_t)nchunks * E * sizeof(double);
    char *scratch = (char *)cuda_scratch(SCRATCH_REDUCE, pbytes + (size_t)nslices * E * sizeof(int));
    double *partial = (double *)scratch;
    int *count_part = (int *)(scratch + pbytes);
    cuda_launch(stats_partial_kernel, (E + 31) / 32 * nchunks + nslices, STATS_THREADS,
        (size_t)E * sizeof(int), partial, count_part, probs, topk_idx, T_, E, rows_per_chunk, nchunks, n,
        slice);
    CUDA_LAUNCH_CHECK("router_stats partials");
    cuda_launch(stats_finish_kernel, (E + 255) / 256, 256, 0, psum, count, partial, nchunks,
        count_part, nslices, E);
    CUDA_LAUNCH_CHECK("router_stats");
}
