/* The MoE layer's token dispatch and combine (moe.c's rows between the token side and the expert
 * side). Token-once dispatch (ep > 1): a token crosses to each EP rank it uses once, not once per
 * expert there: the sender moves one row per (token, rank) "pair", ordered by (rank, token), with
 * the pair's local experts and weights beside it (meta); the receiver copies each pair row to its
 * experts (expert-major rows: expert, source rank, token) and sends back ONE row per pair, the
 * weighted sum of its experts' outputs; the sender adds a token's pair rows in rank order. With
 * top-8 of 128 experts on 2 ranks that is ~2 rows per token on the wire instead of 8. The backward
 * mirrors it: dL/d(out) once per pair, the routing-weight gradients back as k floats per pair,
 * and the experts' input gradients summed per pair before they cross.
 * The fixed exchange (model.h rows_by_capacity) puts token t's pair with rank d at d·T + t, so the
 * rows each rank sends every rank are its token rows themselves: the dispatch (and the combine's
 * backward) is an all-gather, started before the router in the forward.
 * With ep = 1 the pairs are the tokens: no pair plan, no copies, the layer's top-k is the meta
 * (unless MT_MOE_LOOPBACK=1 sends them through the pair path and an exchange with itself). */

#include "common.h"
#include "mem_track.h"
#include "model.h"
#include "moe_buffers.h"
#include "moe_dispatch.h"
#include "moe_exchange.h"
#include "moe_wgrad_jobs.h"

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
void moe_route_layer(struct model *m, struct layer_acts *a, int l)
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
        /* the pair sums (moe_combine_rows, moe_dispatch_rows_backward_send) take P_recv rows of the
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

bool moe_rows_by_token(const struct model *m) { return m->pairs && m->rows_by_capacity && m->moe_chunks == 1; }

/* With the self-last combine the dispatch reads this rank's own rows from x, not the inbox, so the
 * all-gather skips the copy to self (moe_dispatch_rows) */
void moe_token_rows_start(struct model *m, const void *x, struct token_rows *tr)
{
    const size_t n = (size_t)m->T * m->H;
    const enum comm_dtype t = comm_dtype_of_x(m->be->x_size);
    tr->rows = m->combine_self_last ? comm_all_gather_inbox_start_others(m->ep_comm, x, n, t, &tr->req)
                                    : comm_all_gather_inbox_start(m->ep_comm, x, n, t, &tr->req);
}

/* Token side -> expert side: the layer's norm output rows in expert-major order (x_exp); with
 * ep > 1 one row per pair crosses (from m->d_x_send, free during the forward), or in the fixed
 * layout every token row (`early`: already started, or NULL). */
void moe_dispatch_rows(struct model *m, struct layer_acts *a, struct token_rows *early)
{
    const struct backend *be = m->be;
    const int H = m->H;
    struct moe_route *r = &a->route;
    const void *src = a->m;
    MT_CHECK(!early || r->by_token, "moe_dispatch_rows: token rows started for a packed plan");
    if (m->pairs && r->by_token) {
        struct token_rows now;
        if (!early) moe_token_rows_start(m, a->m, early = &now);
        if (m->combine_self_last) {
            /* this rank's own token rows (pairs [lo, lo + T)) from a->m while the others cross,
             * then theirs from the inbox (the pairs before lo and after lo + T): every row as the
             * one copy would write it */
            const int T = m->T, K = m->K, lo = m->ep_rank * T, hi = lo + T, P = (int)r->P_recv;
            if (m->dispatch_by_gather) {
                be->gather_rows_part(a->x_exp, a->m, r->exp_src, (int)r->R_exp, H, lo, hi, true);
                comm_p2p_wait(m->ep_comm, &early->req);
                be->gather_rows_part(a->x_exp, early->rows, r->exp_src, (int)r->R_exp, H, lo, hi, false);
                return;
            }
            be->dispatch_rows(a->x_exp, a->m, r->exp_slot + (int64_t)lo * K, T, K, H);
            comm_p2p_wait(m->ep_comm, &early->req);
            be->dispatch_rows(a->x_exp, early->rows, r->exp_slot, lo, K, H);
            be->dispatch_rows(a->x_exp, MT_XP(m, early->rows, (int64_t)hi * H), r->exp_slot + (int64_t)hi * K,
                              P - hi, K, H);
            return;
        }
        comm_p2p_wait(m->ep_comm, &early->req);
        src = early->rows;
    } else if (m->pairs) {
        be->gather_rows(m->d_x_send, a->m, r->pair_tok, (int)r->P_send, H);
        src = exchange_rows(m, r->recv_counts, m->d_x_send, r->send_counts);
    }
    if (m->dispatch_by_gather)
        be->gather_rows(a->x_exp, src, r->exp_src, (int)r->R_exp, H);
    else
        be->dispatch_rows(a->x_exp, src, r->exp_slot, (int)r->P_recv, m->K, H);
}

/* Expert side -> token side: the weighted sum of each pair's expert outputs; with ep > 1 the pair
 * rows (in d_x_exp, free during the forward) go back and each token adds its pairs. resid (or
 * NULL): the layer's residual, added in the same pass. */
void moe_combine_rows(struct model *m, struct layer_acts *a, void *out, const void *resid)
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

/* The down projection and moe_combine_rows with the other ranks' rows first (parallel.
 * moe_combine_self_last): the rows of their pairs go through the down projection, their pair sums
 * start home, and this rank's own rows run while they cross, their sums written straight into the
 * inbox's block to self (comm_all_to_all_inbox_start_self_later). Each row and each pair sum is
 * computed as in experts_forward's one piece, so the bits are the same; the transfer the forward
 * otherwise waits for with nothing to run (docs/benchmarks.md) has this rank's share of the down
 * projection under it. */
void moe_down_and_combine_self_last(struct model *m, struct layer_acts *a, int l, void *out, const void *resid)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, K = m->K, I = m->I, nl = m->n_local_experts;
    struct moe_route *r = &a->route;
    const void *w_down = weight_of(m, TR_EXP_DOWN, l);
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
/* Backward of moe_combine_rows: m->d_h (dL/d out) -> m->d_y_exp (expert-major) and the routing
 * weights' gradients. With pairs those go home by an inbox exchange left in flight (returned, with
 * *w_req): moe_combine_weights_home finishes it into m->d_topk_w, after the expert backward's GEMMs
 * (which need neither) and before the next inbox exchange, so its latency hides under them.
 * Without pairs m->d_topk_w is written here and NULL returned. */
const float *moe_combine_rows_backward(struct model *m, struct layer_acts *a, int finish, struct comm_p2p_req *w_req)
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
    const void *d_pairs, *own; /* own: this rank's own pairs' rows, the block it sends itself */
    if (r->by_token) { /* every rank's block is dL/d(out) itself; self last reads its own from d_h */
        const size_t n = (size_t)T * H;
        const enum comm_dtype t = comm_dtype_of_x(be->x_size);
        d_pairs = m->combine_self_last ? comm_all_gather_inbox_start_others(m->ep_comm, m->d_h, n, t, &req)
                                       : comm_all_gather_inbox_start(m->ep_comm, m->d_h, n, t, &req);
        own = m->d_h;
    } else {
        be->gather_rows(m->d_x_send, m->d_h, r->pair_tok, (int)r->P_send, H);
        int64_t in[m->ep], out[m->ep];
        scale_counts(m, in, out, r->recv_counts, r->send_counts, H);
        d_pairs = comm_all_to_all_inbox_start(m->ep_comm, in, m->d_x_send, out, comm_dtype_of_x(be->x_size), &req);
        int64_t before = 0; /* the send blocks of the ranks before this one */
        for (int s = 0; s < m->ep_rank; s++) before += r->send_counts[s];
        own = ROW(m, m->d_x_send, before);
    }
    /* parallel.moe_combine_self_last: the own pairs' rows first, under the other ranks' transfer
     * (the copy engines read the same send rows; nothing writes them). Each pair's gradient rows
     * and routing-weight gradients are computed as in one call: the same bits. */
    int64_t p_lo = 0, p_hi = 0; /* the received pairs that are this rank's own */
    const int64_t P = r->P_recv;
    if (m->combine_self_last) {
        own_pairs(m, r, &p_lo, &p_hi);
        if (p_hi > p_lo)
            be->moe_combine_backward(m->d_y_exp, m->d_w_recv + p_lo * K, own, a->y_exp, r->exp_slot + p_lo * K,
                                     r->meta_w + p_lo * K, (int)(p_hi - p_lo), K, H);
    }
    model_run_deferred_wgrads(m, 1); /* the layer above's o_proj weight gradient, while the rows move */
    if (finish >= 0) moe_wgrad_job_finish(m, finish); /* its deadline, while the rows move */
    moe_wgrad_jobs_fill(m, &req);
    comm_p2p_wait(m->ep_comm, &req);
    if (p_hi > p_lo) { /* the other ranks' pairs: [0, p_lo) and [p_hi, P) */
        if (p_lo > 0)
            be->moe_combine_backward(m->d_y_exp, m->d_w_recv, d_pairs, a->y_exp, r->exp_slot, r->meta_w, (int)p_lo,
                                     K, H);
        if (p_hi < P)
            be->moe_combine_backward(m->d_y_exp, m->d_w_recv + p_hi * K, ROW(m, d_pairs, p_hi), a->y_exp,
                                     r->exp_slot + p_hi * K, r->meta_w + p_hi * K, (int)(P - p_hi), K, H);
    } else {
        be->moe_combine_backward(m->d_y_exp, m->d_w_recv, d_pairs, a->y_exp, r->exp_slot, r->meta_w, (int)P, K, H);
    }
    int64_t in[m->ep], out[m->ep];
    scale_counts(m, in, out, r->send_counts, r->recv_counts, K);
    return comm_all_to_all_inbox_start(m->ep_comm, in, m->d_w_recv, out, COMM_F32, w_req);
}

/* m->d_topk_w from moe_combine_rows_backward's exchange (nothing to do without pairs) */
void moe_combine_weights_home(struct model *m, struct layer_acts *a, const float *d_w, struct comm_p2p_req *w_req)
{
    if (!m->pairs) return;
    comm_p2p_wait(m->ep_comm, w_req);
    m->be->gather_f32(m->d_topk_w, d_w, a->route.w_map, m->T * m->K);
}

/* Backward of moe_dispatch_rows: m->d_x_exp (expert-major) -> m->d_t1 = dL/d(norm output) through the
 * experts (overwritten; the router term is added after). Each token's (or pair's) rows are summed
 * in ascending row order: the gather's backward as a unit-weight combine, no scatter. In two
 * halves: the pair rows leave (with ep > 1), then the token side sums them; work queued between
 * the two runs while the rows move (the experts' weight gradients, experts_backward). */
const void *moe_dispatch_rows_backward_send(struct model *m, struct layer_acts *a, struct comm_p2p_req *req)
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
    int64_t in[m->ep], out[m->ep];
    scale_counts(m, in, out, r->send_counts, r->recv_counts, H);
    const enum comm_dtype t = comm_dtype_of_x(be->x_size);
    if (!m->combine_self_last) {
        be->moe_combine_forward(m->d_y_exp, m->d_x_exp, r->exp_slot, m->ones, NULL, (int)r->P_recv, K, H);
        return comm_all_to_all_inbox_start(m->ep_comm, in, m->d_y_exp, out, t, req);
    }
    /* self last, as the forward combine: the other ranks' pair sums first and on their way, this
     * rank's own summed while they cross, straight into the inbox's block to self (no copy within
     * the GPU, which would hold the compute stream's next kernels back). The same sums. */
    int64_t p_lo, p_hi;
    own_pairs(m, r, &p_lo, &p_hi);
    const int64_t P = r->P_recv;
    if (p_lo > 0) be->moe_combine_forward(m->d_y_exp, m->d_x_exp, r->exp_slot, m->ones, NULL, (int)p_lo, K, H);
    if (p_hi < P)
        be->moe_combine_forward(ROW(m, m->d_y_exp, p_hi), m->d_x_exp, r->exp_slot + p_hi * K, m->ones + p_hi * K,
                                NULL, (int)(P - p_hi), K, H);
    void *pairs = comm_all_to_all_inbox_start_self_later(m->ep_comm, in, m->d_y_exp, out, t, req);
    int64_t home = 0; /* where the block to self sits in the inbox: after the earlier ranks' */
    for (int s = 0; s < m->ep_rank; s++) home += r->send_counts[s];
    be->moe_combine_forward(ROW(m, pairs, home), m->d_x_exp, r->exp_slot + p_lo * K, m->ones + p_lo * K, NULL,
                            (int)(p_hi - p_lo), K, H);
    return pairs;
}

void moe_dispatch_rows_backward_sum(struct model *m, struct layer_acts *a, const void *d_pairs,
                                       struct comm_p2p_req *req)
{
    if (!m->pairs) return;
    comm_p2p_wait(m->ep_comm, req);
    m->be->moe_combine_forward(m->d_t1, d_pairs, a->route.tok_pair, m->ones, NULL, m->T, m->K, m->H);
}
