/* mpirun -np N dispatch_check CASE      (N divides 8; every rank is one EP rank of one EP group)
 *
 * Checks the MoE token dispatch of src/moe.c under expert parallelism, driven through the testing
 * hooks of model.h with a routing chosen here (not the router's):
 *  1. dispatch: each rank's expert-major rows x_exp are exactly the rows routed to its experts, in
 *     the documented order (local expert, then source rank, then token), with matching offsets and
 *     counts, and nothing else;
 *  2. combine: with expert e "computing" y = c_e·x, every token's output is Σ_j w_j·c_{e_j}·x_t;
 *  3. backward: dL/dy on the expert side is w·dout of the right token, dL/dw_j = c_{e_j}·<dout_t, x_t>,
 *     and with expert backward d_x = c_e·d_y the input gradient is Σ_j w_j·c_{e_j}·dout_t.
 * Rows are tagged: element c of token t on rank s is ((s·TMAX + t)·H + c + 1), exact in fp32, so a
 * row in the wrong place is never mistaken for a right one. Each rank's tokens count
 * T_s = 2·(3 + 2s) (uneven on purpose), and every rank knows every rank's routing (route_of).
 *
 * Cases: spread, cross, sparse, one_expert, one_rank, top1, topE, uneven (see route_of), and
 * corrupt (spread with one received value altered before checking: must FAIL, which shows the
 * checker can). Exit 0 on success; otherwise each failing rank prints one line and all exit 1. */
#include <math.h>
#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "common.h"
#include "config.h"
#include "model.h"
#include "ops.h"

#define E_ALL 8      /* experts */
#define HID 8        /* hidden size of the rows */
#define TMAX 64      /* bound on tokens per rank (for the tag) */
#define LAYER 0

enum kase { C_SPREAD, C_CROSS, C_SPARSE, C_ONE_EXPERT, C_ONE_RANK, C_TOP1, C_TOPE, C_UNEVEN, C_CORRUPT };
static const char *const case_names[] = {"spread", "cross", "sparse", "one_expert", "one_rank",
                                         "top1", "topE", "uneven", "corrupt"};
static const int case_k[] = {2, 4, 2, 1, 2, 1, E_ALL, 2, 2};

static char first_problem[512];
static int n_problems;

static void problem(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void problem(const char *fmt, ...)
{
    if (n_problems++ == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(first_problem, sizeof first_problem, fmt, ap);
        va_end(ap);
    }
}

static int tokens_of(int rank) { return 2 * (3 + 2 * rank); }
static float tag(int s, int t, int c) { return (float)((s * TMAX + t) * HID + c + 1); }
/* the gradient arriving at token t of rank s: another tagging, so x and dout cannot be confused */
static float dout_tag(int s, int t, int c) { return 0.25f * tag(s, t, c) - 3.0f; }
/* what expert e multiplies its rows by (dyadic, so c_e·x is exact) */
static float expert_scale(int e) { return 1.0f + 0.125f * (float)e; }

static uint32_t mix(uint32_t x)
{
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
    return x;
}

/* Token t of rank s: its K distinct experts, in the (unsorted) order a router could give them, and
 * distinct weights. */
static void route_of(enum kase c, int s, int t, int K, int32_t *idx, float *w)
{
    uint32_t h = mix((uint32_t)(s * 1000 + t) * 2654435761U);
    switch (c) {
    case C_SPREAD:
    case C_CORRUPT:
    case C_TOP1:
        idx[0] = (int32_t)(h % E_ALL);
        if (K > 1) idx[1] = (int32_t)((idx[0] + 1 + (h >> 8) % (E_ALL - 1)) % E_ALL);
        break;
    case C_CROSS:   /* one expert in each quarter of the experts: on 4 ranks, one per EP rank */
        for (int j = 0; j < K; j++) idx[j] = (int32_t)((K - 1 - j) * (E_ALL / 4) + (t + j) % 2);
        break;
    case C_SPARSE:  /* only experts 0, 1, 3: experts 2 and 4..7 (whole EP ranks) receive nothing */
        idx[0] = (int32_t)((int[]){3, 0, 1}[h % 3]);
        idx[1] = idx[0] == 3 ? (int32_t)((h >> 8) & 1) : 3;
        break;
    case C_ONE_EXPERT:  /* every token of every rank to expert 5 */
        idx[0] = 5;
        break;
    case C_ONE_RANK:    /* every token to the last two experts: one EP rank gets all the rows */
        idx[0] = E_ALL - 1;
        idx[1] = E_ALL - 2;
        break;
    case C_TOPE:        /* every expert, in a per-token rotated order */
        for (int j = 0; j < K; j++) idx[j] = (int32_t)((j + (int)(h % E_ALL)) % E_ALL);
        break;
    case C_UNEVEN:      /* rank s sends most first choices to one expert; counts differ widely */
        idx[0] = t % 5 ? (3 * s + 1) % E_ALL : (int32_t)(h % E_ALL);
        idx[1] = (int32_t)((idx[0] + 1 + (h >> 8) % (E_ALL - 1)) % E_ALL);
        break;
    }
    for (int j = 0; j < K; j++) w[j] = 0.1f + 0.2f * (float)j + 0.01f * (float)(t % 7);
}

/* The weight token (s, t) gives expert e, or 0 if it did not choose e. */
static float weight_for(enum kase c, int s, int t, int K, int e)
{
    int32_t idx[E_ALL];
    float w[E_ALL];
    route_of(c, s, t, K, idx, w);
    for (int j = 0; j < K; j++)
        if (idx[j] == e) return w[j];
    return 0.0f;
}

/* One expected expert-side row. */
struct row { int s, t, e; float w; };

static bool close_to(double got, double want, double scale)
{
    return fabs(got - want) <= 1e-6 * scale && isfinite(got);
}

static void check_route(const struct model *m, enum kase c, int me, int N, int K)
{
    const struct moe_route *r = &m->layers[LAYER].route;
    const int32_t *r_idx = m->layers[LAYER].topk_idx; /* CPU backend: host memory */
    const float *r_w = m->layers[LAYER].topk_w;
    const int T = m->T, nl = E_ALL / N;
    int64_t send[4] = {0}, pairs = 0;
    for (int t = 0; t < T; t++) {
        int32_t idx[E_ALL];
        float w[E_ALL];
        route_of(c, me, t, K, idx, w);
        /* token-once dispatch: one pair per rank the token uses, however many experts there */
        bool uses[4] = {false};
        for (int j = 0; j < K; j++) uses[idx[j] / nl] = true;
        for (int d = 0; d < N; d++) {
            send[d] += uses[d];
            pairs += uses[d];
        }
        /* the route holds the token's experts ascending, each with its own weight */
        for (int j = 0; j < K; j++) {
            int32_t e = r_idx[(size_t)t * K + j];
            if (j > 0 && e <= r_idx[(size_t)t * K + j - 1])
                problem("token %d: route's experts are not strictly ascending at choice %d", t, j);
            float want = weight_for(c, me, t, K, e);
            if (want == 0.0f || r_w[(size_t)t * K + j] != want)
                problem("token %d choice %d: expert %d with weight %g, expected weight %g", t, j, e,
                        r_w[(size_t)t * K + j], want);
        }
    }
    for (int d = 0; d < N; d++)
        if (r->send_counts[d] != send[d])
            problem("sends %lld pairs to EP rank %d, expected %lld", (long long)r->send_counts[d], d,
                    (long long)send[d]);
    if (r->P_send != pairs)
        problem("P_send %lld, expected %lld", (long long)r->P_send, (long long)pairs);
}

/* The rows this rank's experts must receive, in order: local expert, source rank, token; and
 * per_rank[s] = the pairs rank s sends here (its tokens with at least one expert here). */
static struct row *expected_rows(enum kase c, int me, int N, int K, int64_t *n_out, int64_t *per_rank)
{
    const int nl = E_ALL / N;
    int64_t cap = 0, n = 0;
    for (int s = 0; s < N; s++) cap += (int64_t)tokens_of(s) * K;
    struct row *rows = mt_malloc((size_t)MT_MAX(cap, 1) * sizeof *rows);
    for (int s = 0; s < N; s++) {
        per_rank[s] = 0;
        for (int t = 0; t < tokens_of(s); t++) {
            bool here = false;
            for (int e = me * nl; e < (me + 1) * nl; e++) here |= weight_for(c, s, t, K, e) != 0.0f;
            per_rank[s] += here;
        }
    }
    for (int e = me * nl; e < (me + 1) * nl; e++)
        for (int s = 0; s < N; s++)
            for (int t = 0; t < tokens_of(s); t++) {
                float w = weight_for(c, s, t, K, e);
                if (w == 0.0f) continue;
                rows[n++] = (struct row){s, t, e, w};
            }
    *n_out = n;
    return rows;
}

static void check_dispatch(const struct model *m, const struct row *rows, int64_t n,
                           const int64_t *per_rank, int me, int N)
{
    const struct layer_acts *a = &m->layers[LAYER];
    const struct moe_route *r = &a->route;
    const int nl = E_ALL / N;
    if (r->R_exp != n) {
        problem("expert-side rows %lld, expected %lld", (long long)r->R_exp, (long long)n);
        return;
    }
    for (int s = 0; s < N; s++)
        if (r->recv_counts[s] != per_rank[s])
            problem("received %lld pairs from rank %d, expected %lld", (long long)r->recv_counts[s], s,
                    (long long)per_rank[s]);
    if (r->expert_off[0] != 0) problem("expert_off[0] = %lld", (long long)r->expert_off[0]);
    for (int le = 0; le < nl; le++) {
        int64_t want = 0;
        for (int64_t i = 0; i < n; i++) want += rows[i].e == me * nl + le;
        if (r->expert_off[le + 1] - r->expert_off[le] != want)
            problem("local expert %d (global %d) has %lld rows, expected %lld", le, me * nl + le,
                    (long long)(r->expert_off[le + 1] - r->expert_off[le]), (long long)want);
    }
    const float *x = a->x_exp;
    for (int64_t i = 0; i < n; i++)
        for (int c = 0; c < HID; c++) {
            float want = tag(rows[i].s, rows[i].t, c);
            if (x[i * HID + c] != want) {
                problem("expert-side row %lld col %d holds %g, expected %g (token %d of rank %d, for "
                        "expert %d)", (long long)i, c, x[i * HID + c], want, rows[i].t, rows[i].s,
                        rows[i].e);
                return;
            }
        }
}

/* The combine: out[t] = Σ_j w_j c_{e_j} x_t; then the backward of combine and dispatch. */
static void check_combine_and_backward(struct model *m, enum kase c, const struct row *rows, int64_t n,
                                       int me, int K)
{
    const int T = m->T;
    const struct layer_acts *a = &m->layers[LAYER];
    float *y = mt_malloc((size_t)MT_MAX(n, 1) * HID * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        for (int col = 0; col < HID; col++)
            y[i * HID + col] = expert_scale(rows[i].e) * ((const float *)a->x_exp)[i * HID + col];
    float *out = mt_malloc((size_t)T * HID * sizeof(float));
    moe_combine_for_test(m, LAYER, y, out);

    float *dout = mt_malloc((size_t)T * HID * sizeof(float));
    for (int t = 0; t < T; t++)
        for (int col = 0; col < HID; col++) dout[t * HID + col] = dout_tag(me, t, col);
    for (int t = 0; t < T; t++) {
        int32_t idx[E_ALL];
        float w[E_ALL];
        route_of(c, me, t, K, idx, w);
        for (int col = 0; col < HID; col++) {
            double want = 0, scale = 0;
            for (int j = 0; j < K; j++) {
                double term = (double)w[j] * expert_scale(idx[j]) * tag(me, t, col);
                want += term;
                scale += fabs(term);
            }
            if (!close_to(out[t * HID + col], want, scale)) {
                problem("combine: token %d col %d is %.9g, expected %.9g", t, col, out[t * HID + col], want);
                t = T;
                break;
            }
        }
    }

    /* backward of the combine: expert-side dy = w·dout of the row's token, dw = c_e <dout, x> */
    moe_combine_backward_for_test(m, LAYER, dout);
    const float *dy = m->d_y_exp;
    for (int64_t i = 0; i < n; i++)
        for (int col = 0; col < HID; col++) {
            double want = (double)rows[i].w * dout_tag(rows[i].s, rows[i].t, col);
            if (!close_to(dy[i * HID + col], want, fabs(want))) {
                problem("combine backward: expert-side row %lld col %d is %.9g, expected %.9g (rank %d "
                        "token %d expert %d)", (long long)i, col, dy[i * HID + col], want, rows[i].s,
                        rows[i].t, rows[i].e);
                i = n;
                break;
            }
        }
    const int32_t *r_idx = a->topk_idx; /* CPU backend: host memory */
    for (int t = 0; t < T; t++)
        for (int j = 0; j < K; j++) {
            int e = r_idx[(size_t)t * K + j];
            double dot = 0, scale = 0;
            for (int col = 0; col < HID; col++) {
                double p = (double)dout_tag(me, t, col) * tag(me, t, col);
                dot += p;
                scale += fabs(p);
            }
            double want = expert_scale(e) * dot;
            float got = m->d_topk_w[(size_t)t * K + j];
            if (fabs(got - want) > 1e-6 * expert_scale(e) * scale || !isfinite(got)) {
                problem("combine backward: d weight of token %d choice %d (expert %d) is %.9g, "
                        "expected %.9g", t, j, e, got, want);
                t = T;
                break;
            }
        }

    /* backward of the dispatch: expert e's input gradient is c_e·dy; tokens get Σ_j w_j c_e dout */
    float *dx_exp = mt_malloc((size_t)MT_MAX(n, 1) * HID * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        for (int col = 0; col < HID; col++)
            dx_exp[i * HID + col] = expert_scale(rows[i].e) * rows[i].w * dout_tag(rows[i].s, rows[i].t, col);
    float *dx = mt_malloc((size_t)T * HID * sizeof(float));
    moe_dispatch_backward_for_test(m, LAYER, dx_exp, dx);
    for (int t = 0; t < T; t++) {
        int32_t idx[E_ALL];
        float w[E_ALL];
        route_of(c, me, t, K, idx, w);
        for (int col = 0; col < HID; col++) {
            double want = 0, scale = 0;
            for (int j = 0; j < K; j++) {
                double term = (double)w[j] * expert_scale(idx[j]) * dout_tag(me, t, col);
                want += term;
                scale += fabs(term);
            }
            if (!close_to(dx[t * HID + col], want, scale)) {
                problem("dispatch backward: dx of token %d col %d is %.9g, expected %.9g", t, col,
                        dx[t * HID + col], want);
                t = T;
                break;
            }
        }
    }
    free(y); free(out); free(dout); free(dx_exp); free(dx);
}

int main(int argc, char **argv)
{
    MT_CHECK_MPI(MPI_Init(&argc, &argv));
    int N = 0, me = 0;
    MT_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &N));
    MT_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &me));
    int kc = -1;
    for (int i = 0; argc == 2 && i < (int)(sizeof case_names / sizeof *case_names); i++)
        if (!strcmp(argv[1], case_names[i])) kc = i;
    if (kc < 0)
        mt_user_error("usage: dispatch_check spread|cross|sparse|one_expert|one_rank|top1|topE|uneven|corrupt");
    if (N > 4 || E_ALL % N) mt_user_error("dispatch_check: run with 1, 2 or 4 ranks, not %d", N);
    const enum kase c = (enum kase)kc;
    const int K = case_k[c];

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
    struct comm *ep = comm_mpi_create(MPI_COMM_WORLD);
    struct model m;
    model_init(&m, backend_cpu(), mc, 2, tokens_of(me) / 2, ep, false);
    MT_CHECK(m.T == tokens_of(me) && m.T <= TMAX, "model has %d tokens", m.T);

    int32_t *idx = mt_malloc((size_t)m.T * K * sizeof(int32_t));
    float *w = mt_malloc((size_t)m.T * K * sizeof(float));
    float *x = mt_malloc((size_t)m.T * HID * sizeof(float));
    for (int t = 0; t < m.T; t++) {
        route_of(c, me, t, K, idx + (size_t)t * K, w + (size_t)t * K);
        for (int col = 0; col < HID; col++) x[t * HID + col] = tag(me, t, col);
    }
    int64_t R = moe_dispatch_for_test(&m, LAYER, idx, w, x);
    if (c == C_CORRUPT && me == N - 1 && R > 0) ((float *)m.layers[LAYER].x_exp)[R * HID / 2] += 1.0f;

    int64_t n = 0, per_rank[4];
    struct row *rows = expected_rows(c, me, N, K, &n, per_rank);
    check_route(&m, c, me, N, K);
    check_dispatch(&m, rows, n, per_rank, me, N);
    /* the combine is collective: every rank goes on, or none does */
    int bad = n_problems > 0, any_bad = 0;
    MT_CHECK_MPI(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    if (!any_bad) {
        check_combine_and_backward(&m, c, rows, n, me, K);
        bad = n_problems > 0;
        MT_CHECK_MPI(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    }
    if (n_problems)
        fprintf(stderr, "dispatch_check %s: rank %d of %d: %s (%d problem(s))\n", case_names[c], me, N,
                first_problem, n_problems);
    if (!any_bad && me == 0)
        printf("dispatch_check %s: ok on %d rank(s), k = %d\n", case_names[c], N, K);

    free(rows); free(idx); free(w); free(x);
    model_free(&m);
    comm_free(ep);
    MT_CHECK_MPI(MPI_Finalize());
    return any_bad ? 1 : 0;
}
