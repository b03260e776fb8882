/* The chunked, overlapped MoE exchange (moe_exchange.h). Layout of one layer with n chunks, each
 * chunk's entries packed after the previous chunk's:
 *   token side (sender): pair_tok, meta_*_send, d_x_send rows at the chunk's pair0; tok_pair,
 *     w_map at t0·k (their values count from the chunk's first pair, as a one-chunk plan of T
 *     tokens would);
 *   expert side (receiver): meta_idx/meta_w/exp_slot at recv0·k and the received pair rows at recv0;
 *     exp_src and x_exp/gu/act/y_exp at row0 (values from the chunk's first pair / row).
 * Without pairs (ep = 1, no loopback) the "received pairs" are the chunk's tokens and nothing
 * crosses. Every buffer a transfer in flight reads or writes belongs to its chunk alone, so the
 * compute of the other chunks never touches it. */
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "common.h"
#include "mem_track.h"
#include "model.h"
#include "moe_buffers.h"
#include "moe_exchange.h"
#include "moe_timeline.h"


/* counts are host data: exchange them over MPI whatever backend moves the rows. Each rank's pair
 * count travels with the expert rows those pairs make (moe_pair_plan rows_host), so the receiver
 * knows its row count (returned) without reading its route plan back. */
int64_t moe_exchange_counts(struct model *m, int64_t *recv_counts, const int64_t *send_counts,
                            const int64_t *send_rows)
{
    if (!m->ep_comm) {
        recv_counts[0] = send_counts[0];
        return send_rows[0];
    }
    const int ep = m->ep;
    int64_t out[2 * ep], in[2 * ep], rows = 0;
    memset(out, 0, sizeof out); /* the loop fills it; cleared so that the compiler sees it set */
    for (int s = 0; s < ep; s++) out[2 * s] = send_counts[s], out[2 * s + 1] = send_rows[s];
    MT_CHECK_MPI(MPI_Alltoall(out, 2, MPI_INT64_T, in, 2, MPI_INT64_T, m->ep_comm->mpi));
    for (int s = 0; s < ep; s++) recv_counts[s] = in[2 * s], rows += in[2 * s + 1];
    return rows;
}

/* p grown to hold `need` elements, sized by moe_capacity against `mean` (the same unit) */
static void *grow(struct model *m, void *p, int64_t *cap, int64_t need, int64_t mean, size_t elem)
{
    if (need <= *cap) return p;
    if (p) m->be->free(p);
    *cap = moe_capacity(need, mean);
    enum mem_cat was = mem_track_set(MEM_BUFFERS);
    p = m->be->alloc((size_t)*cap * elem);
    mem_track_set(was);
    return p;
}

/* the pairs a rank sends or receives on average: each token's to each rank its top-k reach */
static int64_t mean_pairs(const struct model *m) { return (int64_t)m->T * MT_MIN(m->K, m->ep); }

/* The window the pair rows land in, for P pairs (one per model: a layer's transfers have all
 * finished when it returns) */
static void *recv_rows(struct model *m, int64_t P)
{
    m->x_recv = grow(m, m->x_recv, &m->x_recv_cap, P * m->H, mean_pairs(m) * m->H, m->be->x_size);
    return m->x_recv;
}

/* backward: the routing-weight gradients coming home, n floats */
static float *recv_w(struct model *m, int64_t n)
{
    m->d_w_home = grow(m, m->d_w_home, &m->d_w_home_cap, n, mean_pairs(m) * m->K, sizeof(float));
    return m->d_w_home;
}

/* The layer's chunk plans (host), allocated once per layer for n chunks. */
static struct moe_chunk *chunks_of(struct model *m, struct layer_acts *a)
{
    struct moe_route *r = &a->route;
    const int n = m->moe_chunks, ep = m->ep, nl = m->n_local_experts;
    MT_CHECK(n >= 1 && n <= m->T, "moe_chunks %d with %d tokens per micro-batch", n, m->T);
    if (!r->chunks) {
        const size_t per = 2 * (size_t)ep;
        char *block = mt_calloc(1, n * sizeof(struct moe_chunk) + n * per * sizeof(int64_t));
        r->chunks = (struct moe_chunk *)block;
        int64_t *ints = (int64_t *)(block + n * sizeof(struct moe_chunk));
        r->chunk_off = m->be->alloc((size_t)n * (nl + 1) * sizeof(int64_t));
        for (int c = 0; c < n; c++) {
            struct moe_chunk *ch = &r->chunks[c];
            ch->send_counts = ints + c * per;
            ch->recv_counts = ch->send_counts + ep;
            ch->expert_off = r->chunk_off + (size_t)c * (nl + 1);
            ch->t0 = (int)((int64_t)m->T * c / n);
            ch->T = (int)((int64_t)m->T * (c + 1) / n) - ch->t0;
        }
    }
    return r->chunks;
}

static void scaled(const struct model *m, int64_t *dst, const int64_t *counts, int64_t width)
{
    for (int s = 0; s < m->ep; s++) dst[s] = counts[s] * width;
}

/* Starts one direction of chunk ch's row exchange: `send` holds rows in `out_counts` blocks, `recv`
 * gets `in_counts` blocks (the counts in pairs, rows of `width` elements). */
static void start(struct model *m, void *recv, const int64_t *in_counts, const void *send,
                  const int64_t *out_counts, int64_t width, enum comm_dtype t, struct comm_p2p_req *req)
{
    int64_t in[m->ep], out[m->ep];
    scaled(m, in, in_counts, width);
    scaled(m, out, out_counts, width);
    comm_all_to_all_v_start(m->ep_comm, recv, in, send, out, t, req);
}

static void exchange(struct model *m, void *recv, const int64_t *in_counts, const void *send,
                     const int64_t *out_counts, int64_t width, enum comm_dtype t)
{
    struct comm_p2p_req req;
    start(m, recv, in_counts, send, out_counts, width, t, &req);
    comm_p2p_wait(m->ep_comm, &req);
}

#define ROW(m, p, i, width) MT_XP(m, p, (int64_t)(i) * (width))

/* Every chunk's route plan; the expert-side buffers grown for all of them. The counts of each
 * chunk cross on the host (a blocking exchange per chunk: the host needs them to size the rows). */
static void plan(struct model *m, struct layer_acts *a)
{
    const struct backend *be = m->be;
    struct moe_route *r = &a->route;
    const int K = m->K, E = m->E, nl = m->n_local_experts, ep = m->ep, n = m->moe_chunks;
    struct moe_chunk *ch = chunks_of(m, a);
    int64_t pair0 = 0, recv0 = 0, row0 = 0;
    for (int c = 0; c < n; c++) {
        struct moe_chunk *x = &ch[c];
        const int64_t tk = (int64_t)x->t0 * K;
        x->pair0 = pair0;
        x->recv0 = recv0;
        if (!m->pairs) {
            x->P_send = x->P_recv = x->send_counts[0] = x->recv_counts[0] = x->T;
        } else {
            int64_t send_rows[ep];
            be->moe_pair_plan(a->topk_idx + tk, a->topk_w + tk, r->pair_tok + pair0, r->tok_pair + tk,
                              m->meta_idx_send + pair0 * K, m->meta_w_send + pair0 * K, r->w_map + tk,
                              x->send_counts, send_rows, x->T, ep, nl, K, 0);
            x->R = moe_exchange_counts(m, x->recv_counts, x->send_counts, send_rows);
            x->P_send = x->P_recv = 0;
            for (int s = 0; s < ep; s++) {
                x->P_send += x->send_counts[s];
                x->P_recv += x->recv_counts[s];
            }
        }
        pair0 += x->P_send;
        recv0 += x->P_recv;
    }
    r->P_send = pair0;
    r->P_recv = recv0;
    if (m->pairs) moe_ensure_pairs(m, a, recv0);
    else r->meta_idx = a->topk_idx, r->meta_w = a->topk_w;
    for (int c = 0; c < n; c++) {
        struct moe_chunk *x = &ch[c];
        const int64_t rk = x->recv0 * K;
        if (m->pairs) {
            exchange(m, r->meta_idx + rk, x->recv_counts, m->meta_idx_send + x->pair0 * K,
                     x->send_counts, K, COMM_I32);
            exchange(m, r->meta_w + rk, x->recv_counts, m->meta_w_send + x->pair0 * K, x->send_counts,
                     K, COMM_F32);
        }
        be->moe_route_plan(r->meta_idx + rk, r->meta_w + rk, r->exp_src + row0, r->exp_slot + rk,
                           x->expert_off, (int)x->P_recv, m->pairs ? nl : E, K);
        x->row0 = row0;
        /* the next chunk's rows start after this one's (with pairs, R came with the counts) */
        if (!m->pairs) x->R = x->P_recv * K;
        row0 += x->R;
    }
    r->R_exp = row0;
    moe_ensure_rows(m, a, row0);
}

/* chunk x's expert SwiGLU on its rows */
static void experts_forward(struct model *m, struct layer_acts *a, int l, const struct moe_chunk *x)
{
    const struct backend *be = m->be;
    const int H = m->H, I = m->I, nl = m->n_local_experts;
    moe_timeline_mark("gemms", x - a->route.chunks, 0);
    be->expert_matmul_forward(ROW(m, a->gu, x->row0, 2 * I), ROW(m, a->x_exp, x->row0, H),
                              weight_of(m, TR_EXP_GATE_UP, l), x->expert_off, NULL, x->R, nl, H, 2 * I);
    be->swiglu_forward(ROW(m, a->act, x->row0, I), ROW(m, a->gu, x->row0, 2 * I), (int)x->R, I, NULL);
    be->expert_matmul_forward(ROW(m, a->y_exp, x->row0, H), ROW(m, a->act, x->row0, I),
                              weight_of(m, TR_EXP_DOWN, l), x->expert_off, NULL, x->R, nl, I, H);
    moe_timeline_mark("gemms", x - a->route.chunks, 1);
}

static void experts_backward(struct model *m, struct layer_acts *a, int l, const struct moe_chunk *x)
{
    const struct backend *be = m->be;
    const int H = m->H, I = m->I, nl = m->n_local_experts;
    moe_timeline_mark("gemms_bwd", x - a->route.chunks, 0);
    const bool fresh = m->exp_dw_fresh[l]; /* the first chunk overwrites, the others add */
    m->exp_dw_fresh[l] = false;
    be->expert_matmul_backward(ROW(m, m->d_act, x->row0, I), grad_of(m, TR_EXP_DOWN, l),
                               ROW(m, m->d_y_exp, x->row0, H), ROW(m, a->act, x->row0, I),
                               weight_of(m, TR_EXP_DOWN, l), x->expert_off, x->R, nl, I, H, fresh);
    be->swiglu_backward(ROW(m, m->d_gu, x->row0, 2 * I), ROW(m, m->d_act, x->row0, I),
                        ROW(m, a->gu, x->row0, 2 * I), (int)x->R, I, NULL);
    be->expert_matmul_backward(ROW(m, m->d_x_exp, x->row0, H), grad_of(m, TR_EXP_GATE_UP, l),
                               ROW(m, m->d_gu, x->row0, 2 * I), ROW(m, a->x_exp, x->row0, H),
                               weight_of(m, TR_EXP_GATE_UP, l), x->expert_off, x->R, nl, H, 2 * I, fresh);
    moe_timeline_mark("gemms_bwd", x - a->route.chunks, 1);
}

/* token side -> pair rows of chunk x in d_x_send (from `src` [T, H]), then their exchange started */
static void send_pairs(struct model *m, struct layer_acts *a, const struct moe_chunk *x, const void *src,
                       void *recv, struct comm_p2p_req *req, const char *what)
{
    const int H = m->H;
    m->be->gather_rows(ROW(m, m->d_x_send, x->pair0, H), ROW(m, src, x->t0, H),
                       a->route.pair_tok + x->pair0, (int)x->P_send, H);
    moe_timeline_comm(what, x - a->route.chunks);
    start(m, ROW(m, recv, x->recv0, H), x->recv_counts, ROW(m, m->d_x_send, x->pair0, H),
          x->send_counts, H, comm_dtype_of_x(m->be->x_size), req);
}

/* expert side -> chunk x's pair sums (`sums`, [P_recv, H]) home into its rows of d_x_send */
static void return_pairs(struct model *m, struct layer_acts *a, const struct moe_chunk *x,
                         const void *sums, struct comm_p2p_req *req, const char *what)
{
    moe_timeline_comm(what, x - a->route.chunks);
    start(m, ROW(m, m->d_x_send, x->pair0, m->H), x->send_counts, sums, x->recv_counts, m->H,
          comm_dtype_of_x(m->be->x_size), req);
}

/* after a wait: the end of a transfer's span on a host clock */
static void waited(struct model *m, struct comm_p2p_req *req, const char *what, int64_t c)
{
    comm_p2p_wait(m->ep_comm, req);
    moe_timeline_comm_done(what, c);
}

void moe_exchange_forward(struct model *m, struct layer_acts *a, int l, void *out, const void *resid)
{
    const struct backend *be = m->be;
    const int H = m->H, K = m->K, n = m->moe_chunks;
    struct moe_route *r = &a->route;
    plan(m, a);
    moe_timeline_begin(m, l, "forward");
    const struct moe_chunk *ch = r->chunks;
    struct comm_p2p_req there[n], back[n];
    /* the dispatched rows (pairs) or, without pairs, the norm output itself */
    void *rows = m->pairs ? recv_rows(m, r->P_recv) : a->m;
    if (m->pairs) send_pairs(m, a, &ch[0], a->m, rows, &there[0], "dispatch");
    for (int c = 0; c < n; c++) {
        const struct moe_chunk *x = &ch[c];
        if (m->pairs && c + 1 < n) send_pairs(m, a, &ch[c + 1], a->m, rows, &there[c + 1], "dispatch");
        if (m->pairs) waited(m, &there[c], "dispatch", c);
        be->gather_rows(ROW(m, a->x_exp, x->row0, H), ROW(m, rows, x->recv0, H), r->exp_src + x->row0,
                        (int)x->R, H);
        experts_forward(m, a, l, x);
        const int64_t rk = x->recv0 * K;
        if (!m->pairs) {
            be->moe_combine_forward(ROW(m, out, x->t0, H), ROW(m, a->y_exp, x->row0, H),
                                    r->exp_slot + rk, r->meta_w + rk,
                                    resid ? ROW(m, resid, x->t0, H) : NULL, x->T, K, H);
            continue;
        }
        /* d_x_exp is free during the forward: it holds each pair's weighted sum on its way home */
        be->moe_combine_forward(ROW(m, m->d_x_exp, x->recv0, H), ROW(m, a->y_exp, x->row0, H),
                                r->exp_slot + rk, r->meta_w + rk, NULL, (int)x->P_recv, K, H);
        return_pairs(m, a, x, ROW(m, m->d_x_exp, x->recv0, H), &back[c], "combine");
    }
    for (int c = 0; m->pairs && c < n; c++) {
        const struct moe_chunk *x = &ch[c];
        waited(m, &back[c], "combine", c);
        be->moe_combine_forward(ROW(m, out, x->t0, H), ROW(m, m->d_x_send, x->pair0, H),
                                r->tok_pair + (int64_t)x->t0 * K, m->ones,
                                resid ? ROW(m, resid, x->t0, H) : NULL, x->T, K, H);
    }
    moe_timeline_end(m);
}

/* From m->d_h (dL/d out) to m->d_t1 (dL/d norm output through the experts) and m->d_topk_w, as
 * combine_rows_backward, the expert backward and dispatch_rows_backward_send/_sum in moe.c, chunk
 * by chunk. */
void moe_exchange_backward(struct model *m, struct layer_acts *a, int l)
{
    const struct backend *be = m->be;
    const int H = m->H, K = m->K, n = m->moe_chunks;
    struct moe_route *r = &a->route;
    const struct moe_chunk *ch = r->chunks;
    MT_CHECK(ch && r->R_exp >= 0, "moe_exchange_backward: layer %d has no chunk plan", l);
    moe_timeline_begin(m, l, "backward");
    struct comm_p2p_req there[n], w_back[n], back[n];
    void *d_pairs = m->pairs ? recv_rows(m, r->P_recv) : m->d_h;
    float *d_w = m->pairs ? recv_w(m, r->P_send * K) : NULL;
    if (m->pairs) send_pairs(m, a, &ch[0], m->d_h, d_pairs, &there[0], "dispatch_bwd");
    /* the layer above's deferred weight gradients (model_enable_deferred_wgrads) under the first
     * chunk's rows on their way out, and under the last ones' on their way home */
    if (m->pairs) model_run_deferred_wgrads(m, 1);
    for (int c = 0; c < n; c++) {
        const struct moe_chunk *x = &ch[c];
        const int64_t rk = x->recv0 * K;
        if (m->pairs && c + 1 < n) send_pairs(m, a, &ch[c + 1], m->d_h, d_pairs, &there[c + 1], "dispatch_bwd");
        if (m->pairs) waited(m, &there[c], "dispatch_bwd", c);
        float *d_w_pairs = m->pairs ? m->d_w_recv + rk : m->d_topk_w + rk;
        be->moe_combine_backward(ROW(m, m->d_y_exp, x->row0, H), d_w_pairs, ROW(m, d_pairs, x->recv0, H),
                                 ROW(m, a->y_exp, x->row0, H), r->exp_slot + rk, r->meta_w + rk,
                                 (int)x->P_recv, K, H);
        if (m->pairs) {
            moe_timeline_comm("weights_bwd", c);
            start(m, d_w + x->pair0 * K, x->send_counts, d_w_pairs, x->recv_counts, K, COMM_F32, &w_back[c]);
        }
        experts_backward(m, a, l, x);
        if (!m->pairs) {
            be->moe_combine_forward(ROW(m, m->d_t1, x->t0, H), ROW(m, m->d_x_exp, x->row0, H),
                                    r->exp_slot + rk, m->ones, NULL, x->T, K, H);
            continue;
        }
        /* chunk x's rows of d_y_exp are free once its expert backward has run; its pairs (at
         * most its rows) sum there on their way home */
        void *sums = ROW(m, m->d_y_exp, x->row0, H);
        be->moe_combine_forward(sums, ROW(m, m->d_x_exp, x->row0, H), r->exp_slot + rk, m->ones,
                                NULL, (int)x->P_recv, K, H);
        return_pairs(m, a, x, sums, &back[c], "combine_bwd");
    }
    if (m->pairs) model_run_deferred_wgrads(m, -1);
    for (int c = 0; m->pairs && c < n; c++) {
        const struct moe_chunk *x = &ch[c];
        const int64_t tk = (int64_t)x->t0 * K;
        waited(m, &w_back[c], "weights_bwd", c);
        be->gather_f32(m->d_topk_w + tk, d_w + x->pair0 * K, r->w_map + tk, x->T * K);
        waited(m, &back[c], "combine_bwd", c);
        be->moe_combine_forward(ROW(m, m->d_t1, x->t0, H), ROW(m, m->d_x_send, x->pair0, H),
                                r->tok_pair + tk, m->ones, NULL, x->T, K, H);
    }
    moe_timeline_end(m);
}
