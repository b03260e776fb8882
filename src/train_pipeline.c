/* train_pipeline.h: the pieces of a pipelined training step that are not the schedule. */
#include "train_pipeline.h"

#include <stdlib.h>

#include "common.h"

double pipe_aux_pooled(const double *psum, const double *count, int E, int n_moe, int64_t tokens)
{
    /* the arithmetic of aux_from_stats (train.c), operation for operation */
    double rows = (double)n_moe * (double)tokens, a = 0;
    for (int e = 0; e < E; e++) a += (count[e] / rows) * (psum[e] / rows);
    return n_moe > 0 ? E * a : 0;
}

void pipe_pool_stats(const struct model_config *mc, const float *stats, int l0, int l1, double *psum,
                     double *count)
{
    const int E = mc->num_experts;
    for (int l = l0; l < l1; l++) {
        if (!config_layer_is_moe(mc, l)) continue;
        const float *st = stats + (size_t)(l - l0) * 2 * E;
        for (int e = 0; e < E; e++) {
            psum[e] += st[e];
            count[e] += st[E + e];
        }
    }
}

void pipe_tie_grads(struct model *m, const struct mesh *mesh, struct comm *ends)
{
    if (mesh->d.pp == 1 || !m->cfg.tie_word_embeddings || !ends) return;
    const int i = tensor_lookup(&m->tt, TR_EMBED, -1);
    MT_CHECK(i >= 0, "pipeline: stage %d of %d keeps no embedding to tie", mesh->me.stage, mesh->d.pp);
    comm_all_reduce_sum(ends, model_grad(m, i), (size_t)model_work_numel_of(m, i), COMM_F32);
}

struct unowned {
    const struct params *p;
    const struct mesh *mesh;
    float *grad[TG_COUNT];     /* host copies, downloaded on first need */
    double sq;
};

static void add_unowned(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff, int64_t len)
{
    (void)gidx;
    struct unowned *u = ctx;
    if (mesh_stage_owns(u->mesh, &u->p->m->tt.t[i])) return;
    if (!u->grad[g]) {
        const struct param_group_shard *s = &u->p->g[g];
        u->grad[g] = mt_malloc((size_t)MT_MAX(s->numel, 1) * sizeof(float));
        u->p->m->be->download(u->grad[g], s->grad, (size_t)s->numel * sizeof(float));
    }
    for (int64_t j = 0; j < len; j++) u->sq += (double)u->grad[g][soff + j] * u->grad[g][soff + j];
}

double pipe_unowned_grad_sq(const struct params *p, const struct mesh *mesh)
{
    struct unowned u = {.p = p, .mesh = mesh};
    params_for_each_run_of(p, p->S_rank, p->F_rank, p->m->expert0, add_unowned, &u);
    for (int k = 0; k < TG_COUNT; k++) free(u.grad[k]);
    return u.sq;
}
