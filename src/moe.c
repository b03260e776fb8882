/* The MLP half of a decoder layer. MoE layers: router, top-k, dispatch of token rows to the EP
 * ranks that hold their experts (all-to-all), grouped expert SwiGLU, the reverse all-to-all and the
 * weighted combine. Dense layers (mlp_only_layers / decoder_sparse_step): one SwiGLU MLP.
 *
 * Row orders. Dispatch rows are sorted by (global expert, token), so the block for EP rank r is
 * contiguous. A receiving rank gets rank-major blocks, each sorted by local expert; `regroup`
 * gathers them into expert-major order (expert, source rank, token) for the grouped GEMM. Each
 * token's k choices are re-sorted by ascending expert id before anything uses them, so the combine
 * adds expert outputs in the same order on every mesh (and in transformers' eager order). */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "model.h"

static void *W(const struct model *m, enum tensor_role r, int l) { return model_weight(m, tensor_lookup(&m->tt, r, l)); }
static float *G(const struct model *m, enum tensor_role r, int l) { return model_grad(m, tensor_lookup(&m->tt, r, l)); }


static void regrow(const struct model *m, void **p, int64_t elems, size_t elem_size)
{
    if (*p) m->be->free(*p);
    *p = m->be->alloc((size_t)MT_MAX(elems, 1) * elem_size);
}

/* Make layer buffers hold R expert-side rows (and the shared backward scratch too). With ep = 1
 * the expert side is the dispatch side: the buffers alias. */
static void ensure_rows(struct model *m, struct layer_acts *a, int64_t R)
{
    const int64_t H = m->H, I = m->I;
    const size_t xs = m->be->x_size;
    if (m->ep == 1) {
        a->x_exp = a->x_send;
        a->y_exp = a->y_send;
        m->d_x_exp = m->d_x_send;
        m->d_y_exp = m->d_y_send;
    }
    if (R > a->cap_rows) {
        int64_t cap = m->ep == 1 ? R : R + R / 4 + 16;
        if (m->ep > 1) {
            regrow(m, &a->x_exp, cap * H, xs);
            regrow(m, &a->y_exp, cap * H, xs);
            regrow(m, (void **)&a->route.regroup, 2 * cap, sizeof(int32_t));
            a->route.regroup_h = mt_realloc(a->route.regroup_h, (size_t)2 * cap * sizeof(int32_t));
        }
        /* a shared (recompute) set also serves dense layers: [T, 2 Id] and [T, Id] */
        regrow(m, &a->gu, MT_MAX(cap * 2 * I, (int64_t)m->T * 2 * m->Id), xs);
        regrow(m, &a->act, MT_MAX(cap * I, (int64_t)m->T * m->Id), xs);
        a->cap_rows = cap;
    }
    if (R > m->d_cap_rows) {
        int64_t cap = m->ep == 1 ? R : R + R / 4 + 16;
        if (m->ep > 1) {
            regrow(m, &m->d_x_exp, cap * H, xs);
            regrow(m, &m->d_y_exp, cap * H, xs);
        }
        regrow(m, &m->d_gu, MT_MAX(cap * 2 * I, (int64_t)m->T * 2 * m->Id), xs);
        regrow(m, &m->d_act, MT_MAX(cap * I, (int64_t)m->T * m->Id), xs);
        m->d_cap_rows = cap;
    }
}

/* Builds the dispatch plan of layer l from the router's top-k (see the file comment): the backend
 * sorts the choices and orders the rows; the host gets the per-expert counts. */
static void route_plan(struct model *m, struct layer_acts *a)
{
    const struct backend *be = m->be;
    struct moe_route *r = &a->route;
    const int T = m->T, K = m->K, E = m->E, nl = m->n_local_experts, ep = m->ep;
    int64_t *cnt = mt_malloc((size_t)E * sizeof(int64_t));
    be->moe_route_plan(a->topk_idx, a->topk_w, r->src_row, r->slot_row, cnt, T, E, K);
    for (int d = 0; d < ep; d++) {
        r->send_counts[d] = 0;
        for (int e = d * nl; e < (d + 1) * nl; e++) r->send_counts[d] += cnt[e];
    }
    r->R_send = (int64_t)T * K;

    /* counts are host data: exchange them over MPI whatever backend moves the rows */
    if (ep > 1)
        MT_CHECK_MPI(MPI_Alltoall(cnt, nl, MPI_INT64_T, r->recv_expert_counts, nl, MPI_INT64_T,
                                  m->ep_comm->mpi));
    else
        memcpy(r->recv_expert_counts, cnt, (size_t)nl * sizeof(int64_t));
    free(cnt);

    int64_t total = 0;
    for (int s = 0; s < ep; s++) {
        r->recv_counts[s] = 0;
        for (int e = 0; e < nl; e++) r->recv_counts[s] += r->recv_expert_counts[(size_t)s * nl + e];
        total += r->recv_counts[s];
    }
    r->R_recv = total;
    r->expert_off[0] = 0;
    for (int e = 0; e < nl; e++) {
        int64_t c = 0;
        for (int s = 0; s < ep; s++) c += r->recv_expert_counts[(size_t)s * nl + e];
        r->expert_off[e + 1] = r->expert_off[e] + c;
    }
    ensure_rows(m, a, total);
    if (ep == 1) return;

    /* regroup[expert-major row] = row in the received, rank-major buffer */
    int64_t pos = 0, base = 0;
    int64_t *start = mt_malloc((size_t)ep * nl * sizeof(int64_t));
    for (int s = 0; s < ep; s++) {
        int64_t o = base;
        for (int e = 0; e < nl; e++) {
            start[(size_t)s * nl + e] = o;
            o += r->recv_expert_counts[(size_t)s * nl + e];
        }
        base += r->recv_counts[s];
    }
    for (int e = 0; e < nl; e++)
        for (int s = 0; s < ep; s++)
            for (int64_t i = 0; i < r->recv_expert_counts[(size_t)s * nl + e]; i++)
                r->regroup_h[pos++] = (int32_t)(start[(size_t)s * nl + e] + i);
    free(start);
    for (int64_t i = 0; i < total; i++) r->regroup_h[total + r->regroup_h[i]] = (int32_t)i;
    r->regroup_inv = r->regroup + total;
    if (total > 0) be->upload(r->regroup, r->regroup_h, (size_t)2 * total * sizeof(int32_t));
}

/* Moves rows between EP ranks: `send` has counts_out[s] rows for rank s, `recv` gets counts_in[s]
 * rows from rank s. */
static void exchange_rows(struct model *m, void *recv, const int64_t *counts_in, const void *send,
                          const int64_t *counts_out)
{
    int64_t in[m->ep], out[m->ep];
    for (int s = 0; s < m->ep; s++) {
        in[s] = counts_in[s] * m->H;
        out[s] = counts_out[s] * m->H;
    }
    comm_all_to_all_v(m->ep_comm, recv, in, send, out, comm_dtype_of_x(m->be->x_size));
}

static void dense_mlp_forward(struct model *m, struct layer_acts *a, int l, void *out)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, Id = m->Id;
    be->matmul_forward(a->gu, a->m, W(m, TR_MLP_GATE_UP, l), T, H, 2 * Id);
    be->swiglu_forward(a->act, a->gu, T, Id);
    be->matmul_forward(out, a->act, W(m, TR_MLP_DOWN, l), T, Id, H);
}

static void dense_mlp_backward(struct model *m, struct layer_acts *a, int l)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, Id = m->Id;
    be->matmul_backward(m->d_act, G(m, TR_MLP_DOWN, l), m->d_h, a->act, W(m, TR_MLP_DOWN, l), T, Id,
                        H, false);
    be->swiglu_backward(m->d_gu, m->d_act, a->gu, T, Id);
    be->matmul_backward(m->d_t1, G(m, TR_MLP_GATE_UP, l), m->d_gu, a->m, W(m, TR_MLP_GATE_UP, l), T,
                        H, 2 * Id, false);
}

/* Token side -> expert side: the layer's norm output rows in dispatch order (x_send), then with
 * ep > 1 the all-to-all and the regroup into expert-major x_exp. */
static void dispatch_rows(struct model *m, struct layer_acts *a)
{
    const struct backend *be = m->be;
    const int H = m->H;
    struct moe_route *r = &a->route;
    be->gather_rows(a->x_send, a->m, r->src_row, (int)r->R_send, H);
    if (m->ep > 1) {
        /* y_exp is free until the experts run: it holds the received rows until the regroup */
        exchange_rows(m, a->y_exp, r->recv_counts, a->x_send, r->send_counts);
        be->gather_rows(a->x_exp, a->y_exp, r->regroup, (int)r->R_recv, H);
    }
}

/* Expert side -> token side: expert outputs y_exp back to their tokens' ranks (y_send, dispatch
 * order), then the weighted combine into out. */
static void combine_rows(struct model *m, struct layer_acts *a, void *out)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, K = m->K;
    struct moe_route *r = &a->route;
    if (m->ep > 1) {
        /* the backward scratch d_x_exp is free during the forward; back to rank-major order */
        be->gather_rows(m->d_x_exp, a->y_exp, r->regroup_inv, (int)r->R_recv, H);
        exchange_rows(m, a->y_send, r->send_counts, m->d_x_exp, r->recv_counts);
    }
    be->moe_combine_forward(out, a->y_send, r->slot_row, a->topk_w, T, K, H);
}

/* Backward of combine_rows: m->d_h (dL/d out) -> m->d_topk_w and m->d_y_exp (expert-major). */
static void combine_rows_backward(struct model *m, struct layer_acts *a)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, K = m->K;
    struct moe_route *r = &a->route;
    be->moe_combine_backward(m->d_y_send, m->d_topk_w, m->d_h, a->y_send, r->slot_row, a->topk_w, T,
                             K, H);
    if (m->ep > 1) {
        exchange_rows(m, m->d_x_exp, r->recv_counts, m->d_y_send, r->send_counts);
        be->gather_rows(m->d_y_exp, m->d_x_exp, r->regroup, (int)r->R_recv, H);
    }
}

/* Backward of dispatch_rows: m->d_x_exp (expert-major) -> m->d_t1 = dL/d(norm output) through the
 * experts (overwritten; the router term is added after). */
static void dispatch_rows_backward(struct model *m, struct layer_acts *a)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H;
    struct moe_route *r = &a->route;
    if (m->ep > 1) {
        be->gather_rows(m->d_y_exp, m->d_x_exp, r->regroup_inv, (int)r->R_recv, H);
        exchange_rows(m, m->d_x_send, r->send_counts, m->d_y_exp, r->recv_counts);
    }
    /* each token's k rows summed in ascending row order: the gather's backward as a combine with
     * unit weights (no scatter, no sort; the same fp32 sum in the same order) */
    be->moe_combine_forward(m->d_t1, m->d_x_send, r->slot_row, m->ones_tk, T, m->K, H);
}

static void moe_forward(struct model *m, struct layer_acts *a, int l, void *out)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, E = m->E, K = m->K, I = m->I, nl = m->n_local_experts;
    struct moe_route *r = &a->route;
    be->matmul_forward(a->logits, a->m, W(m, TR_ROUTER, l), T, H, E);
    be->router_forward(a->topk_idx, a->topk_w, a->probs, a->logits,
                       m->bias ? m->bias + (size_t)l * E : NULL, T, E, K, m->cfg.norm_topk_prob);
    float *st = m->stats + (size_t)l * 2 * E;
    if (!m->recomputing) be->router_stats(st, st + E, a->probs, a->topk_idx, T, E, K);
    route_plan(m, a);

    dispatch_rows(m, a);
    be->expert_matmul_forward(a->gu, a->x_exp, W(m, TR_EXP_GATE_UP, l), r->expert_off, nl, H, 2 * I);
    be->swiglu_forward(a->act, a->gu, (int)r->R_recv, I);
    be->expert_matmul_forward(a->y_exp, a->act, W(m, TR_EXP_DOWN, l), r->expert_off, nl, I, H);
    combine_rows(m, a, out);
}

static void moe_backward(struct model *m, struct layer_acts *a, int l)
{
    const struct backend *be = m->be;
    const int T = m->T, H = m->H, E = m->E, K = m->K, I = m->I, nl = m->n_local_experts;
    struct moe_route *r = &a->route;
    combine_rows_backward(m, a);
    be->expert_matmul_backward(m->d_act, G(m, TR_EXP_DOWN, l), m->d_y_exp, a->act,
                               W(m, TR_EXP_DOWN, l), r->expert_off, nl, I, H);
    be->swiglu_backward(m->d_gu, m->d_act, a->gu, (int)r->R_recv, I);
    be->expert_matmul_backward(m->d_x_exp, G(m, TR_EXP_GATE_UP, l), m->d_gu, a->x_exp,
                               W(m, TR_EXP_GATE_UP, l), r->expert_off, nl, H, 2 * I);
    dispatch_rows_backward(m, a);
    be->router_backward(m->d_logits_r, m->d_topk_w, a->probs, a->topk_idx,
                        m->aux_active ? m->aux_dp : NULL, T, E, K, m->cfg.norm_topk_prob);
    int ri = tensor_lookup(&m->tt, TR_ROUTER, l);
    float *dwg = m->tt.t[ri].frozen ? NULL : model_grad(m, ri);
    be->matmul_backward(m->d_t1, dwg, m->d_logits_r, a->m, model_weight(m, ri), T, H, E, true);
}

void mlp_forward(struct model *m, int l, void *out)
{
    struct layer_acts *a = model_acts(m, l);
    m->be->rmsnorm_forward(a->m, a->rstd_m, a->h_mid, W(m, TR_MLP_NORM, l), m->T, m->H,
                           (float)m->cfg.rms_norm_eps);
    if (config_layer_is_moe(&m->cfg, l)) moe_forward(m, a, l, out);
    else dense_mlp_forward(m, a, l, out);
    m->be->add_inplace(out, a->h_mid, (size_t)m->T * m->H);
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
    route_plan(m, a);
    dispatch_rows(m, a);
    return a->route.R_recv;
}

void moe_combine_for_test(struct model *m, int l, const void *y_exp, void *out)
{
    struct layer_acts *a = test_layer(m, l);
    copy_in(m, a->y_exp, y_exp, a->route.R_recv);
    combine_rows(m, a, out);
}

void moe_combine_backward_for_test(struct model *m, int l, const void *dout)
{
    struct layer_acts *a = test_layer(m, l);
    copy_in(m, m->d_h, dout, m->T);
    combine_rows_backward(m, a);
}

void moe_dispatch_backward_for_test(struct model *m, int l, const void *d_x_exp, void *dx)
{
    struct layer_acts *a = test_layer(m, l);
    copy_in(m, m->d_x_exp, d_x_exp, a->route.R_recv);
    dispatch_rows_backward(m, a);
    copy_in(m, dx, m->d_t1, m->T);
}
