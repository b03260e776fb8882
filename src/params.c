#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "params.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "hf_load.h"

static void *xat(const struct backend *be, void *p, int64_t i) { return (char *)p + (size_t)i * be->x_size; }

/* A group of one rank holds its whole working layout as its shard (same order, no padding), so
 * the shard's compute copy and gradient ARE the model's working weights and gradients: no staging
 * buffers, no copies (this is what lets 8 full Qwen3-30B layers fit one GPU). */
static void alloc_group(const struct backend *be, struct param_group_shard *g, int group_size,
                        void *work_x, float *work_g)
{
    size_t n = (size_t)MT_MAX(g->numel, 1);
    g->master = be->alloc(n * sizeof(float));
    g->m1 = be->alloc(n * sizeof(float));
    g->m2 = be->alloc(n * sizeof(float));
    be->zero(g->master, n * sizeof(float));
    be->zero(g->m1, n * sizeof(float));
    be->zero(g->m2, n * sizeof(float));
    g->aliased = group_size == 1;
    if (g->aliased) {
        g->param_x = work_x;
        g->grad = work_g;
        return;
    }
    g->grad = be->alloc(n * sizeof(float));
    be->zero(g->grad, n * sizeof(float));
    g->param_x = be->alloc(n * be->x_size);
    g->gather_x = be->alloc(n * (size_t)group_size * be->x_size);
    g->scatter_f = be->alloc(n * (size_t)group_size * sizeof(float));
}

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

void params_init(struct params *p, struct model *m, struct comm *stage, struct comm *fsdp)
{
    memset(p, 0, sizeof *p);
    p->m = m;
    p->stage = stage;
    p->fsdp = fsdp;
    p->S = stage ? stage->size : 1;
    p->S_rank = stage ? stage->rank : 0;
    p->F = fsdp ? fsdp->size : 1;
    p->F_rank = fsdp ? fsdp->rank : 0;
    const struct tensor_table *tt = &m->tt;
    p->exp_rows = mt_calloc((size_t)tt->n, sizeof(int64_t));
    p->exp_shard_off = mt_calloc((size_t)tt->n, sizeof(int64_t));

    struct param_group_shard *gd = &p->g[TG_DENSE], *ge = &p->g[TG_EXPERT];
    gd->chunk = MT_CEIL_DIV(m->work_numel[TG_DENSE], p->S);
    gd->numel = gd->chunk;
    int capd = 0, cape = 0;
    int64_t lo = gd->chunk * p->S_rank, hi = lo + gd->chunk;
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        if (tensor_group_of(s) == TG_DENSE) {
            int64_t a = MT_MAX(lo, m->work_off[i]), b = MT_MIN(hi, m->work_off[i] + s->numel);
            add_segment(gd, &capd, a - lo, b - a, s);
        } else {
            p->exp_rows[i] = MT_CEIL_DIV(s->shape[1], p->F);
            p->exp_shard_off[i] = ge->numel;
            int64_t len = (int64_t)m->n_local_experts * p->exp_rows[i] * s->shape[2];
            add_segment(ge, &cape, ge->numel, len, s);
            ge->numel += len;
        }
    }
    MT_CHECK(p->S > 1 || gd->numel == m->work_numel[TG_DENSE], "dense shard layout");
    alloc_group(m->be, gd, p->S, m->w[TG_DENSE], m->g[TG_DENSE]);
    alloc_group(m->be, ge, p->F, m->w[TG_EXPERT], m->g[TG_EXPERT]);
}

void params_free(struct params *p)
{
    const struct backend *be = p->m->be;
    for (int k = 0; k < TG_COUNT; k++) {
        struct param_group_shard *g = &p->g[k];
        void *bufs[] = {g->master, g->m1, g->m2, g->aliased ? NULL : g->grad,
                        g->aliased ? NULL : g->param_x, g->gather_x, g->scatter_f};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            if (bufs[i]) be->free(bufs[i]);
        free(g->seg);
    }
    free(p->exp_rows);
    free(p->exp_shard_off);
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
    const struct param_group_shard *gd = &p->g[TG_DENSE];
    int64_t lo = gd->chunk * s_rank, hi = lo + gd->chunk;
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        if (tensor_group_of(s) == TG_DENSE) {
            int64_t a = MT_MAX(lo, m->work_off[i]), b = MT_MIN(hi, m->work_off[i] + s->numel);
            if (b > a) fn(ctx, TG_DENSE, i, a - m->work_off[i], a - lo, b - a);
            continue;
        }
        int64_t d1 = s->shape[1], d2 = s->shape[2], rows = p->exp_rows[i];
        int64_t r0 = rows * f_rank, nr = MT_MAX(0, MT_MIN(d1, r0 + rows) - r0);
        for (int64_t e = 0; e < m->n_local_experts; e++) {
            int64_t gidx = ((expert0 + e) * d1 + r0) * d2;
            int64_t soff = p->exp_shard_off[i] + e * rows * d2;
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
        be->cast_f32_to_x(g->param_x, g->master, (size_t)g->numel);
        be->zero(g->m1, (size_t)g->numel * sizeof(float));
        be->zero(g->m2, (size_t)g->numel * sizeof(float));
        free(f->host[k]);
    }
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

/* Copies expert row blocks between `packed` ([F][expert shard]: what the all-gather returns and the
 * reduce-scatter takes) and the model's working layout ([n_local, d1, d2] per expert tensor), in
 * the direction given; es = element size. */
static void expert_blocks_copy(const struct params *p, void *packed, void *working, size_t es,
                               bool to_working)
{
    const struct model *m = p->m;
    const struct tensor_table *tt = &m->tt;
    const int64_t shard = p->g[TG_EXPERT].numel;
    for (int i = 0; i < tt->n; i++) {
        const struct tensor_spec *s = &tt->t[i];
        if (tensor_group_of(s) != TG_EXPERT) continue;
        int64_t d1 = s->shape[1], d2 = s->shape[2], rows = p->exp_rows[i];
        for (int r = 0; r < p->F; r++) {
            int64_t r0 = rows * r, nr = MT_MAX(0, MT_MIN(d1, r0 + rows) - r0);
            for (int64_t e = 0; nr > 0 && e < m->n_local_experts; e++) {
                char *pk = (char *)packed + (size_t)(r * shard + p->exp_shard_off[i] + e * rows * d2) * es;
                char *wk = (char *)working + (size_t)(m->work_off[i] + (e * d1 + r0) * d2) * es;
                m->be->copy(to_working ? wk : pk, to_working ? pk : wk, (size_t)(nr * d2) * es);
            }
        }
    }
}

void params_gather_weights(struct params *p)
{
    struct model *m = p->m;
    const struct backend *be = m->be;
    struct param_group_shard *gd = &p->g[TG_DENSE], *ge = &p->g[TG_EXPERT];
    if (!gd->aliased) {
        comm_all_gather(p->stage, gd->gather_x, gd->param_x, (size_t)gd->numel, comm_dtype_of_x(be->x_size));
        be->copy(m->w[TG_DENSE], gd->gather_x, (size_t)m->work_numel[TG_DENSE] * be->x_size);
    }
    if (ge->numel == 0 || ge->aliased) return;
    comm_all_gather(p->fsdp, ge->gather_x, ge->param_x, (size_t)ge->numel, comm_dtype_of_x(be->x_size));
    expert_blocks_copy(p, ge->gather_x, m->w[TG_EXPERT], be->x_size, true);
}

double params_reduce_grads(struct params *p, struct comm *world)
{
    struct model *m = p->m;
    const struct backend *be = m->be;
    struct param_group_shard *gd = &p->g[TG_DENSE], *ge = &p->g[TG_EXPERT];
    if (!gd->aliased) {
        be->zero(gd->scatter_f, (size_t)gd->numel * p->S * sizeof(float));
        be->copy(gd->scatter_f, m->g[TG_DENSE], (size_t)m->work_numel[TG_DENSE] * sizeof(float));
        comm_reduce_scatter_sum(p->stage, gd->grad, gd->scatter_f, (size_t)gd->numel, COMM_F32);
    }
    if (ge->numel > 0 && !ge->aliased) {
        be->zero(ge->scatter_f, (size_t)ge->numel * p->F * sizeof(float));
        expert_blocks_copy(p, ge->scatter_f, m->g[TG_EXPERT], sizeof(float), false);
        comm_reduce_scatter_sum(p->fsdp, ge->grad, ge->scatter_f, (size_t)ge->numel, COMM_F32);
    }
    double ss = be->sumsq_f32(gd->grad, (size_t)gd->numel) + be->sumsq_f32(ge->grad, (size_t)ge->numel);
    comm_all_reduce_sum(world, &ss, 1, COMM_F64);
    return ss;
}

void params_adamw_step(struct params *p, const struct train_config *t, float lr, float grad_scale)
{
    const struct backend *be = p->m->be;
    p->step++;
    for (int k = 0; k < TG_COUNT; k++) {
        struct param_group_shard *g = &p->g[k];
        for (int j = 0; j < g->n_seg; j++) {
            const struct param_segment *s = &g->seg[j];
            if (s->frozen) continue;
            be->adamw_update(g->master + s->off, xat(be, g->param_x, s->off), g->grad + s->off,
                             g->m1 + s->off, g->m2 + s->off, (size_t)s->len, lr, (float)t->beta1,
                             (float)t->beta2, (float)t->adam_eps,
                             s->decay ? (float)t->weight_decay : 0.0f, p->step, grad_scale);
        }
    }
}

void params_working_to_host(const struct params *p, float *host[TG_COUNT])
{
    const struct model *m = p->m;
    const struct backend *be = m->be;
    for (int k = 0; k < TG_COUNT; k++) {
        size_t n = (size_t)m->work_numel[k];
        if (n == 0) continue;
        float *tmp = be->alloc(n * sizeof(float));
        be->cast_x_to_f32(tmp, m->w[k], n);
        be->download(host[k], tmp, n * sizeof(float));
        be->free(tmp);
    }
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
