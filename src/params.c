#include "params.h"

#include <math.h>

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "env_flag.h"
#include "master_split.h"
#include "mem_track.h"
#include "safetensors.h" /* st_bf16_to_f32, st_f32_to_bf16 */
#include "stash_place.h"

static void *xat(const struct backend *be, void *p, int64_t i) { return (char *)p + (size_t)i * be->x_size; }

static void add_segment(struct param_group_shard *g, int *cap, int64_t off, int64_t len,
                        const struct tensor_spec *s)
{
    if (len <= 0) return;
    if (g->n_seg == *cap) {
        *cap = *cap ? 2 * *cap : 16;
        g->seg = mt_realloc(g->seg, (size_t)*cap * sizeof *g->seg);
    }
    g->seg[g->n_seg++] = (struct param_segment){off, len, s->decay, s->frozen};
}

/* Shard buffers of a group. A kept compute copy is the master itself when the compute dtype is fp32
 * (without one, gathers cast from the master on every backend: the CPU tests run that path too). */
static void alloc_group(const struct backend *be, struct param_group_shard *g, bool keep_copy,
                        size_t mom_bytes, bool split_master)
{
    size_t n = (size_t)MT_MAX(g->numel, 1);
    /* a split master: its low halves here, its high halves the compute copy below */
    void **f[] = {split_master ? (void **)&g->master_lo : (void **)&g->master, &g->m1, &g->m2, (void **)&g->grad};
    const enum mem_cat cat[] = {MEM_MASTER, MEM_ADAM, MEM_ADAM, MEM_GRADS};
    const size_t es[] = {split_master ? sizeof(uint16_t) : sizeof(float), mom_bytes, mom_bytes, sizeof(float)};
    for (size_t k = 0; k < sizeof f / sizeof f[0]; k++) {
        enum mem_cat was = mem_track_set(cat[k]);
        *f[k] = be->alloc(n * es[k]);
        mem_track_set(was);
        be->zero(*f[k], n * es[k]);
    }
    g->aliased = g->group_size == 1;
    enum mem_cat was = mem_track_set(MEM_WEIGHTS);
    if (keep_copy) g->param_x = be->x_size == sizeof(float) ? (void *)g->master : be->alloc(n * be->x_size);
    mem_track_set(was);
}

void params_init(struct params *p, struct model *m, struct comm *stage, struct comm *fsdp)
{
    params_init_opts(p, m, stage, fsdp, true, false, false);
}

void params_init_opts(struct params *p, struct model *m, struct comm *stage, struct comm *fsdp,
                      bool keep_copy, bool bf16_moments, bool split_master)
{
    MT_CHECK(!split_master || (keep_copy && m->be->x_size == 2),
             "train.master_weights split needs the bf16 compute copy (model.precision bf16, train.weight_copy keep)");
    memset(p, 0, sizeof *p);
    p->m = m;
    p->mom_bytes = bf16_moments ? 2 : 4;
    p->split_master = split_master;
    p->adamw_per_tensor = mt_env_flag("MT_ADAMW_PER_TENSOR");
    p->stage = stage;
    p->fsdp = fsdp;
    p->S = stage ? stage->size : 1;
    p->S_rank = stage ? stage->rank : 0;
    p->F = fsdp ? fsdp->size : 1;
    p->F_rank = fsdp ? fsdp->rank : 0;
    p->n_units = m->L + 2;
    const struct tensor_table *tt = &m->tt;
    p->t_off = mt_malloc((size_t)tt->n * sizeof(int64_t));
    p->exp_rows = mt_calloc((size_t)tt->n, sizeof(int64_t));
    p->exp_piece_off = mt_calloc((size_t)tt->n, sizeof(int64_t));
    struct param_group_shard *gd = &p->g[TG_DENSE], *ge = &p->g[TG_EXPERT];
    gd->group_size = p->S;
    ge->group_size = p->F;
    for (int k = 0; k < TG_COUNT; k++) {
        p->g[k].u_off = mt_calloc((size_t)p->n_units, sizeof(int64_t));
        p->g[k].u_piece = mt_calloc((size_t)p->n_units, sizeof(int64_t));
        p->g[k].u_work = mt_calloc((size_t)p->n_units, sizeof(int64_t));
    }
    /* working layout of every unit: its tensors back to back in table (= unit) order */
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        p->t_off[i] = -1;
        if (!model_has_tensor(m, i)) continue;
        int u = tensor_unit(s, m->L);
        struct param_group_shard *g = &p->g[tensor_group_of(s)];
        p->t_off[i] = g->u_work[u];
        g->u_work[u] += model_work_numel_of(m, i);
        if (s->kind == TK_EXPERT) {
            p->exp_rows[i] = MT_CEIL_DIV(s->shape[1], p->F);
            p->exp_piece_off[i] = ge->u_piece[u];
            ge->u_piece[u] += (int64_t)m->n_local_experts * p->exp_rows[i] * s->shape[2];
        }
    }
    for (int u = 0; u < p->n_units; u++) {
        gd->u_piece[u] = MT_CEIL_DIV(gd->u_work[u], p->S);
        gd->u_work[u] = gd->u_piece[u] * p->S;   /* the gather fills the padding too */
        for (int k = 0; k < TG_COUNT; k++) {
            p->g[k].u_off[u] = p->g[k].numel;
            p->g[k].numel += p->g[k].u_piece[u];
        }
    }
    /* optimizer segments: the runs of each tensor in this rank's shard */
    int cap[TG_COUNT] = {0, 0};
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        if (p->t_off[i] < 0) continue;
        int u = tensor_unit(s, m->L);
        if (s->kind == TK_EXPERT) {
            add_segment(ge, &cap[TG_EXPERT], ge->u_off[u] + p->exp_piece_off[i],
                        (int64_t)m->n_local_experts * p->exp_rows[i] * s->shape[2], s);
        } else {
            int64_t lo = gd->u_piece[u] * p->S_rank, hi = lo + gd->u_piece[u];
            int64_t a = MT_MAX(lo, p->t_off[i]), b = MT_MIN(hi, p->t_off[i] + s->numel);
            add_segment(gd, &cap[TG_DENSE], gd->u_off[u] + a - lo, b - a, s);
        }
    }
    alloc_group(m->be, gd, keep_copy, p->mom_bytes, split_master);
    alloc_group(m->be, ge, keep_copy, p->mom_bytes, split_master);
}

void params_bind_unit(struct params *p, enum tensor_group g, int u, void *work, float *work_g)
{
    struct model *m = p->m;
    for (int i = 0; i < m->tt.n; i++) {
        const struct tensor_spec *s = &m->tt.t[i];
        if (p->t_off[i] < 0 || tensor_group_of(s) != g || tensor_unit(s, m->L) != u) continue;
        model_bind(m, i, work ? xat(m->be, work, p->t_off[i]) : m->wp[i],
                   work_g ? work_g + p->t_off[i] : m->gp[i]);
    }
}

bool params_static_weights(const struct params *p, enum tensor_group g)
{
    return p->g[g].aliased && p->g[g].param_x;
}

void params_bind_aliased(struct params *p)
{
    for (int k = 0; k < TG_COUNT; k++) {
        struct param_group_shard *g = &p->g[k];
        if (!g->aliased) continue;
        bool w = params_static_weights(p, (enum tensor_group)k);
        for (int u = 0; u < p->n_units; u++)
            params_bind_unit(p, (enum tensor_group)k, u, w ? xat(p->m->be, g->param_x, g->u_off[u]) : NULL,
                             g->grad + g->u_off[u]);
    }
}

void params_refresh_copy(struct params *p)
{
    const struct backend *be = p->m->be;
    for (int k = 0; k < TG_COUNT; k++) {
        struct param_group_shard *g = &p->g[k];
        /* a split master's high half is the copy already */
        if (g->param_x && g->master && g->param_x != (void *)g->master)
            be->cast_f32_to_x(g->param_x, g->master, (size_t)g->numel);
    }
}

void params_master_read(const struct params *p, enum tensor_group g, int64_t off, int64_t n, float *host)
{
    const struct backend *be = p->m->be;
    const struct param_group_shard *gs = &p->g[g];
    MT_CHECK(off >= 0 && n >= 0 && off + n <= gs->numel, "params_master_read: [%lld, +%lld) of %lld", (long long)off,
             (long long)n, (long long)gs->numel);
    if (n == 0) return;
    if (!p->split_master) {
        be->download(host, gs->master + off, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *hl = mt_malloc((size_t)n * 2 * sizeof(uint16_t));
    be->download(hl, (const uint16_t *)gs->param_x + off, (size_t)n * sizeof(uint16_t));
    be->download(hl + n, gs->master_lo + off, (size_t)n * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++) host[i] = mt_master_join(hl[i], hl[n + i]);
    free(hl);
}

void params_master_write(struct params *p, enum tensor_group g, int64_t off, int64_t n, const float *host)
{
    const struct backend *be = p->m->be;
    struct param_group_shard *gs = &p->g[g];
    MT_CHECK(off >= 0 && n >= 0 && off + n <= gs->numel, "params_master_write: [%lld, +%lld) of %lld", (long long)off,
             (long long)n, (long long)gs->numel);
    if (n == 0) return;
    if (!p->split_master) {
        be->upload(gs->master + off, host, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *hl = mt_malloc((size_t)n * 2 * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++) mt_master_split(host[i], &hl[i], &hl[n + i]);
    be->upload((uint16_t *)gs->param_x + off, hl, (size_t)n * sizeof(uint16_t));
    be->upload(gs->master_lo + off, hl + n, (size_t)n * sizeof(uint16_t));
    free(hl);
}

void params_free(struct params *p)
{
    const struct backend *be = p->m->be;
    for (int k = 0; k < TG_COUNT; k++) {
        struct param_group_shard *g = &p->g[k];
        void *bufs[] = {g->master, g->m1, g->m2, g->grad, g->param_x != (void *)g->master ? g->param_x : NULL,
                        g->master_lo};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            if (bufs[i]) be->free(bufs[i]);
        free(g->seg);
        free(g->u_off);
        free(g->u_piece);
        free(g->u_work);
    }
    free(p->opt_seg);
    free(p->t_off);
    free(p->exp_rows);
    free(p->exp_piece_off);
    memset(p, 0, sizeof *p);
}

/* Calls fn for every run of this rank's shard: `len` elements of tensor i starting at global
 * element `gidx` land at shard offset `soff` of `group`. */
typedef void (*shard_run_fn)(void *ctx, enum tensor_group group, int i, int64_t gidx, int64_t soff,
                             int64_t len);

/* The shard of the rank at stage position s_rank, EP_FSDP position f_rank holding experts from
 * expert0 (every rank's shard has the same size and layout, only the runs' sources differ). */
static void for_each_shard_run_of(const struct params *p, int s_rank, int f_rank, int64_t expert0,
                                  shard_run_fn fn, void *ctx)
{
    const struct model *m = p->m;
    const struct tensor_table *tt = &m->tt;
    const struct param_group_shard *gd = &p->g[TG_DENSE], *ge = &p->g[TG_EXPERT];
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        if (p->t_off[i] < 0) continue;
        int u = tensor_unit(s, m->L);
        if (tensor_group_of(s) == TG_DENSE) {
            int64_t lo = gd->u_piece[u] * s_rank, hi = lo + gd->u_piece[u];
            int64_t a = MT_MAX(lo, p->t_off[i]), b = MT_MIN(hi, p->t_off[i] + s->numel);
            if (b > a) fn(ctx, TG_DENSE, i, a - p->t_off[i], gd->u_off[u] + a - lo, b - a);
            continue;
        }
        int64_t d1 = s->shape[1], d2 = s->shape[2], rows = p->exp_rows[i];
        int64_t r0 = rows * f_rank, nr = MT_MAX(0, MT_MIN(d1, r0 + rows) - r0);
        for (int64_t e = 0; e < m->n_local_experts; e++) {
            int64_t gidx = ((expert0 + e) * d1 + r0) * d2;
            int64_t soff = ge->u_off[u] + p->exp_piece_off[i] + e * rows * d2;
            if (nr > 0) fn(ctx, TG_EXPERT, i, gidx, soff, nr * d2);
        }
    }
}

/* Copies the row blocks of unit u's expert tensors between `packed` ([F][piece]: what the
 * all-gather returns and the reduce-scatter takes) and the unit's working layout ([n_local, d1, d2]
 * per expert tensor), in the direction given; es = element size. */
static void expert_blocks_copy(const struct params *p, int u, void *packed, void *working, size_t es,
                               bool to_working)
{
    const struct model *m = p->m;
    const struct tensor_table *tt = &m->tt;
    const int64_t piece = p->g[TG_EXPERT].u_piece[u];
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        if (p->t_off[i] < 0 || s->kind != TK_EXPERT || tensor_unit(s, m->L) != u) continue;
        int64_t d1 = s->shape[1], d2 = s->shape[2], rows = p->exp_rows[i];
        for (int r = 0; r < p->F; r++) {
            int64_t r0 = rows * r, nr = MT_MAX(0, MT_MIN(d1, r0 + rows) - r0);
            for (int64_t e = 0; nr > 0 && e < m->n_local_experts; e++) {
                char *pk = (char *)packed + (size_t)(r * piece + p->exp_piece_off[i] + e * rows * d2) * es;
                char *wk = (char *)working + (size_t)(p->t_off[i] + (e * d1 + r0) * d2) * es;
                m->be->copy(to_working ? wk : pk, to_working ? pk : wk, (size_t)(nr * d2) * es);
            }
        }
    }
}

int64_t params_layer_unit_max(const struct params *p, enum tensor_group g)
{
    int64_t w = 0;
    for (int u = 1; u <= p->m->L; u++) w = MT_MAX(w, p->g[g].u_work[u]);
    return w;
}

void params_unit_max(const struct params *p, enum tensor_group g, int64_t *work, int64_t *piece)
{
    *work = *piece = 0;
    for (int u = 0; u < p->n_units; u++) {
        *work = MT_MAX(*work, p->g[g].u_work[u]);
        *piece = MT_MAX(*piece, p->g[g].u_piece[u]);
    }
}

/* The gathers run in place: the rank's piece is put at its slot of the gather's output (a copy
 * of the compute copy, or a cast of the master), so no send buffer is needed. Experts gather into
 * `stage` and are reordered into `work` when the gather is finished. */
void params_gather_unit_start(struct params *p, enum tensor_group g, int u, void *work, void *stage,
                              struct comm_p2p_req *r)
{
    const struct backend *be = p->m->be;
    struct param_group_shard *gs = &p->g[g];
    const int64_t n = gs->u_piece[u];
    r->state = NULL;
    if (n == 0) return;
    const int rank = g == TG_DENSE ? p->S_rank : p->F_rank;
    void *out = g == TG_DENSE || gs->group_size == 1 ? work : stage;
    void *mine = xat(be, out, (int64_t)rank * n);
    if (gs->param_x) be->copy(mine, xat(be, gs->param_x, gs->u_off[u]), (size_t)n * be->x_size);
    else be->cast_f32_to_x(mine, gs->master + gs->u_off[u], (size_t)n);
    if (gs->group_size == 1) return;   /* the unit's piece is its working layout */
    comm_all_gather_start(g == TG_DENSE ? p->stage : p->fsdp, out, mine, (size_t)n, comm_dtype_of_x(be->x_size), r);
}

void params_gather_unit_finish(struct params *p, enum tensor_group g, int u, void *work, void *stage,
                               struct comm_p2p_req *r)
{
    struct param_group_shard *gs = &p->g[g];
    if (gs->u_piece[u] == 0 || gs->group_size == 1) return;
    comm_p2p_wait(g == TG_DENSE ? p->stage : p->fsdp, r);
    if (g == TG_EXPERT) expert_blocks_copy(p, u, stage, work, p->m->be->x_size, true);
}

void params_gather_unit(struct params *p, enum tensor_group g, int u, void *work, void *stage)
{
    struct comm_p2p_req r;
    params_gather_unit_start(p, g, u, work, stage, &r);
    params_gather_unit_finish(p, g, u, work, stage, &r);
}

/* In place as well: the dense unit's gradient buffer is the reduce-scatter's input, the experts'
 * are reordered into `stage` first; the rank's sum lands at its slot and is added to the shard. */
static float *reduce_input(enum tensor_group g, float *work_g, float *stage)
{
    return g == TG_EXPERT ? stage : work_g;
}

void params_reduce_unit_start(struct params *p, enum tensor_group g, int u, float *work_g, float *stage,
                              struct comm_p2p_req *r, bool into_shard)
{
    const struct backend *be = p->m->be;
    struct param_group_shard *gs = &p->g[g];
    const int64_t n = gs->u_piece[u];
    r->state = NULL;
    if (n == 0) return;
    float *in = reduce_input(g, work_g, stage);
    if (g == TG_EXPERT) {
        be->zero(stage, (size_t)n * p->F * sizeof(float));
        expert_blocks_copy(p, u, stage, work_g, sizeof(float), false);
    }
    const int rank = g == TG_DENSE ? p->S_rank : p->F_rank;
    /* into_shard: the sum lands in the shard's gradient itself, no add after it */
    float *out = into_shard ? gs->grad + gs->u_off[u] : in + (size_t)rank * n;
    comm_reduce_scatter_sum_start(g == TG_DENSE ? p->stage : p->fsdp, out, in, (size_t)n, COMM_F32, r);
}

void params_reduce_unit_finish(struct params *p, enum tensor_group g, int u, float *work_g, float *stage,
                               struct comm_p2p_req *r, bool into_shard)
{
    struct param_group_shard *gs = &p->g[g];
    const int64_t n = gs->u_piece[u];
    if (n == 0) return;
    comm_p2p_wait(g == TG_DENSE ? p->stage : p->fsdp, r);
    if (into_shard) return;
    const int rank = g == TG_DENSE ? p->S_rank : p->F_rank;
    p->m->be->add_f32(gs->grad + gs->u_off[u], reduce_input(g, work_g, stage) + (size_t)rank * n, (size_t)n);
}

void params_reduce_unit(struct params *p, enum tensor_group g, int u, float *work_g, float *stage)
{
    struct comm_p2p_req r;
    params_reduce_unit_start(p, g, u, work_g, stage, &r, false);
    params_reduce_unit_finish(p, g, u, work_g, stage, &r, false);
}

void params_moment_to_host(const struct params *p, enum tensor_group g, int k, float *host)
{
    const struct param_group_shard *gs = &p->g[g];
    const void *src = k == 1 ? gs->m1 : gs->m2;
    const size_t n = (size_t)gs->numel;
    if (p->mom_bytes == sizeof(float)) {
        p->m->be->download(host, src, n * sizeof(float));
        return;
    }
    uint16_t *h = mt_malloc(MT_MAX(n, 1) * sizeof(uint16_t));
    p->m->be->download(h, src, n * sizeof(uint16_t));
    for (size_t j = 0; j < n; j++) host[j] = st_bf16_to_f32(h[j]);
    free(h);
}

void params_moment_from_host(struct params *p, enum tensor_group g, int k, const float *host)
{
    struct param_group_shard *gs = &p->g[g];
    void *dst = k == 1 ? gs->m1 : gs->m2;
    const size_t n = (size_t)gs->numel;
    if (p->mom_bytes == sizeof(float)) {
        p->m->be->upload(dst, host, n * sizeof(float));
        return;
    }
    uint16_t *h = mt_malloc(MT_MAX(n, 1) * sizeof(uint16_t));
    for (size_t j = 0; j < n; j++) h[j] = st_f32_to_bf16(host[j]);
    p->m->be->upload(dst, h, n * sizeof(uint16_t));
    free(h);
}

void params_moments_zero(struct params *p)
{
    for (int k = 0; k < TG_COUNT; k++) {
        p->m->be->zero(p->g[k].m1, (size_t)p->g[k].numel * p->mom_bytes);
        p->m->be->zero(p->g[k].m2, (size_t)p->g[k].numel * p->mom_bytes);
    }
}

void params_gather_weights(struct params *p)
{
    for (int k = 0; k < TG_COUNT; k++)
        MT_CHECK(params_static_weights(p, (enum tensor_group)k),
                 "params_gather_weights: the %s group is gathered unit by unit (use fsdp.c)",
                 k == TG_DENSE ? "dense" : "expert");
    params_bind_aliased(p);
}

void params_zero_grad(struct params *p)
{
    p->m->be->zero(p->g[TG_DENSE].grad, (size_t)p->g[TG_DENSE].numel * sizeof(float));
    /* expert gradients: a unit of the shard that is one layer's expert tensors as the backward
     * writes them (the group of one, aliased) is left for that backward to overwrite */
    const struct param_group_shard *ge = &p->g[TG_EXPERT];
    for (int u = 0; u < p->n_units; u++) {
        if (ge->u_piece[u] == 0) continue;
        if (ge->aliased && ge->u_piece[u] == ge->u_work[u] &&
            model_skip_expert_grad_zeroing(p->m, u, ge->u_work[u]))
            continue;
        p->m->be->zero(ge->grad + ge->u_off[u], (size_t)ge->u_piece[u] * sizeof(float));
    }
}

int params_expert_grad_hosts(struct params *p, int n_micro, struct stash_host *hosts, void **mem)
{
    const struct param_group_shard *ge = &p->g[TG_EXPERT];
    int n = 0;
    for (int u = 1; ge->aliased && u <= p->m->L && u < p->n_units; u++) {
        const int l = u - 1; /* tensors.h tensor_unit: decoder layer l is unit 1 + l */
        if (ge->u_piece[u] == 0 || ge->u_piece[u] != ge->u_work[u] ||
            !model_expert_grads_written_last(p->m, l, n_micro))
            continue;
        const uintptr_t start = (uintptr_t)(ge->grad + ge->u_off[u]);
        hosts[n] = (struct stash_host){l, stash_host_bytes(ge->u_piece[u] * (int64_t)sizeof(float))};
        mem[n++] = (void *)(MT_CEIL_DIV(start, MT_STASH_PLACE_ALIGN) * MT_STASH_PLACE_ALIGN);
    }
    return n;
}

double params_group_grad_sumsq(struct params *p, enum tensor_group g)
{
    return p->m->be->sumsq_f32(p->g[g].grad, (size_t)p->g[g].numel);
}

double params_group_grad_sumsq_known(struct params *p, enum tensor_group g, const double *known)
{
    const struct param_group_shard *gs = &p->g[g];
    if (!known || !gs->aliased) return params_group_grad_sumsq(p, g);
    const struct tensor_table *tt = &p->m->tt;
    double ss = 0;
    int64_t run_off = 0, run_len = 0; /* units next to each other without sums: one pass */
    for (int u = 0; u < p->n_units; u++) {
        if (gs->u_piece[u] == 0) continue;
        bool all = true;
        for (int i = 0; i < tt->n; i++)
            if (tensor_group_of(&tt->t[i]) == g && tensor_unit(&tt->t[i], tt->n_layers) == u && isnan(known[i]))
                all = false;
        if (!all) {
            if (run_len == 0) run_off = gs->u_off[u];
            if (run_off + run_len == gs->u_off[u]) {
                run_len += gs->u_piece[u];
                continue;
            }
            ss += p->m->be->sumsq_f32(gs->grad + run_off, (size_t)run_len);
            run_off = gs->u_off[u], run_len = gs->u_piece[u];
            continue;
        }
        if (run_len) ss += p->m->be->sumsq_f32(gs->grad + run_off, (size_t)run_len), run_len = 0;
        for (int i = 0; i < tt->n; i++)
            if (tensor_group_of(&tt->t[i]) == g && tensor_unit(&tt->t[i], tt->n_layers) == u) ss += known[i];
    }
    if (run_len) ss += p->m->be->sumsq_f32(gs->grad + run_off, (size_t)run_len);
    return ss;
}

double params_grad_sumsq_with(struct params *p, const double *known, struct comm *world)
{
    double ss = 0;
    for (int k = 0; k < TG_COUNT; k++)
        ss += known && !isnan(known[k]) ? known[k] : params_group_grad_sumsq(p, (enum tensor_group)k);
    comm_all_reduce_sum(world, &ss, 1, COMM_F64);
    return ss;
}

double params_grad_sumsq(struct params *p, struct comm *world) { return params_grad_sumsq_with(p, NULL, world); }

void params_for_each_run_of(const struct params *p, int s_rank, int f_rank, int64_t expert0,
                            params_run_fn fn, void *ctx)
{
    for_each_shard_run_of(p, s_rank, f_rank, expert0, fn, ctx);
}
