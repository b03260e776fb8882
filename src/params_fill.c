/* Filling the master shards from the host and collecting them back (params.h): the seeded random
 * init (the same value for an element on every mesh, computed by the rank's threads), loading
 * Hugging Face weights run by run of the shard, and gathering every rank's shard into whole tensors
 * on rank 0. The shard's runs come from params_for_each_run_of (params.c). */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "params.h"

#include <math.h>
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "hf_load.h"
#include "mesh.h"

/* fn over every run of this rank's own shard */
static void for_each_shard_run(const struct params *p, params_run_fn fn, void *ctx)
{
    params_for_each_run_of(p, p->S_rank, p->F_rank, p->m->expert0, fn, ctx);
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
    for (int k = 0; k < TG_COUNT; k++) {
        struct param_group_shard *g = &p->g[k];
        params_master_write(p, (enum tensor_group)k, 0, g->numel, f->host[k]);
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

void params_gather_global(const struct params *p, const struct mesh *mesh, float *const global[TG_COUNT])
{
    const int world = mesh->d.world, stage_size = mesh->d.S;
    MT_CHECK(mesh->d.pp == 1, "params_gather_global: pipeline stages are not supported yet");
    float *mine[TG_COUNT], *all[TG_COUNT] = {NULL, NULL};
    for (int k = 0; k < TG_COUNT; k++) {
        size_t n = (size_t)MT_MAX(p->g[k].numel, 1);
        mine[k] = mt_malloc(n * sizeof(float));
        params_master_read(p, (enum tensor_group)k, 0, p->g[k].numel, mine[k]);
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
            params_for_each_run_of(p, c.local, c.fsdp_rank, (int64_t)c.ep_rank * p->m->n_local_experts,
                                   copy_to_global, &f);
        }
    }
    for (int k = 0; k < TG_COUNT; k++) {
        free(mine[k]);
        free(all[k]);
    }
}
