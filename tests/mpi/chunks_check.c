/* mpirun -np N chunks_check CASE CHUNKS [loopback|corrupt] [cuda]   (N divides 8; one EP group)
 *
 * The chunked, overlapped MoE exchange (src/moe_exchange.c, parallel.moe_chunks) against the
 * one-chunk path of src/moe.c on the CPU backend: two models with the same expert weights, one with
 * moe_chunks = 1, the other with CHUNKS (and, with "loopback", MT_MOE_LOOPBACK=1: the pair path
 * and an exchange with itself even on one rank), run the expert part of a layer (route plan,
 * dispatch, expert SwiGLU, combine) and its backward on the same routing, inputs and output
 * gradient, twice (two routings, so the plans and buffers are rebuilt). The layer output, the
 * input gradient and the routing-weight gradients must be bit-identical; the experts' weight
 * gradients (summed chunk by chunk, so in another order) within 1e-5 of the largest. On the pair
 * path the expert-row buffers must hold 1.25x the mean rows a rank receives from the start.
 * Each rank has 7 + 4·rank tokens (odd: no chunk count divides them evenly).
 * Cases: spread (2 of 8 experts, hashed), skew (the second half of each rank's tokens all go to
 * the last rank's experts: with 2 chunks every rank's second chunk sends to that rank alone),
 * topE (every token to all 8 experts). "corrupt" alters one output value of the last rank's chunked
 * run before the comparison: it must FAIL, which shows the check can.
 * "cuda" runs both models on the CUDA backend in fp32 with an NCCL EP comm (one GPU per rank; with
 * one rank give "loopback", or the exchange is skipped): the grouped GEMMs may pick other kernels
 * for other row counts, so there the outputs and gradients must agree to 1e-5 of their largest
 * value instead of bit for bit.
 * Exit 0 when everything matches; otherwise each failing rank prints its first problem and all exit 1. */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "common.h"
#include "config.h"
#include "model.h"
#include "ops.h"
#ifdef MT_HAVE_NCCL
#include "comm_nccl.h"
#endif

#define E_ALL 8
#define HID 8
#define LAYER 0

enum kase { C_SPREAD, C_SKEW, C_TOPE };
static const char *const case_names[] = {"spread", "skew", "topE"};
static const int case_k[] = {2, 2, E_ALL};

static char first_problem[512];
static int n_problems;

#define PROBLEM(...)                                                                  \
    do {                                                                              \
        if (n_problems++ == 0) snprintf(first_problem, sizeof first_problem, __VA_ARGS__); \
    } while (0)

static uint32_t mix(uint32_t x)
{
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
    return x;
}

/* a value in [-1, 1) that is not dyadic-friendly: products round */
static float val(uint32_t a, uint32_t b) { return (float)(mix(a * 2654435761U + b) % 20011) / 10005.5f - 1.0f; }

static void route_of(enum kase c, int round, int me, int t, int T, int K, int32_t *idx, float *w)
{
    uint32_t h = mix((uint32_t)(me * 1000 + t + 77 * round) * 2654435761U);
    switch (c) {
    case C_SPREAD:
        idx[0] = (int32_t)(h % E_ALL);
        idx[1] = (int32_t)((idx[0] + 1 + (h >> 8) % (E_ALL - 1)) % E_ALL);
        break;
    case C_SKEW: /* round 1 flips which half goes to the last rank */
        if ((t >= T / 2) != (round == 1)) {
            idx[0] = E_ALL - 1;
            idx[1] = E_ALL - 2;
        } else {
            idx[0] = (int32_t)(h % E_ALL);
            idx[1] = (int32_t)((idx[0] + 1 + (h >> 8) % (E_ALL - 1)) % E_ALL);
        }
        break;
    case C_TOPE:
        for (int j = 0; j < K; j++) idx[j] = (int32_t)((j + (int)(h % E_ALL)) % E_ALL);
        break;
    }
    for (int j = 0; j < K; j++) w[j] = 0.05f + 0.3f * val(h, (uint32_t)j) * val(h, 99) + 0.1f * (float)j;
}

static void init_model(struct model *m, const struct backend *be, const struct model_config *mc,
                       struct comm *ep, int T, int chunks, bool loopback)
{
    if (loopback) setenv("MT_MOE_LOOPBACK", "1", 1);
    else unsetenv("MT_MOE_LOOPBACK");
    model_init(m, be, mc, 1, T, ep, false);
    unsetenv("MT_MOE_LOOPBACK");
    m->moe_chunks = chunks;
    model_own_weights(m);
    /* expert weights by global expert id, so every mesh holds the same model */
    const enum tensor_role roles[] = {TR_EXP_GATE_UP, TR_EXP_DOWN};
    for (int k = 0; k < 2; k++) {
        int i = tensor_lookup(&m->tt, roles[k], LAYER);
        const int64_t n = model_work_numel_of(m, i), per = n / m->n_local_experts;
        float *w = mt_malloc((size_t)n * sizeof(float));
        for (int le = 0; le < m->n_local_experts; le++)
            for (int64_t j = 0; j < per; j++)
                w[le * per + j] = 0.5f * val((uint32_t)(k * 100 + m->expert0 + le), (uint32_t)j);
        be->upload(model_weight(m, i), w, (size_t)n * sizeof(float));
        free(w);
    }
}

struct result {
    float *out, *dx, *dtw, *grads;
    int64_t n_grads;
};

static void *to_dev(const struct backend *be, const void *host, size_t bytes)
{
    void *d = be->alloc(bytes);
    be->upload(d, host, bytes);
    return d;
}

static void run(struct model *m, enum kase c, int round, int me, int K, struct result *r)
{
    const struct backend *be = m->be;
    const int T = m->T;
    const size_t rows = (size_t)T * HID * sizeof(float);
    int32_t *idx = mt_malloc((size_t)T * K * sizeof(int32_t));
    float *w = mt_malloc((size_t)T * K * sizeof(float));
    float *x = mt_malloc(rows), *dout = mt_malloc(rows);
    for (int t = 0; t < T; t++) {
        route_of(c, round, me, t, T, K, idx + (size_t)t * K, w + (size_t)t * K);
        for (int col = 0; col < HID; col++) {
            x[t * HID + col] = val((uint32_t)(me * 100 + t + 1000 * round), (uint32_t)col);
            dout[t * HID + col] = val((uint32_t)(me * 100 + t + 1000 * round), (uint32_t)col + 50);
        }
    }
    void *dx_in = to_dev(be, x, rows), *ddout = to_dev(be, dout, rows);
    void *dout_dev = be->alloc(rows), *ddx = be->alloc(rows);
    r->out = mt_malloc(rows);
    r->dx = mt_malloc(rows);
    r->dtw = mt_malloc((size_t)T * K * sizeof(float));
    moe_experts_for_test(m, LAYER, idx, w, dx_in, dout_dev);
    moe_experts_backward_for_test(m, LAYER, ddout, ddx);
    be->download(r->out, dout_dev, rows);
    be->download(r->dx, ddx, rows);
    be->download(r->dtw, m->d_topk_w, (size_t)T * K * sizeof(float));
    /* the expert tensors' gradients (accumulated over the rounds) */
    int gi = tensor_lookup(&m->tt, TR_EXP_GATE_UP, LAYER), di = tensor_lookup(&m->tt, TR_EXP_DOWN, LAYER);
    const int64_t ng = model_work_numel_of(m, gi), nd = model_work_numel_of(m, di);
    r->n_grads = ng + nd;
    r->grads = mt_malloc((size_t)r->n_grads * sizeof(float));
    be->download(r->grads, model_grad(m, gi), (size_t)ng * sizeof(float));
    be->download(r->grads + ng, model_grad(m, di), (size_t)nd * sizeof(float));
    be->free(dx_in), be->free(ddout), be->free(dout_dev), be->free(ddx);
    free(idx); free(w); free(x); free(dout);
}

static void free_result(struct result *r) { free(r->out); free(r->dx); free(r->dtw); free(r->grads); }

/* bit for bit on the CPU; on a GPU within 1e-5 of the tensor's largest value */
static void same_values(const char *what, const float *got, const float *want, int64_t n, int round, bool exact)
{
    float big = 0;
    for (int64_t i = 0; i < n; i++) big = fmaxf(big, fabsf(want[i]));
    for (int64_t i = 0; i < n; i++)
        if (exact ? memcmp(&got[i], &want[i], sizeof(float)) != 0
                  : !(fabsf(got[i] - want[i]) <= 1e-5f * big)) {
            PROBLEM("round %d: %s[%lld] is %.9g with chunks, %.9g without", round, what, (long long)i,
                    got[i], want[i]);
            return;
        }
}

int main(int argc, char **argv)
{
    MT_CHECK_MPI(MPI_Init(&argc, &argv));
    int N = 0, me = 0;
    MT_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &N));
    MT_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &me));
    int kc = -1;
    for (int i = 0; argc >= 3 && i < (int)(sizeof case_names / sizeof *case_names); i++)
        if (!strcmp(argv[1], case_names[i])) kc = i;
    const int chunks = argc >= 3 ? atoi(argv[2]) : 0;
    bool loopback = false, corrupt = false, cuda = false, bad_arg = false;
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "loopback")) loopback = true;
        else if (!strcmp(argv[i], "corrupt")) corrupt = true;
        else if (!strcmp(argv[i], "cuda")) cuda = true;
        else bad_arg = true;
    }
    if (kc < 0 || chunks < 1 || bad_arg || (loopback && corrupt))
        mt_user_error("usage: chunks_check spread|skew|topE CHUNKS [loopback|corrupt] [cuda]");
    if (E_ALL % N) mt_user_error("chunks_check: run with 1, 2, 4 or 8 ranks, not %d", N);
    const enum kase c = (enum kase)kc;
    const int K = case_k[c], T = 7 + 4 * me;

    struct config cfg;
    config_defaults(&cfg);
    struct model_config *mc = &cfg.model;
    mc->vocab_size = 32;
    mc->hidden_size = HID;
    mc->num_hidden_layers = 1;
    mc->num_attention_heads = 2;
    mc->num_key_value_heads = 1;
    mc->head_dim = 4;
    mc->num_experts = E_ALL;
    mc->num_experts_per_tok = K;
    mc->moe_intermediate_size = 4;
    mc->intermediate_size = 8;
    const struct backend *be = backend_cpu();
    struct comm *ep = NULL;
    if (cuda) {
        be = backend_cuda(true, me);
        if (!be) mt_user_error("chunks_check: cuda asked for but no GPU or no CUDA build");
#ifdef MT_HAVE_NCCL
        ep = comm_nccl_create(MPI_COMM_WORLD);
#endif
    } else {
        ep = comm_mpi_create(MPI_COMM_WORLD);
    }
    if (!ep) mt_user_error("chunks_check: cuda asked for but this build has no NCCL");
    struct model ref, chk;
    init_model(&ref, be, mc, ep, T, 1, false);
    init_model(&chk, be, mc, ep, T, chunks, loopback);
    if (chk.pairs != (N > 1 || loopback)) PROBLEM("the chunked model %s the pair path", chk.pairs ? "takes" : "skips");

    double worst = 0, biggest = 0;
    /* the rounds are collective: every rank goes on, or none does */
    for (int round = 0, stop = 0; round < 2 && !stop; round++) {
        struct result a, b;
        run(&ref, c, round, me, K, &a);
        run(&chk, c, round, me, K, &b);
        if (corrupt && me == N - 1) b.out[T * HID / 2] = nextafterf(b.out[T * HID / 2], INFINITY);
        if (chunks > 1 && !chk.layers[LAYER].route.chunks) PROBLEM("no chunk plan: the chunked path did not run");
        /* the expert-row buffers are sized from the mean rows a rank receives (T·k), not from the
         * first routing's: a rank that got fewer would grow them again (a synchronising free and
         * allocation) as soon as its rows passed the first count */
        const int64_t mean = (int64_t)T * K, want_cap = mean + mean / 4 + 16; /* moe_buffers.h */
        if (chk.pairs && chk.layers[LAYER].cap_rows < want_cap)
            PROBLEM("round %d: expert-row buffers hold %lld rows, fewer than %lld (1.25x the mean %lld, + 16)", round,
                    (long long)chk.layers[LAYER].cap_rows, (long long)want_cap, (long long)mean);
        float big = 0;
        for (int64_t i = 0; i < (int64_t)T * HID; i++) big = fmaxf(big, fabsf(a.out[i]));
        if (!(big > 0)) PROBLEM("round %d: the reference output is all zero (the check would prove nothing)", round);
        same_values("out", b.out, a.out, (int64_t)T * HID, round, !cuda);
        same_values("dx", b.dx, a.dx, (int64_t)T * HID, round, !cuda);
        same_values("d_topk_w", b.dtw, a.dtw, (int64_t)T * K, round, !cuda);
        for (int64_t i = 0; i < a.n_grads; i++) {
            biggest = fmax(biggest, fabs(a.grads[i]));
            worst = fmax(worst, fabs((double)b.grads[i] - a.grads[i]));
        }
        free_result(&a);
        free_result(&b);
        int mine = n_problems > 0;
        MT_CHECK_MPI(MPI_Allreduce(&mine, &stop, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    }
    if (!n_problems && !(worst <= 1e-5 * biggest))
        PROBLEM("expert weight gradients differ by %.3g (largest %.3g)", worst, biggest);
    double rel = biggest > 0 ? worst / biggest : 0, rel_max = 0;
    MT_CHECK_MPI(MPI_Allreduce(&rel, &rel_max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
    int bad = n_problems > 0, any_bad = 0;
    MT_CHECK_MPI(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    if (n_problems)
        fprintf(stderr, "chunks_check %s: rank %d of %d: %s (%d problem(s))\n", case_names[c], me, N,
                first_problem, n_problems);
    if (!any_bad && me == 0)
        printf("chunks_check %s: ok on %d rank(s), %d chunks%s%s: out, dx, d_topk_w %s; expert "
               "weight gradients within %.2g of the largest\n", case_names[c], N, chunks,
               loopback ? ", loopback" : "", cuda ? ", cuda fp32" : "",
               cuda ? "within 1e-5" : "bit-identical", rel_max);
    model_free(&chk);
    model_free(&ref);
    comm_free(ep);
    MT_CHECK_MPI(MPI_Finalize());
    return any_bad ? 1 : 0;
}
