/* The MoE layer's expert-side and pair buffers, grown as the rows a rank receives change, and the
 * stash of parallel.expert_wgrad_pairs / expert_wgrad_group (model.h struct expert_wgrad_stash):
 * a micro-step's expert rows parked, by swapping buffers, until a later backward's grouped weight
 * gradient takes them. moe.c (the one-chunk path) and moe_exchange.c (chunks) use them. */
#include <stdlib.h>

#include "common.h"
#include "layer.h"
#include "mem_track.h"
#include "model.h"
#include "moe_buffers.h"
#include "stash_place.h"

static void regrow(const struct model *m, void **p, int64_t elems, size_t elem_size)
{
    if (*p) m->be->free(*p);
    *p = m->be->alloc((size_t)MT_MAX(elems, 1) * elem_size);
}

int64_t moe_capacity(int64_t need, int64_t mean)
{
    const int64_t base = need > mean ? need : mean;
    return base + base / 4 + 16;
}

/* One set of expert-side buffers ([rows, H] in and out, [rows, 2I] gate|up, [rows, I] SwiGLU)
 * grown to hold R rows: exactly with ep = 1 (R is always T·k) and where R is itself a capacity
 * (the fixed exchange's rows_cap, model.h rows_by_capacity: its headroom is in it already), else
 * moe_capacity of the mean T·k (the rows a rank receives change every step). gu/act also serve
 * dense layers: [T, 2 Id], [T, Id]. */
static void grow_expert_rows(const struct model *m, void **x, void **y, void **gu, void **act,
                             int64_t *cap_rows, int64_t R)
{
    if (R <= *cap_rows) return;
    const bool exact = !m->pairs || m->rows_by_capacity;
    const int64_t H = m->H, I = m->I, cap = exact ? R : moe_capacity(R, (int64_t)m->T * m->K);
    const size_t xs = m->be->x_size;
    regrow(m, x, cap * H, xs);
    regrow(m, y, cap * H, xs);
    regrow(m, gu, MT_MAX(cap * 2 * I, (int64_t)m->T * 2 * m->Id), xs);
    regrow(m, act, MT_MAX(cap * I, (int64_t)m->T * m->Id), xs);
    *cap_rows = cap;
}

/* ---- parallel.expert_wgrad_pairs (model.h struct expert_wgrad_stash) */

static void swap_ptr(void **a, void **b)
{
    void *t = *a;
    *a = *b;
    *b = t;
}

void moe_stash_point_rows(struct layer_acts *a, const struct expert_wgrad_stash *s)
{
    if (!s->direct) return;
    const bool parks = s->pending < s->n_used;
    a->x_exp = parks ? s->slot[s->pending].x_exp : s->own_x;
    a->act = parks ? s->slot[s->pending].act : s->own_act;
}

void moe_stash_expert_rows(struct model *m, struct layer_acts *a, struct expert_wgrad_stash *s)
{
    if (s->direct) { /* the rows are in slot[pending] already (moe_stash_point_rows, moe.c) */
        struct expert_rows_parked *p = &s->slot[s->pending];
        m->be->copy(p->off, a->route.expert_off, (size_t)(m->n_local_experts + 1) * sizeof(int64_t));
        p->rows = a->route.R_exp;
        s->pending++;
        moe_stash_point_rows(a, s);
        return;
    }
    const int64_t H = m->H, I = m->I, T = m->T, Id = m->Id;
    const size_t xs = m->be->x_size;
    struct expert_rows_parked *p = &s->slot[s->pending];
    enum mem_cat was = mem_track_set(MEM_ACTS);
    if (!p->off) p->off = m->be->alloc(((size_t)m->n_local_experts + 1) * sizeof(int64_t));
    if (p->cap_rows < a->cap_rows) {
        regrow(m, &p->x_exp, a->cap_rows * H, xs);
        regrow(m, &p->act, MT_MAX(a->cap_rows * I, T * Id), xs);
    }
    if (p->d_cap_rows < m->d_cap_rows) {
        regrow(m, &p->d_gu, MT_MAX(m->d_cap_rows * 2 * I, T * 2 * Id), xs);
        regrow(m, &p->d_y_exp, m->d_cap_rows * H, xs);
    }
    mem_track_set(was);
    swap_ptr(&p->x_exp, &a->x_exp);
    swap_ptr(&p->act, &a->act);
    swap_ptr(&p->d_gu, &m->d_gu);
    swap_ptr(&p->d_y_exp, &m->d_y_exp);
    p->cap_rows = a->cap_rows;
    p->d_cap_rows = m->d_cap_rows;
    m->be->copy(p->off, a->route.expert_off, (size_t)(m->n_local_experts + 1) * sizeof(int64_t));
    p->rows = a->route.R_exp;
    s->pending++;
}

void model_enable_expert_wgrad_groups(struct model *m, int n_layers, int n_group, int group, int n_big, int big_group)
{
    MT_CHECK(m->moe_chunks == 1, "parallel.expert_wgrad_pairs needs parallel.moe_chunks 1");
    MT_CHECK(group >= 2 && group <= MT_WGRAD_MAX_SETS && (n_big <= 0 || (big_group >= 2 && big_group <= MT_WGRAD_MAX_SETS)),
             "expert wgrad groups of %d / %d micro-steps (2 to %d)", group, big_group, MT_WGRAD_MAX_SETS);
    if (m->wstash) return;
    m->wstash = mt_calloc((size_t)MT_MAX(m->L, 1), sizeof *m->wstash);
    /* the stage's first n_layers MoE layers, of which the first n_group take whole groups; the
     * slots' buffers come at first use */
    for (int l = m->st.layer0, n = 0; l < m->st.layer1 && n < n_layers; l++)
        if (config_layer_is_moe(&m->cfg, l)) {
            m->wstash[l].n_slots = stash_layer_slots(n, n_layers, n_group, group, n_big, big_group);
            n++;
        }
}

bool model_expert_grads_written_last(const struct model *m, int l, int n_micro)
{
    return n_micro >= 2 && m->wstash && m->wstash[l].n_slots > 0 && m->wstash[l].n_slots + 1 >= n_micro;
}

/* the b-th of a slot's four buffers (stash_slot_bytes' order) */
static void **slot_buffer(struct expert_rows_parked *p, int b)
{
    void **bufs[4] = {&p->x_exp, &p->act, &p->d_gu, &p->d_y_exp};
    return bufs[b];
}

/* the rows layer l's parked buffers hold: stash_slot_rows, and with EP the exchange's capacity now
 * (grown past the first by a step that ran again) */
static int64_t slot_rows(const struct model *m, int l)
{
    return m->pairs ? m->rows_cap[l] : (int64_t)m->T * m->K;
}

int64_t model_place_expert_stash(struct model *m, int n_micro, const struct stash_host *hosts, void *const *host_mem,
                                 int n_hosts)
{
    MT_CHECK((!m->pairs || m->fixed_exchange) && !m->recompute && m->st.n_slots == 1 && m->moe_chunks == 1 &&
                 !m->wgrad_jobs,
             "MT_STASH_IN_GRADS needs whole experts a rank (with EP the fixed exchange, no wgrad jobs), no "
             "pipeline, no recompute and moe_chunks 1");
    if (!m->wstash || n_micro < 2) return 0;
    struct stash_buf *bufs = mt_calloc((size_t)MT_MAX(m->L, 1) * MT_WGRAD_MAX_SETS * 4, sizeof *bufs);
    int n = 0;
    for (int l = m->st.layer0; l < m->st.layer1; l++) {
        struct expert_wgrad_stash *s = &m->wstash[l];
        MT_CHECK(!s->direct && s->pending == 0, "layer %d: parked rows placed twice, or placed while parked", l);
        s->n_used = MT_MIN(s->n_slots, n_micro - 1);
        int64_t bytes[4];
        stash_slot_bytes(slot_rows(m, l), m->T, m->H, m->I, m->Id, (int64_t)m->be->x_size, bytes);
        for (int k = 0; k < s->n_used; k++)
            for (int b = 0; b < 4; b++) bufs[n++] = (struct stash_buf){.layer = l, .bytes = bytes[b]};
    }
    const int64_t placed = stash_place(hosts, n_hosts, bufs, n);
    enum mem_cat was = mem_track_set(MEM_ACTS);
    for (int i = 0; i < n;) {
        const int l = bufs[i].layer;
        struct expert_wgrad_stash *s = &m->wstash[l];
        bool any = false;
        for (int j = i; j < i + 4 * s->n_used; j++) any |= bufs[j].host >= 0;
        if (any) {
            /* the layer's own buffers first (their rows stay put within a step), then its slots */
            struct layer_acts *a = &m->slots[0].layers[l];
            const int64_t R = slot_rows(m, l);
            const bool by_cap = m->rows_by_capacity;
            m->rows_by_capacity = m->pairs; /* R is the exchange's capacity: no headroom over it */
            moe_ensure_rows(m, a, R);
            m->rows_by_capacity = by_cap;
            for (int k = 0; k < s->n_used; k++) {
                struct expert_rows_parked *p = &s->slot[k];
                for (int b = 0; b < 4; b++) {
                    const struct stash_buf *q = &bufs[i + 4 * k + b];
                    void **slot = slot_buffer(p, b);
                    if (*slot) m->be->free(*slot); /* a swapped-in buffer of an earlier step */
                    *slot = q->host >= 0 ? (void *)((char *)host_mem[q->host] + q->off) : m->be->alloc((size_t)q->bytes);
                    if (q->host >= 0) p->in_grads |= 1u << b;
                }
                if (!p->off) p->off = m->be->alloc(((size_t)m->n_local_experts + 1) * sizeof(int64_t));
                p->cap_rows = p->d_cap_rows = R;
            }
            s->direct = true;
            s->own_x = a->x_exp;
            s->own_act = a->act;
            a->rows_fixed = true;
            moe_stash_point_rows(a, s);
        }
        i += 4 * s->n_used;
    }
    mem_track_set(was);
    free(bufs);
    return placed;
}

void model_unplace_expert_stash(struct model *m)
{
    for (int l = 0; m->wstash && l < m->L; l++) {
        struct expert_wgrad_stash *s = &m->wstash[l];
        if (!s->direct) continue;
        MT_CHECK(s->pending == 0, "layer %d: parked rows moved while %d micro-steps wait in them", l, s->pending);
        struct layer_acts *a = &m->slots[0].layers[l];
        a->x_exp = s->own_x;
        a->act = s->own_act;
        a->rows_fixed = false;
        for (int k = 0; k < s->n_used; k++) {
            struct expert_rows_parked *p = &s->slot[k];
            for (int b = 0; b < 4; b++) {
                void **slot = slot_buffer(p, b);
                if (*slot && !(p->in_grads >> b & 1)) m->be->free(*slot);
                *slot = NULL;
            }
            p->in_grads = 0;
            p->cap_rows = p->d_cap_rows = 0;
        }
        s->direct = false;
        s->own_x = s->own_act = NULL;
    }
}

void model_enable_expert_wgrad_pairs(struct model *m, int n_layers)
{
    model_enable_expert_wgrad_groups(m, n_layers, 0, 2, 0, 0);
}

bool model_expert_wgrad_pending(const struct model *m)
{
    for (int l = 0; m->wstash && l < m->L; l++)
        if (m->wstash[l].pending) return true; /* a job's too */
    return false;
}

void moe_ensure_scratch_rows(struct model *m, int64_t R)
{
    enum mem_cat was = mem_track_set(MEM_BUFFERS);
    grow_expert_rows(m, &m->d_x_exp, &m->d_y_exp, &m->d_gu, &m->d_act, &m->d_cap_rows, R);
    mem_track_set(was);
}

void moe_ensure_rows(struct model *m, struct layer_acts *a, int64_t R)
{
    MT_CHECK(!a->rows_fixed || R <= a->cap_rows, "%lld expert rows in a layer whose rows are parked in place (%lld)",
             (long long)R, (long long)a->cap_rows);
    enum mem_cat was = mem_track_set(MEM_ACTS);
    grow_expert_rows(m, &a->x_exp, &a->y_exp, &a->gu, &a->act, &a->cap_rows, R);
    mem_track_set(was);
    moe_ensure_scratch_rows(m, R);
}

/* ---- the fixed exchange (model.h fixed_exchange) */

static void regrow_pair_tok(struct model *m, struct layer_acts *a, int64_t P)
{
    if (a->route.pair_tok) regrow(m, (void **)&a->route.pair_tok, P, sizeof(int32_t));
}

void model_enable_fixed_exchange(struct model *m, double fraction)
{
    MT_CHECK(m->pairs && m->moe_chunks == 1, "the fixed MoE exchange needs expert parallelism and moe_chunks 1");
    const int64_t T = m->T, K = m->K, mean = T * K, P = T * m->ep;
    if (m->ep > K) { /* the packed layout's T·min(k, ep) pairs are fewer than the blocks */
        enum mem_cat was = mem_track_set(MEM_BUFFERS);
        regrow(m, &m->d_x_send, P * m->H, m->be->x_size);
        regrow(m, (void **)&m->meta_idx_send, P * K, sizeof(int32_t));
        regrow(m, (void **)&m->meta_w_send, P * K, sizeof(float));
        mem_track_set(MEM_ACTS);
        for (int k = 0; k < m->st.n_slots; k++)
            for (int l = m->st.layer0; l < m->st.layer1; l++) regrow_pair_tok(m, &m->slots[k].layers[l], P);
        regrow_pair_tok(m, &m->shared, P);
        mem_track_set(was);
    }
    const size_t bytes = (size_t)MT_MAX(m->L, 1) * 2 * sizeof(int64_t);
    if (!m->rows_need) {
        enum mem_cat was = mem_track_set(MEM_BUFFERS);
        m->rows_need = m->be->alloc(bytes);
        mem_track_set(was);
        m->be->zero(m->rows_need, bytes);
        m->rows_cap = mt_calloc((size_t)MT_MAX(m->L, 1), sizeof *m->rows_cap);
    }
    int64_t cap = fraction > 0 ? (int64_t)(fraction * (double)mean) : moe_capacity(0, mean);
    cap = MT_MIN(cap, P * K); /* no plan makes more: every pair's k slots */
    for (int l = 0; l < m->L; l++) m->rows_cap[l] = cap;
    m->fixed_exchange = true;
}

bool model_fixed_exchange_overflow(struct model *m, int64_t *need)
{
    const size_t bytes = (size_t)MT_MAX(m->L, 1) * 2 * sizeof(int64_t);
    int64_t *got = mt_malloc(bytes);
    m->be->download(got, m->rows_need, bytes);
    m->be->zero(m->rows_need, bytes);
    bool cut = false;
    for (int l = 0; l < m->L; l++) {
        need[l] = got[2 * l + 1] > 0 ? got[2 * l] : 0;
        cut |= need[l] > 0;
    }
    free(got);
    return cut;
}

void model_fixed_exchange_grow(struct model *m, const int64_t *need)
{
    int64_t top = 0;
    for (int l = 0; l < m->L; l++) top = MT_MAX(top, need[l]);
    const int64_t cap = MT_MIN(top + top / 4 + 16, (int64_t)m->ep * m->T * m->K);
    for (int l = 0; l < m->L; l++) m->rows_cap[l] = MT_MAX(m->rows_cap[l], cap);
}

void moe_ensure_pairs(struct model *m, struct layer_acts *a, int64_t P)
{
    const int64_t K = m->K, mean = (int64_t)m->T * MT_MIN(m->K, m->ep);
    struct moe_route *r = &a->route;
    enum mem_cat was = mem_track_set(MEM_BUFFERS);
    if (P > r->cap_pairs) {
        int64_t cap = moe_capacity(P, mean);
        regrow(m, (void **)&r->meta_idx, cap * K, sizeof(int32_t));
        regrow(m, (void **)&r->meta_w, cap * K, sizeof(float));
        regrow(m, (void **)&r->exp_slot, cap * K, sizeof(int32_t));
        regrow(m, (void **)&r->exp_src, cap * K, sizeof(int32_t));
        /* the fixed exchange gathers rows up to its capacity, past the plan's: from pair 0 */
        m->be->zero(r->exp_src, (size_t)cap * K * sizeof(int32_t));
        r->cap_pairs = cap;
    }
    if (P > m->d_cap_pairs) {
        int64_t cap = moe_capacity(P, mean);
        regrow(m, (void **)&m->d_w_recv, cap * K, sizeof(float));
        m->d_cap_pairs = cap;
    }
    model_ensure_ones(m, P * K);
    mem_track_set(was);
}
