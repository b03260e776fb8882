#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "params.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "env_flag.h"
#include "hf_load.h"
#include "mem_track.h"
#include "safetensors.h"

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
                        size_t mom_bytes)
{
    size_t n = (size_t)MT_MAX(g->numel, 1);
    void **f[] = {(void **)&g->master, &g->m1, &g->m2, (void **)&g->grad};
    const enum mem_cat cat[] = {MEM_MASTER, MEM_ADAM, MEM_ADAM, MEM_GRADS};
    const size_t es[] = {sizeof(float), mom_bytes, mom_bytes, sizeof(float)};
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
    params_init_opts(p, m, stage, fsdp, true, false);
}

void params_init_opts(struct params *p, struct model *m, struct comm *stage, struct comm *fsdp,
                      bool keep_copy, bool bf16_moments)
{
    memset(p, 0, sizeof *p);
    p->m = m;
    p->mom_bytes = bf16_moments ? 2 : 4;
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
    alloc_group(m->be, gd, keep_copy, p->mom_bytes);
    alloc_group(m->be, ge, keep_copy, p->mom_bytes);
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
        if (g->param_x && g->param_x != (void *)g->master) be->cast_f32_to_x(g->param_x, g->master, (size_t)g->numel);
    }
}

void params_free(struct params *p)
{
    const struct backend *be = p->m->be;
    for (int k = 0; k < TG_COUNT; k++) {
        struct param_group_shard *g = &p->g[k];
        void *bufs[] = {g->master, g->m1, g->m2, g->grad, g->param_x != (void *)g->master ? g->param_x : NULL};
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

static void for_each_shard_run(const struct params *p, shard_run_fn fn, void *ctx)
{
    for_each_shard_run_of(p, p->S_rank, p->F_rank, p->m->expert0, fn, ctx);
}

struct host_fill {
    const struct params *p;
    float *host[TG_COUNT];
    uint64_t seed;
};

struct global_fill {
    const struct params *p;
    const float *shard[TG_COUNT];   /* one rank's master shards (host) */
    float *const *global;
};

static void copy_to_global(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff,
                           int64_t len)
{
    struct global_fill *f = ctx;
    const struct tensor_spec *s = &f->p->m->tt.t[i];
    memcpy(f->global[g] + s->offset + gidx, f->shard[g] + soff, (size_t)len * sizeof(float));
}

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* N(0,1) from the hash of (seed, tensor, element): the same value on every mesh */
static double hashed_normal(uint64_t seed, int tensor, int64_t idx)
{
    uint64_t key = mix64(seed * 0x9e3779b97f4a7c15ULL + (uint64_t)tensor * 0xd1b54a32d192ed03ULL);
    uint64_t a = mix64(key ^ mix64((uint64_t)idx * 2 + 1));
    uint64_t b = mix64(key ^ mix64((uint64_t)idx * 2 + 2));
    double u1 = ((double)(a >> 11) + 1.0) * 0x1.0p-53, u2 = (double)(b >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

static void fill_random(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff,
                        int64_t len)
{
    struct host_fill *f = ctx;
    const struct tensor_spec *s = &f->p->m->tt.t[i];
    float *dst = f->host[g] + soff;
    double std = f->p->m->cfg.initializer_range;
    for (int64_t j = 0; j < len; j++)
        dst[j] = s->kind == TK_NORM ? 1.0f : (float)(std * hashed_normal(f->seed, i, gidx + j));
}

static void upload_masters(struct params *p, struct host_fill *f)
{
    const struct backend *be = p->m->be;
    for (int k = 0; k < TG_COUNT; k++) {
        struct param_group_shard *g = &p->g[k];
        be->upload(g->master, f->host[k], (size_t)g->numel * sizeof(float));
        free(f->host[k]);
    }
    params_refresh_copy(p);
    params_moments_zero(p);
    p->step = 0;
}

/* Loading from Hugging Face files reads, tensor by tensor, only what this rank's shard needs: the
 * whole tensor for the non-expert runs (at most an embedding's worth of host memory) and only the
 * local experts for the expert runs; a 30B checkpoint never sits whole in any rank's memory. */
struct hf_fill {
    struct host_fill *f;
    int tensor;            /* copy only the runs of this tensor */
    const float *src;      /* its data: the whole tensor, or the local experts [n_local, d1, d2] */
    int64_t base;          /* global element index of src[0] */
};

static void copy_from_tensor(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff,
                             int64_t len)
{
    struct hf_fill *h = ctx;
    if (i != h->tensor) return;
    memcpy(h->f->host[g] + soff, h->src + (gidx - h->base), (size_t)len * sizeof(float));
}

bool params_load_hf(struct params *p, const char *model_dir, char *err, int errcap)
{
    const struct model *m = p->m;
    struct hf_source *src = hf_open(model_dir, err, errcap);
    if (!src) return false;
    struct host_fill f = {.p = p};
    for (int k = 0; k < TG_COUNT; k++) f.host[k] = mt_calloc((size_t)MT_MAX(p->g[k].numel, 1), sizeof(float));
    bool ok = true;
    for (int i = 0; i < m->tt.n && ok; i++) {
        const struct tensor_spec *s = &m->tt.t[i];
        bool expert = s->kind == TK_EXPERT;
        int64_t n = expert ? s->numel / s->shape[0] * m->n_local_experts : s->numel;
        float *buf = mt_malloc((size_t)MT_MAX(n, 1) * sizeof(float));
        ok = hf_read_tensor(src, s, expert ? m->expert0 : 0, expert ? m->n_local_experts : 1, buf, err, errcap);
        if (ok) hf_claim_experts(src, s);  /* the experts other ranks read are used too */
        if (ok) {
            struct hf_fill h = {&f, i, buf, expert ? (int64_t)m->expert0 * s->shape[1] * s->shape[2] : 0};
            for_each_shard_run(p, copy_from_tensor, &h);
        }
        free(buf);
    }
    int unused = hf_count_unused(src);
    hf_close(src);
    if (!ok) {
        for (int k = 0; k < TG_COUNT; k++) free(f.host[k]);
        return false;
    }
    if (unused > 0) mt_warn0("%s: %d tensor(s) in the files are not used by this model\n", model_dir, unused);
    upload_masters(p, &f);
    return true;
}

/* Random init of a large shard is billions of hashed normals: collect the runs, cut them into
 * pieces and let every core of the machine take some (the values depend only on the element's
 * index, so the split changes nothing). */
struct init_piece {
    enum tensor_group g;
    int i;
    int64_t gidx, soff, len;
};

struct init_work {
    struct host_fill *f;
    struct init_piece *pc;
    int64_t n, cap;
    int n_threads, thread;
};

static void collect_piece(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff, int64_t len)
{
    struct init_work *w = ctx;
    const int64_t piece = 1 << 20;
    for (int64_t o = 0; o < len; o += piece) {
        if (w->n == w->cap) {
            w->cap = w->cap ? 2 * w->cap : 256;
            w->pc = mt_realloc(w->pc, (size_t)w->cap * sizeof *w->pc);
        }
        w->pc[w->n++] = (struct init_piece){g, i, gidx + o, soff + o, MT_MIN(piece, len - o)};
    }
}

static void *init_thread(void *arg)
{
    struct init_work *w = arg;
    for (int64_t k = w->thread; k < w->n; k += w->n_threads) {
        const struct init_piece *q = &w->pc[k];
        fill_random(w->f, q->g, q->i, q->gidx, q->soff, q->len);
    }
    return NULL;
}

void params_init_random(struct params *p, uint64_t seed)
{
    struct host_fill f = {.p = p, .seed = seed};
    for (int k = 0; k < TG_COUNT; k++) f.host[k] = mt_calloc((size_t)MT_MAX(p->g[k].numel, 1), sizeof(float));
    struct init_work all = {.f = &f};
    for_each_shard_run(p, collect_piece, &all);
    /* the cores this rank may run on: mpirun binds each rank to one core by default at -np <= 2 */
    cpu_set_t set;
    long cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : sysconf(_SC_NPROCESSORS_ONLN);
    int64_t total = 0;
    for (int k = 0; k < TG_COUNT; k++) total += p->g[k].numel;
    if (cores == 1 && total > ((int64_t)1 << 30))
        mt_log0("moetrain: warning: this rank is bound to one CPU core: initialising %.2f B "
                "parameters on it takes minutes (launch with mpirun --bind-to none, or give each "
                "rank more cores)\n", (double)total / 1e9);
    int n_threads = (int)MT_MAX(1, MT_MIN(MT_MIN(cores, 64), all.n));
    pthread_t tid[64];
    struct init_work w[64];
    for (int t = 0; t < n_threads; t++) {
        w[t] = all;
        w[t].n_threads = n_threads;
        w[t].thread = t;
        if (t > 0 && pthread_create(&tid[t], NULL, init_thread, &w[t]) != 0)
            mt_fatal("pthread_create for the parameter init failed");
    }
    if (n_threads > 0) init_thread(&w[0]);
    for (int t = 1; t < n_threads; t++) pthread_join(tid[t], NULL);
    free(all.pc);
    upload_masters(p, &f);
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
                              struct comm_p2p_req *r)
{
    const struct backend *be = p->m->be;
    const int64_t n = p->g[g].u_piece[u];
    r->state = NULL;
    if (n == 0) return;
    float *in = reduce_input(g, work_g, stage);
    if (g == TG_EXPERT) {
        be->zero(stage, (size_t)n * p->F * sizeof(float));
        expert_blocks_copy(p, u, stage, work_g, sizeof(float), false);
    }
    const int rank = g == TG_DENSE ? p->S_rank : p->F_rank;
    comm_reduce_scatter_sum_start(g == TG_DENSE ? p->stage : p->fsdp, in + (size_t)rank * n, in, (size_t)n,
                                  COMM_F32, r);
}

void params_reduce_unit_finish(struct params *p, enum tensor_group g, int u, float *work_g, float *stage,
                               struct comm_p2p_req *r)
{
    struct param_group_shard *gs = &p->g[g];
    const int64_t n = gs->u_piece[u];
    if (n == 0) return;
    comm_p2p_wait(g == TG_DENSE ? p->stage : p->fsdp, r);
    const int rank = g == TG_DENSE ? p->S_rank : p->F_rank;
    p->m->be->add_f32(gs->grad + gs->u_off[u], reduce_input(g, work_g, stage) + (size_t)rank * n, (size_t)n);
}

void params_reduce_unit(struct params *p, enum tensor_group g, int u, float *work_g, float *stage)
{
    struct comm_p2p_req r;
    params_reduce_unit_start(p, g, u, work_g, stage, &r);
    params_reduce_unit_finish(p, g, u, work_g, stage, &r);
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

double params_grad_sumsq(struct params *p, struct comm *world)
{
    const struct backend *be = p->m->be;
    double ss = 0;
    for (int k = 0; k < TG_COUNT; k++) ss += be->sumsq_f32(p->g[k].grad, (size_t)p->g[k].numel);
    comm_all_reduce_sum(world, &ss, 1, COMM_F64);
    return ss;
}

void params_gather_global(const struct params *p, const struct mesh *mesh, float *const global[TG_COUNT])
{
    const struct backend *be = p->m->be;
    const int world = mesh->d.world, stage_size = mesh->d.S;
    MT_CHECK(mesh->d.pp == 1, "params_gather_global: pipeline stages are not supported yet");
    float *mine[TG_COUNT], *all[TG_COUNT] = {NULL, NULL};
    for (int k = 0; k < TG_COUNT; k++) {
        size_t n = (size_t)MT_MAX(p->g[k].numel, 1);
        mine[k] = mt_malloc(n * sizeof(float));
        be->download(mine[k], p->g[k].master, (size_t)p->g[k].numel * sizeof(float));
        if (mesh->rank == 0) all[k] = mt_malloc(n * (size_t)world * sizeof(float));
        MT_CHECK_MPI(MPI_Gather(mine[k], (int)n, MPI_FLOAT, all[k], (int)n, MPI_FLOAT, 0,
                                mesh->world_comm));
    }
    if (mesh->rank == 0) {
        for (int r = 0; r < world && r < stage_size; r++) {
            struct mesh_coord c;
            mesh_coord_of(&mesh->d, r, &c);
            struct global_fill f = {.p = p, .global = global};
            for (int k = 0; k < TG_COUNT; k++)
                f.shard[k] = all[k] + (size_t)r * (size_t)MT_MAX(p->g[k].numel, 1);
            for_each_shard_run_of(p, c.local, c.fsdp_rank,
                                  (int64_t)c.ep_rank * p->m->n_local_experts, copy_to_global, &f);
        }
    }
    for (int k = 0; k < TG_COUNT; k++) {
        free(mine[k]);
        free(all[k]);
    }
}

void params_for_each_run_of(const struct params *p, int s_rank, int f_rank, int64_t expert0,
                            params_run_fn fn, void *ctx)
{
    for_each_shard_run_of(p, s_rank, f_rank, expert0, fn, ctx);
}
