/* The MLP half of a decoder layer. MoE layers: router, top-k, dispatch of token rows to the EP
 * ranks that hold their experts (all-to-all), grouped expert SwiGLU, the reverse all-to-all and the
 * weighted combine. Dense layers (mlp_only_layers / decoder_sparse_step): one SwiGLU MLP.
 *
 * Token-once dispatch (ep > 1). A token crosses to each EP rank it uses once, not once per expert
 * there: the sender moves one row per (token, rank) "pair", ordered by (rank, token), with the
 * pair's local experts and weights beside it (meta); the receiver copies each pair row to its
 * experts (expert-major rows: expert, source rank, token) and sends back ONE row per pair, the
 * weighted sum of its experts' outputs; the sender adds a token's pair rows in rank order. With
 * top-8 of 128 experts on 2 ranks that is ~2 rows per token on the wire instead of 8. The backward
 * mirrors it: dL/d(out) once per pair, the routing-weight gradients back as k floats per pair,
 * and the experts' input gradients summed per pair before they cross.
 * The fixed exchange (model.h rows_by_capacity) puts token t's pair with rank d at d·T + t, so the
 * rows each rank sends every rank are its token rows themselves: the dispatch (and the combine's
 * backward) is an all-gather, started before the router in the forward.
 * With ep = 1 the pairs are the tokens: no pair plan, no copies, the layer's top-k is the meta
 * (unless MT_MOE_LOOPBACK=1 sends them through the pair path and an exchange with itself).
 * parallel.moe_chunks > 1 runs the layer's exchange in chunks that overlap the expert GEMMs
 * (moe_exchange.c); 1 is the path below.
 * Each token's k choices are re-sorted by ascending expert id before anything uses them, so the
 * combine adds expert outputs in ascending expert order (transformers' eager order; across ranks
 * the per-rank partial sums are added in rank order, so meshes agree to rounding). */
#include <string.h>

#include "common.h"
#include "layer.h"
#include "mem_track.h"
#include "model.h"
#include "moe_buffers.h"
#include "moe_exchange.h"
#include "moe_wgrad_jobs.h"
#include "route_replay.h"
#include "router_opts.h"

static void *W(const struct model *m, enum tensor_role r, int l) { return model_weight(m, tensor_lookup(&m->tt, r, l)); }
static float *G(const struct model *m, enum tensor_role r, int l) { return model_grad(m, tensor_lookup(&m->tt, r, l)); }

/* the expert-side rows a layer uses, in backend memory (its route plan's last offset): R_exp
 * itself, but for the fixed exchange's plans, whose R_exp is the buffers' capacity */
static const int64_t *used_rows(const struct model *m, const struct moe_route *r)
{
    return r->expert_off + m->n_local_experts;
}

/* row counts per rank -> element counts, for rows of `width` elements */
static void scale_counts(const struct model *m, int64_t *in, int64_t *out, const int64_t *counts_in,
                         const int64_t *counts_out, int64_t width)
{
    for (int s = 0; s < m->ep; s++) {
        in[s] = counts_in[s] * width;
        out[s] = counts_out[s] * width;
    }
}

/* Moves rows of `width` elements of type t between EP ranks: `send` has counts_out[s] rows for
 * rank s, `recv` gets counts_in[s] rows from rank s. */
static void exchange(struct model *m, void *recv, const int64_t *counts_in, const void *send,
                     const int64_t *counts_out, int64_t width, enum comm_dtype t)
{
    int64_t in[m->ep], out[m->ep];
    scale_counts(m, in, out, counts_in, counts_out, width);
    comm_all_to_all_v(m->ep_comm, recv, in, send, out, t);
}

/* The same into the EP comm's inbox (comm.h): the rows a kernel reads once, right after they
 * land; returns them, valid until the next inbox exchange. */
static const void *exchange_in(struct model *m, const int64_t *counts_in, const void *send,
                               const int64_t *counts_out, int64_t width, enum comm_dtype t)
{
    int64_t in[m->ep], out[m->ep];
    scale_counts(m, in, out, counts_in, counts_out, width);
    return comm_all_to_all_inbox(m->ep_comm, in, send, out, t);
}

/* Hidden-state rows ([*, H], compute dtype), into the inbox */
static const void *exchange_rows(struct model *m, const int64_t *counts_in, const void *send,
                                 const int64_t *counts_out)
{
    return exchange_in(m, counts_in, send, counts_out, m->H, comm_dtype_of_x(m->be->x_size));
}

/* Each pair's K expert indices (i32) and weights (f32) to the rank holding its experts, both
 * arrays in one group of point-to-point transfers (the block to self is a copy): one launch and
 * one wait instead of an all-to-all each (NCCL: ~38 us a call on two H100s). */
static void exchange_meta(struct model *m, struct moe_route *r)
{
    struct comm *c = m->ep_comm;
    const int K = m->K;
    if (!c || c->size == 1) {
        exchange(m, r->meta_idx, r->recv_counts, m->meta_idx_send, r->send_counts, K, COMM_I32);
        exchange(m, r->meta_w, r->recv_counts, m->meta_w_send, r->send_counts, K, COMM_F32);
        return;
    }
    struct comm_p2p_op ops[4 * c->size];
    int n = 0;
    int64_t so = 0, ro = 0; /* elements before rank s's block in the send / receive arrays */
    for (int s = 0; s < c->size; s++) {
        const int64_t ns = r->send_counts[s] * K, nr = r->recv_counts[s] * K;
        if (s == c->rank) {
            m->be->copy(r->meta_idx + ro, m->meta_idx_send + so, (size_t)ns * sizeof(int32_t));
            m->be->copy(r->meta_w + ro, m->meta_w_send + so, (size_t)ns * sizeof(float));
        } else {
            if (ns > 0) {
                ops[n++] = (struct comm_p2p_op){COMM_SEND, s, m->meta_idx_send + so, (size_t)ns, COMM_I32};
                ops[n++] = (struct comm_p2p_op){COMM_SEND, s, m->meta_w_send + so, (size_t)ns, COMM_F32};
            }
            if (nr > 0) {
                ops[n++] = (struct comm_p2p_op){COMM_RECV, s, r->meta_idx + ro, (size_t)nr, COMM_I32};
                ops[n++] = (struct comm_p2p_op){COMM_RECV, s, r->meta_w + ro, (size_t)nr, COMM_F32};
            }
        }
        so += ns;
        ro += nr;
    }
    comm_p2p(c, ops, n);
}

/* Builds the dispatch plan of layer l from the router's top-k (see the file comment). Without
 * pairs the host waits for nothing: the expert offsets stay in backend memory for the expert
 * GEMMs, and the rows are T·k. With pairs and the fixed exchange (model.h) it waits for nothing
 * either: blocks of T pairs a rank and rows_cap expert rows (R_exp is then the capacity, the plan's
 * last offset the rows used). Otherwise the pair counts come to the host and cross ranks over MPI
 * with each rank's expert rows (one wait). */
static void route_plan(struct model *m, struct layer_acts *a, int l)
{
    const struct backend *be = m->be;
    struct moe_route *r = &a->route;
    const int T = m->T, K = m->K, E = m->E, nl = m->n_local_experts, ep = m->ep;
    r->by_token = false;
    if (!m->pairs) {
        r->meta_idx = a->topk_idx;
        r->meta_w = a->topk_w;
        be->moe_route_plan(a->topk_idx, a->topk_w, r->exp_src, r->exp_slot, r->expert_off, T, E, K);
        r->send_counts[0] = r->recv_counts[0] = r->P_send = r->P_recv = T;
        r->R_exp = (int64_t)T * K;
    } else if (m->rows_by_capacity) {
        /* blocks of T pairs (padding included) and rows_cap expert rows: every size the host
         * needs is known, so it reads nothing back (model.h fixed_exchange) */
        be->moe_pair_plan(a->topk_idx, a->topk_w, r->pair_tok, r->tok_pair, m->meta_idx_send,
                          m->meta_w_send, r->w_map, NULL, NULL, T, ep, nl, K, T);
        for (int s = 0; s < ep; s++) r->send_counts[s] = r->recv_counts[s] = T;
        r->P_send = r->P_recv = (int64_t)ep * T;
        r->by_token = true;
        moe_ensure_pairs(m, a, r->P_recv);
        exchange_meta(m, r);
        be->moe_route_plan(r->meta_idx, r->meta_w, r->exp_src, r->exp_slot, r->expert_off,
                           (int)r->P_recv, nl, K);
        r->R_exp = m->rows_cap[l];
        be->moe_rows_cap(r->expert_off, r->exp_src, r->exp_slot, m->rows_need + 2 * l, (int)(r->P_recv * K), nl,
                         r->R_exp);
        /* the pair sums (combine_rows, dispatch_rows_backward_send) take P_recv rows of the
         * expert-side scratch, more than the capacity where ep > 1.25 k */
        moe_ensure_scratch_rows(m, r->P_recv);
    } else {
        int64_t send_rows[ep];
        be->moe_pair_plan(a->topk_idx, a->topk_w, r->pair_tok, r->tok_pair, m->meta_idx_send,
                          m->meta_w_send, r->w_map, r->send_counts, send_rows, T, ep, nl, K, 0);
        r->R_exp = moe_exchange_counts(m, r->recv_counts, r->send_counts, send_rows);
        r->P_send = r->P_recv = 0;
        for (int s = 0; s < ep; s++) {
            r->P_send += r->send_counts[s];
            r->P_recv += r->recv_counts[s];
        }
        moe_ensure_pairs(m, a, r->P_recv);
        exchange_meta(m, r);
        /* its expert_off[nl] is R_exp, which the counts brought: nothing to read back */
        be->moe_route_plan(r->meta_idx, r->meta_w, r->exp_src, r->exp_slot, r->expert_off,
                           (int)r->P_recv, nl, K);
    }
    moe_ensure_rows(m, a, r->R_exp);
}

/* out = resid + the dense MLP of the normed rows */
static void dense_mlp_forward(struct model *m, struct layer_acts *a, int l, void *out,
                              const void *resid)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, Id = m->Id;
    be->matmul_forward(a->gu, a->m, W(m, TR_MLP_GATE_UP, l), T, H, 2 * Id);
    be->swiglu_forward(a->act, a->gu, T, Id, NULL);
    be->matmul_forward_residual(out, a->act, W(m, TR_MLP_DOWN, l), resid, T, Id, H);
}

static void dense_mlp_backward(struct model *m, struct layer_acts *a, int l)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, Id = m->Id;
    be->matmul_backward(m->d_act, G(m, TR_MLP_DOWN, l), m->d_h, a->act, W(m, TR_MLP_DOWN, l), T, Id,
                        H, false);
    be->swiglu_backward(m->d_gu, m->d_act, a->gu, T, Id, NULL);
    be->matmul_backward(m->d_t1, G(m, TR_MLP_GATE_UP, l), m->d_gu, a->m, W(m, TR_MLP_GATE_UP, l), T,
                        H, 2 * Id, false);
}

/* The fixed exchange's token rows on every EP rank (an all-gather into the inbox), started where
 * the rows exist: moe_forward starts it before the router, so that the rows cross while the router
 * and the route plan run. */
struct token_rows {
    const void *rows; /* the inbox: rank s's T rows at s·T, once req is waited for */
    struct comm_p2p_req req;
};

static bool rows_by_token(const struct model *m) { return m->pairs && m->rows_by_capacity && m->moe_chunks == 1; }

static void token_rows_start(struct model *m, const void *x, struct token_rows *tr)
{
    tr->rows = comm_all_gather_inbox_start(m->ep_comm, x, (size_t)m->T * m->H, comm_dtype_of_x(m->be->x_size),
                                           &tr->req);
}

/* Token side -> expert side: the layer's norm output rows in expert-major order (x_exp); with
 * ep > 1 one row per pair crosses (from m->d_x_send, free during the forward), or in the fixed
 * layout every token row (`early`: already started, or NULL). */
static void dispatch_rows(struct model *m, struct layer_acts *a, struct token_rows *early)
{
    const struct backend *be = m->be;
    const int H = m->H;
    struct moe_route *r = &a->route;
    const void *src = a->m;
    MT_CHECK(!early || r->by_token, "dispatch_rows: token rows started for a packed plan");
    if (m->pairs && r->by_token) {
        struct token_rows now;
        if (!early) token_rows_start(m, a->m, early = &now);
        comm_p2p_wait(m->ep_comm, &early->req);
        src = early->rows;
    } else if (m->pairs) {
        be->gather_rows(m->d_x_send, a->m, r->pair_tok, (int)r->P_send, H);
        src = exchange_rows(m, r->recv_counts, m->d_x_send, r->send_counts);
    }
    be->gather_rows(a->x_exp, src, r->exp_src, (int)r->R_exp, H);
}

/* Expert side -> token side: the weighted sum of each pair's expert outputs; with ep > 1 the pair
 * rows (in d_x_exp, free during the forward) go back and each token adds its pairs. resid (or
 * NULL): the layer's residual, added in the same pass. */
static void combine_rows(struct model *m, struct layer_acts *a, void *out, const void *resid)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, K = m->K;
    struct moe_route *r = &a->route;
    if (!m->pairs) {
        be->moe_combine_forward(out, a->y_exp, r->exp_slot, r->meta_w, resid, T, K, H);
        return;
    }
    be->moe_combine_forward(m->d_x_exp, a->y_exp, r->exp_slot, r->meta_w, NULL, (int)r->P_recv, K, H);
    int64_t in[m->ep], out_n[m->ep]; /* back the way the dispatch came */
    scale_counts(m, in, out_n, r->send_counts, r->recv_counts, H);
    struct comm_p2p_req req;
    const void *pairs = comm_all_to_all_inbox_start(m->ep_comm, in, m->d_x_exp, out_n, comm_dtype_of_x(be->x_size), &req);
    moe_wgrad_jobs_fill(m, &req); /* the rank whose experts had fewer rows waits here */
    comm_p2p_wait(m->ep_comm, &req);
    be->moe_combine_forward(out, pairs, r->tok_pair, m->ones, resid, T, K, H);
}

#define ROW(m, p, i) MT_XP(m, p, (int64_t)(i) * (m)->H)

/* The rows of this rank's own pairs: the received pairs [*p_lo, *p_hi) (the blocks arrive in rank
 * order) */
static void own_pairs(const struct model *m, const struct moe_route *r, int64_t *p_lo, int64_t *p_hi)
{
    int64_t lo = 0;
    for (int s = 0; s < m->ep_rank; s++) lo += r->recv_counts[s];
    *p_lo = lo;
    *p_hi = lo + r->recv_counts[m->ep_rank];
}

/* The down projection and combine_rows with the other ranks' rows first (parallel.
 * moe_combine_self_last): the rows of their pairs go through the down projection, their pair sums
 * start home, and this rank's own rows run while they cross, their sums written straight into the
 * inbox's block to self (comm_all_to_all_inbox_start_self_later). Each row and each pair sum is
 * computed as in experts_forward's one piece, so the bits are the same; the transfer the forward
 * otherwise waits for with nothing to run (docs/benchmarks.md) has this rank's share of the down
 * projection under it. */
static void down_and_combine_self_last(struct model *m, struct layer_acts *a, int l, void *out, const void *resid)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, K = m->K, I = m->I, nl = m->n_local_experts;
    struct moe_route *r = &a->route;
    const void *w_down = W(m, TR_EXP_DOWN, l);
    if (!m->rows_split) {
        enum mem_cat was = mem_track_set(MEM_BUFFERS);
        m->rows_split = be->alloc(2 * ((size_t)nl + 1) * sizeof(int64_t));
        mem_track_set(was);
    }
    int64_t *lo = m->rows_split, *hi = lo + nl + 1; /* each expert's own rows: [lo[e], hi[e]) */
    int64_t p_lo, p_hi;
    own_pairs(m, r, &p_lo, &p_hi);
    const int64_t P = r->P_recv;
    be->moe_rows_split(lo, hi, r->expert_off, r->exp_src, nl, p_lo, p_hi);
    /* the rows of the ranks before this one, [off[e], lo[e]), and after it, [hi[e], off[e+1]) */
    if (p_lo > 0) be->expert_matmul_forward(a->y_exp, a->act, w_down, r->expert_off, lo, r->R_exp, nl, I, H);
    if (p_hi < P) be->expert_matmul_forward(a->y_exp, a->act, w_down, hi, r->expert_off + 1, r->R_exp, nl, I, H);
    if (p_lo > 0) be->moe_combine_forward(m->d_x_exp, a->y_exp, r->exp_slot, r->meta_w, NULL, (int)p_lo, K, H);
    if (p_hi < P)
        be->moe_combine_forward(ROW(m, m->d_x_exp, p_hi), a->y_exp, r->exp_slot + p_hi * K, r->meta_w + p_hi * K,
                                NULL, (int)(P - p_hi), K, H);
    int64_t in[m->ep], out_n[m->ep]; /* back the way the dispatch came */
    scale_counts(m, in, out_n, r->send_counts, r->recv_counts, H);
    struct comm_p2p_req req;
    void *pairs = comm_all_to_all_inbox_start_self_later(m->ep_comm, in, m->d_x_exp, out_n,
                                                         comm_dtype_of_x(be->x_size), &req);
    int64_t home = 0; /* where the block to self sits in the inbox: after the earlier ranks' */
    for (int s = 0; s < m->ep_rank; s++) home += r->send_counts[s];
    be->expert_matmul_forward(a->y_exp, a->act, w_down, lo, hi, r->R_exp, nl, I, H);
    be->moe_combine_forward(ROW(m, pairs, home), a->y_exp, r->exp_slot + p_lo * K, r->meta_w + p_lo * K, NULL,
                            (int)(p_hi - p_lo), K, H);
    moe_wgrad_jobs_fill(m, &req); /* the rank whose experts had fewer rows waits here */
    comm_p2p_wait(m->ep_comm, &req);
    be->moe_combine_forward(out, pairs, r->tok_pair, m->ones, resid, T, K, H);
}

/* Backward of combine_rows: m->d_h (dL/d out) -> m->d_y_exp (expert-major) and the routing
 * weights' gradients. With pairs those go home by an inbox exchange left in flight (returned, with
 * *w_req): combine_weights_home finishes it into m->d_topk_w, after the expert backward's GEMMs
 * (which need neither) and before the next inbox exchange, so its latency hides under them.
 * Without pairs m->d_topk_w is written here and NULL returned. */
static const float *combine_rows_backward(struct model *m, struct layer_acts *a, int finish, struct comm_p2p_req *w_req)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, K = m->K;
    struct moe_route *r = &a->route;
    w_req->state = NULL;
    if (!m->pairs) {
        be->moe_combine_backward(m->d_y_exp, m->d_topk_w, m->d_h, a->y_exp, r->exp_slot, r->meta_w,
                                 T, K, H);
        return NULL;
    }
    struct comm_p2p_req req = {0};
    const void *d_pairs;
    if (r->by_token) { /* every rank's block is dL/d(out) itself */
        d_pairs = comm_all_gather_inbox_start(m->ep_comm, m->d_h, (size_t)T * H, comm_dtype_of_x(be->x_size), &req);
    } else {
        be->gather_rows(m->d_x_send, m->d_h, r->pair_tok, (int)r->P_send, H);
        int64_t in[m->ep], out[m->ep];
        scale_counts(m, in, out, r->recv_counts, r->send_counts, H);
        d_pairs = comm_all_to_all_inbox_start(m->ep_comm, in, m->d_x_send, out, comm_dtype_of_x(be->x_size), &req);
    }
    model_run_deferred_wgrads(m, 1); /* the layer above's o_proj weight gradient, while the rows move */
    if (finish >= 0) moe_wgrad_job_finish(m, finish); /* its deadline, while the rows move */
    moe_wgrad_jobs_fill(m, &req);
    comm_p2p_wait(m->ep_comm, &req);
    be->moe_combine_backward(m->d_y_exp, m->d_w_recv, d_pairs, a->y_exp, r->exp_slot, r->meta_w,
                             (int)r->P_recv, K, H);
    int64_t in[m->ep], out[m->ep];
    scale_counts(m, in, out, r->send_counts, r->recv_counts, K);
    return comm_all_to_all_inbox_start(m->ep_comm, in, m->d_w_recv, out, COMM_F32, w_req);
}

/* m->d_topk_w from combine_rows_backward's exchange (nothing to do without pairs) */
static void combine_weights_home(struct model *m, struct layer_acts *a, const float *d_w, struct comm_p2p_req *w_req)
{
    if (!m->pairs) return;
    comm_p2p_wait(m->ep_comm, w_req);
    m->be->gather_f32(m->d_topk_w, d_w, a->route.w_map, m->T * m->K);
}

/* Backward of dispatch_rows: m->d_x_exp (expert-major) -> m->d_t1 = dL/d(norm output) through the
 * experts (overwritten; the router term is added after). Each token's (or pair's) rows are summed
 * in ascending row order: the gather's backward as a unit-weight combine, no scatter. In two
 * halves: the pair rows leave (with ep > 1), then the token side sums them; work queued between
 * the two runs while the rows move (the experts' weight gradients, experts_backward). */
static const void *dispatch_rows_backward_send(struct model *m, struct layer_acts *a, struct comm_p2p_req *req)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, K = m->K;
    struct moe_route *r = &a->route;
    req->state = NULL;
    if (!m->pairs) {
        be->moe_combine_forward(m->d_t1, m->d_x_exp, r->exp_slot, m->ones, NULL, T, K, H);
        return NULL;
    }
    /* d_y_exp is free once the expert backward has run */
    be->moe_combine_forward(m->d_y_exp, m->d_x_exp, r->exp_slot, m->ones, NULL, (int)r->P_recv, K, H);
    int64_t in[m->ep], out[m->ep];
    scale_counts(m, in, out, r->send_counts, r->recv_counts, H);
    return comm_all_to_all_inbox_start(m->ep_comm, in, m->d_y_exp, out, comm_dtype_of_x(be->x_size), req);
}

static void dispatch_rows_backward_sum(struct model *m, struct layer_acts *a, const void *d_pairs,
                                       struct comm_p2p_req *req)
{
    if (!m->pairs) return;
    comm_p2p_wait(m->ep_comm, req);
    m->be->moe_combine_forward(m->d_t1, d_pairs, a->route.tok_pair, m->ones, NULL, m->T, m->K, m->H);
}

/* From the layer's top-k (a->topk_idx/topk_w) and norm output (a->m) to the experts' weighted sum
 * `out` (+ resid unless NULL): route plan, dispatch, expert SwiGLU, combine (in chunks when
 * parallel.moe_chunks > 1). */
static void experts_forward(struct model *m, struct layer_acts *a, int l, void *out, const void *resid,
                            struct token_rows *early)
{
    const struct backend *be = m->be;
    const int H = m->H, I = m->I, nl = m->n_local_experts;
    struct moe_route *r = &a->route;
    if (m->moe_chunks > 1) {
        moe_exchange_forward(m, a, l, out, resid);
        return;
    }
    route_plan(m, a, l);
    dispatch_rows(m, a, early);
    be->expert_matmul_forward(a->gu, a->x_exp, W(m, TR_EXP_GATE_UP, l), r->expert_off, NULL, r->R_exp, nl,
                              H, 2 * I);
    be->swiglu_forward(a->act, a->gu, (int)r->R_exp, I, used_rows(m, r));
    if (m->pairs && m->combine_self_last) {
        down_and_combine_self_last(m, a, l, out, resid);
        return;
    }
    be->expert_matmul_forward(a->y_exp, a->act, W(m, TR_EXP_DOWN, l), r->expert_off, NULL, r->R_exp, nl, I,
                              H);
    combine_rows(m, a, out, resid);
}

/* Its backward: m->d_h (dL/d out) -> m->d_t1 (through the experts), m->d_topk_w and the experts'
 * weight gradients. */
static void experts_backward(struct model *m, struct layer_acts *a, int l)
{
    const struct backend *be = m->be;
    const int H = m->H, I = m->I, nl = m->n_local_experts;
    struct moe_route *r = &a->route;
    if (m->moe_chunks > 1) {
        moe_exchange_backward(m, a, l);
        return;
    }
    float *dw_down = G(m, TR_EXP_DOWN, l), *dw_gu = G(m, TR_EXP_GATE_UP, l);
    /* parallel.expert_wgrad_pairs / expert_wgrad_group: this micro-step's weight gradients wait
     * for a later one's (stashed while the group has room and another backward follows), or the
     * waiting ones join this micro-step's in one pass over dw (grouped, stash first) */
    struct expert_wgrad_stash *s = m->wstash && m->wstash[l].n_slots ? &m->wstash[l] : NULL;
    /* a job this layer queued in its last backward finishes first: its slots are the stash's */
    struct comm_p2p_req w_req;
    const float *d_w = combine_rows_backward(m, a, l, &w_req);
    moe_wgrad_job_finish(m, l); /* without pairs (no jobs then: a no-op) */
    const bool stashed = s && s->pending < s->n_slots && m->more_backwards && dw_down && dw_gu;
    const bool grouped = s && s->pending > 0 && !stashed;
    /* a grouped micro-step's weight gradients become a job (moe_wgrad_jobs.h) while another
     * backward follows, to fill later exchanges' waits */
    const bool queued = grouped && m->wgrad_jobs && m->more_backwards;
    const bool now = !grouped && !stashed;
    const bool fresh = m->exp_dw_fresh[l];
    if (!stashed) m->exp_dw_fresh[l] = false;
    const int64_t R = r->R_exp;
    struct expert_rows sets[MT_WGRAD_MAX_SETS];
    const int n_sets = grouped ? s->pending + 1 : 0;
    be->expert_matmul_backward(m->d_act, now ? dw_down : NULL, m->d_y_exp, a->act,
                               W(m, TR_EXP_DOWN, l), r->expert_off, R, nl, I, H, fresh);
    if (grouped && !queued) {
        for (int k = 0; k < s->pending; k++)
            sets[k] = (struct expert_rows){s->slot[k].d_y_exp, s->slot[k].act, s->slot[k].off, s->slot[k].rows};
        sets[s->pending] = (struct expert_rows){m->d_y_exp, a->act, r->expert_off, R};
        be->expert_matmul_wgrad_sets(dw_down, sets, n_sets, nl, I, H, fresh);
    }
    be->swiglu_backward(m->d_gu, m->d_act, a->gu, (int)R, I, used_rows(m, r));
    be->expert_matmul_backward(m->d_x_exp, now ? dw_gu : NULL, m->d_gu, a->x_exp,
                               W(m, TR_EXP_GATE_UP, l), r->expert_off, R, nl, H, 2 * I, fresh);
    /* parking swaps d_y_exp out before the send half reuses it; the grouped gate_up weight
     * gradient (reads d_gu and x_exp) runs while d_x_exp's pair rows move to their tokens' ranks */
    combine_weights_home(m, a, d_w, &w_req); /* before the next inbox exchange */
    if (stashed || queued) moe_stash_expert_rows(m, a, s);
    if (queued) moe_wgrad_job_queue(m, l, fresh);
    struct comm_p2p_req req;
    const void *d_pairs = dispatch_rows_backward_send(m, a, &req);
    if (m->pairs) model_run_deferred_wgrads(m, 1); /* the layer above's q_proj weight gradient */
    if (grouped && !queued) {
        for (int k = 0; k < s->pending; k++)
            sets[k] = (struct expert_rows){s->slot[k].d_gu, s->slot[k].x_exp, s->slot[k].off, s->slot[k].rows};
        sets[s->pending] = (struct expert_rows){m->d_gu, a->x_exp, r->expert_off, R};
        be->expert_matmul_wgrad_sets(dw_gu, sets, n_sets, nl, H, 2 * I, fresh);
        s->pending = 0;
    }
    dispatch_rows_backward_sum(m, a, d_pairs, &req);
}

static void moe_forward(struct model *m, struct layer_acts *a, int l, void *out, const void *resid)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, E = m->E, K = m->K;
    struct token_rows early = {0};
    if (rows_by_token(m)) token_rows_start(m, a->m, &early); /* crosses while the router runs */
    if (m->router_f32) {
        be->router_matmul_forward(a->logits, a->m, W(m, TR_ROUTER, l), T, H, E);
    } else { /* transformers' bf16 router: the logits are rounded to bf16, softmax upcasts them */
        be->matmul_forward(m->d_logits_r, a->m, W(m, TR_ROUTER, l), T, H, E);
        be->cast_x_to_f32(a->logits, m->d_logits_r, (size_t)T * E);
    }
    const struct router_opts ro = router_opts_of(&m->cfg);
    be->router_forward(a->topk_idx, a->topk_w, a->probs, a->logits,
                       m->bias ? m->bias + (size_t)l * E : NULL, T, E, K, &ro);
    route_replay_apply(m, l, a->topk_idx, a->topk_w, a->probs); /* data.routing_replay, recompute */
    float *st = m->stats + (size_t)l * 2 * E;
    if (!m->recomputing) be->router_stats(st, st + E, a->probs, a->topk_idx, T, E, K);
    experts_forward(m, a, l, out, resid, rows_by_token(m) ? &early : NULL);
}

static void moe_backward(struct model *m, struct layer_acts *a, int l)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, E = m->E, K = m->K;
    experts_backward(m, a, l);
    /* model.train_router false, or weights fixed by a routing file: the routing weights were
     * detached before they scaled the expert outputs, so only the aux term reaches the router */
    if (!m->cfg.train_router || route_replay_weights_fixed(m)) be->zero(m->d_topk_w, (size_t)T * K * sizeof(float));
    /* dlogits overwrite the layer's logits (the forward's last reader was router_forward) */
    const struct router_opts ro = router_opts_of(&m->cfg);
    be->router_backward(a->logits, m->d_topk_w, a->probs, a->topk_idx,
                        m->aux_active ? m->aux_dp : NULL, T, E, K, &ro);
    int ri = tensor_lookup(&m->tt, TR_ROUTER, l);
    float *dwg = m->tt.t[ri].frozen ? NULL : model_grad(m, ri);
    if (m->router_f32) {
        be->router_matmul_backward(m->d_t1, dwg, a->logits, a->m, model_weight(m, ri), T, H, E, true);
    } else {
        be->cast_f32_to_x(m->d_logits_r, a->logits, (size_t)T * E);
        be->matmul_backward(m->d_t1, dwg, m->d_logits_r, a->m, model_weight(m, ri), T, H, E, true);
    }
}

void mlp_forward(struct model *m, int l, void *out)
{
    struct layer_acts *a = model_acts(m, l);
    m->be->rmsnorm_forward(a->m, a->rstd_m, a->h_mid, W(m, TR_MLP_NORM, l), m->T, m->H,
                           (float)m->cfg.rms_norm_eps);
    if (config_layer_is_moe(&m->cfg, l)) {
        moe_forward(m, a, l, out, a->h_mid); /* the residual joins the combine's pass */
    } else {
        dense_mlp_forward(m, a, l, out, a->h_mid);
    }
}

void mlp_backward(struct model *m, int l)
{
    struct layer_acts *a = model_acts(m, l);
    /* both paths leave dL/d(norm output) in d_t1 */
    if (config_layer_is_moe(&m->cfg, l)) moe_backward(m, a, l);
    else dense_mlp_backward(m, a, l);
    m->be->rmsnorm_backward(m->d_h, G(m, TR_MLP_NORM, l), m->d_t1, a->h_mid, W(m, TR_MLP_NORM, l),
                            a->rstd_m, m->T, m->H, true);
}

/* ---- Testing hooks (tests/mpi/dispatch_check.c) ------------------------------------------------
 * The dispatch and combine of MoE layer l driven by a routing the caller chooses instead of the
 * router. Thin wrappers over the functions moe_forward / moe_backward run; the model never calls
 * them. Buffers are backend memory. */

static struct layer_acts *test_layer(struct model *m, int l)
{
    MT_CHECK(l >= 0 && l < m->L && config_layer_is_moe(&m->cfg, l), "layer %d is not an MoE layer", l);
    return model_acts(m, l);
}

static void copy_in(const struct model *m, void *dst, const void *src, int64_t rows)
{
    if (dst != src && rows > 0) m->be->copy(dst, src, (size_t)rows * m->H * m->be->x_size);
}

int64_t moe_dispatch_for_test(struct model *m, int l, const int32_t *topk_idx_host,
                              const float *topk_w_host, const void *x)
{
    struct layer_acts *a = test_layer(m, l);
    const struct backend *be = m->be;
    const size_t tk = (size_t)m->T * m->K;
    be->upload(a->topk_idx, topk_idx_host, tk * sizeof(int32_t));
    be->upload(a->topk_w, topk_w_host, tk * sizeof(float));
    copy_in(m, a->m, x, m->T);
    route_plan(m, a, l);
    dispatch_rows(m, a, NULL);
    return a->route.R_exp;
}

void moe_combine_for_test(struct model *m, int l, const void *y_exp, void *out)
{
    struct layer_acts *a = test_layer(m, l);
    copy_in(m, a->y_exp, y_exp, a->route.R_exp);
    combine_rows(m, a, out, NULL);
}

void moe_combine_backward_for_test(struct model *m, int l, const void *dout)
{
    struct layer_acts *a = test_layer(m, l);
    copy_in(m, m->d_h, dout, m->T);
    struct comm_p2p_req w_req;
    const float *d_w = combine_rows_backward(m, a, -1, &w_req);
    combine_weights_home(m, a, d_w, &w_req);
}

void moe_dispatch_backward_for_test(struct model *m, int l, const void *d_x_exp, void *dx)
{
    struct layer_acts *a = test_layer(m, l);
    copy_in(m, m->d_x_exp, d_x_exp, a->route.R_exp);
    struct comm_p2p_req req;
    const void *d_pairs = dispatch_rows_backward_send(m, a, &req);
    dispatch_rows_backward_sum(m, a, d_pairs, &req);
    copy_in(m, dx, m->d_t1, m->T);
}

void moe_experts_for_test(struct model *m, int l, const int32_t *topk_idx_host, const float *topk_w_host,
                          const void *x, void *out)
{
    struct layer_acts *a = test_layer(m, l);
    const struct backend *be = m->be;
    const size_t tk = (size_t)m->T * m->K;
    be->upload(a->topk_idx, topk_idx_host, tk * sizeof(int32_t));
    be->upload(a->topk_w, topk_w_host, tk * sizeof(float));
    copy_in(m, a->m, x, m->T);
    experts_forward(m, a, l, out, NULL, NULL);
}

void moe_experts_backward_for_test(struct model *m, int l, const void *dout, void *dx)
{
    struct layer_acts *a = test_layer(m, l);
    copy_in(m, m->d_h, dout, m->T);
    experts_backward(m, a, l);
    copy_in(m, dx, m->d_t1, m->T);
}
