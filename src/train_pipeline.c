/* train_pipeline.h: the pieces of a pipelined training step that are not the schedule. */
#include "train_pipeline.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "data.h"
#include "step_batch.h"
#include "pipeline.h"
#include "route_replay.h"
#include "step_maths.h"

double pipe_aux_pooled(const double *psum, const double *count, int E, int n_moe, int64_t tokens)
{
    /* the arithmetic of aux_from_stats (step_maths.c), operation for operation */
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

void pipe_tie_grads(struct params *p, const struct mesh *mesh, struct comm *ends)
{
    if (mesh->d.pp == 1 || !p->m->cfg.tie_word_embeddings || !ends) return;
    const struct param_group_shard *g = &p->g[TG_DENSE];
    MT_CHECK(g->u_piece[0] > 0, "pipeline: stage %d of %d keeps no embedding to tie", mesh->me.stage, mesh->d.pp);
    comm_all_reduce_sum(ends, g->grad + g->u_off[0], (size_t)g->u_piece[0], COMM_F32);
}

double pipe_grad_sumsq(struct params *p, const struct mesh *mesh, struct comm *ends, struct comm *world)
{
    pipe_tie_grads(p, mesh, ends);
    double all = params_grad_sumsq(p, world), dup = pipe_unowned_grad_sq(p, mesh);
    comm_all_reduce_sum(world, &dup, 1, COMM_F64);
    return all - dup;
}

struct model_stage pipe_model_stage(const struct mesh *mesh, int n_micro)
{
    struct pipe_schedule s;
    pipe_schedule_1f1b(&s, mesh->d.pp, mesh->me.stage, n_micro);
    struct model_stage st = {.layer0 = mesh->layer0, .layer1 = mesh->layer1, .first = mesh->me.stage == 0,
                             .last = mesh->me.stage == mesh->d.pp - 1, .n_slots = s.n_slots};
    pipe_schedule_free(&s);
    return st;
}

struct unowned {
    const struct params *p;
    const struct mesh *mesh;
    double sq;
};

static void add_unowned(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff, int64_t len)
{
    (void)gidx;
    struct unowned *u = ctx;
    if (mesh_stage_owns(u->mesh, &u->p->m->tt.t[i])) return;
    /* only the run itself leaves the device: a piece of the tied embedding */
    float *run = mt_malloc((size_t)MT_MAX(len, 1) * sizeof(float));
    u->p->m->be->download(run, u->p->g[g].grad + soff, (size_t)len * sizeof(float));
    for (int64_t j = 0; j < len; j++) u->sq += (double)run[j] * run[j];
    free(run);
}

double pipe_unowned_grad_sq(const struct params *p, const struct mesh *mesh)
{
    struct unowned u = {.p = p, .mesh = mesh};
    params_for_each_run_of(p, p->S_rank, p->F_rank, p->m->expert0, add_unowned, &u);
    return u.sq;
}

/* ---- the stage as the executor sees it ---------------------------------------------------- */

static void stage_forward(void *ctx, int slot, int micro)
{
    struct pipe_train *t = ctx;
    struct model *m = t->m;
    const struct mesh *mesh = t->mesh;
    (void)mesh;
    const struct step_batch *b = t->sb;
    const int E = m->E, L = m->L;
    const bool first = m->st.first, last = m->st.last;
    /* the first stage embeds the ids, the last takes the labels; every stage's attention needs
     * the document boundaries of its slot's micro-batch */
    const size_t at = (size_t)micro * b->mb * b->S;
    /* the recorded routing of the slot's sequences stays for the recompute in its backward */
    route_replay_load(m, slot, data_first_seq(t->step - 1, micro, b->n_micro, b->dp_rank, b->dp_size, b->mb));
    model_set_documents(m, slot, b->documents ? b->pos + at : NULL, b->documents ? b->seg + at : NULL);
    struct model_step_out o;
    model_arm_loss_gradient(m, (float)(1.0 / t->n_valid_global));
    model_stage_forward(m, slot, b->ids + at, b->labels + at, &o);
    model_disarm_loss_gradient(m);
    t->ce_local += o.ce_sum;
    t->valid_local += o.n_valid;
    if (E == 0) return;
    comm_all_reduce_sum(t->stage_h, m->stats_h, (size_t)L * 2 * E, COMM_F32);
    for (int l = m->st.layer0; l < m->st.layer1; l++)
        for (int e = 0; e < E; e++) t->layer_counts[(size_t)l * E + e] += m->stats_h[(size_t)l * 2 * E + E + e];
    /* the sums of the earlier stages' layers arrived with the activations */
    if (first) memset(t->pool, 0, (size_t)2 * E * sizeof(double));
    else m->be->download(t->pool, t->carry[slot], (size_t)2 * E * sizeof(double));
    pipe_pool_stats(&m->cfg, m->stats_h + (size_t)m->st.layer0 * 2 * E, m->st.layer0, m->st.layer1, t->pool,
                    t->pool + E);
    if (!last) {
        m->be->upload(t->carry[slot], t->pool, (size_t)2 * E * sizeof(double));
        return;
    }
    /* every MoE layer of the micro-batch is in: its aux and the aux gradient for the backwards */
    const double coef = m->cfg.router_aux_loss_coef;
    t->aux_sum += pipe_aux_pooled(t->pool, t->pool + E, E, m->n_moe_layers, t->tokens_micro_global);
    if (t->aux_fixed) memcpy(t->aux_host[slot], t->aux_fixed, (size_t)E * sizeof(float));
    else aux_grad_from_counts(t->pool + E, E, m->n_moe_layers, t->tokens_micro_global, coef / t->n_micro,
                              t->aux_host[slot]);
}

static void stage_backward(void *ctx, int slot, int micro)
{
    struct pipe_train *t = ctx;
    struct model *m = t->m;
    const int E = m->E;
    if (E > 0) {
        /* aux_dp is one vector per micro-batch, from the last stage back through every stage */
        if (m->st.last) m->be->upload(t->aux_dev[slot], t->aux_host[slot], (size_t)E * sizeof(float));
        else m->be->download(t->aux_host[slot], t->aux_dev[slot], (size_t)E * sizeof(float));
    }
    const size_t bytes = (size_t)m->T * m->H * m->be->x_size;
    if (!m->st.last) m->be->copy(m->d_h, t->grad_in[slot], bytes);
    m->more_backwards = micro + 1 < t->n_micro;   /* 1F1B runs the backwards in micro-batch order */
    model_stage_backward(m, slot, (float)(1.0 / t->n_valid_global), t->use_aux ? t->aux_host[slot] : NULL);
    if (!m->st.first) m->be->copy(t->grad_out[slot], m->d_h, bytes);
}

static int stage_buffers(void *ctx, enum pipe_xfer_kind k, int slot, int micro, struct comm_p2p_op *ops)
{
    (void)micro;
    struct pipe_train *t = ctx;
    struct model *m = t->m;
    const size_t th = (size_t)m->T * m->H;
    const enum comm_dtype xt = comm_dtype_of_x(m->be->x_size);
    int n = 0;
    switch (k) {
    case PIPE_RECV_FORWARD: ops[n++] = (struct comm_p2p_op){.buf = model_stage_input(m, slot), .count = th, .dtype = xt}; break;
    case PIPE_SEND_FORWARD: ops[n++] = (struct comm_p2p_op){.buf = model_stage_output(m, slot), .count = th, .dtype = xt}; break;
    case PIPE_RECV_BACKWARD: ops[n++] = (struct comm_p2p_op){.buf = t->grad_in[slot], .count = th, .dtype = xt}; break;
    case PIPE_SEND_BACKWARD: ops[n++] = (struct comm_p2p_op){.buf = t->grad_out[slot], .count = th, .dtype = xt}; break;
    }
    if (m->E > 0) {
        if (k == PIPE_RECV_FORWARD || k == PIPE_SEND_FORWARD)
            ops[n++] = (struct comm_p2p_op){.buf = t->carry[slot], .count = (size_t)2 * m->E, .dtype = COMM_F64};
        else
            ops[n++] = (struct comm_p2p_op){.buf = t->aux_dev[slot], .count = (size_t)m->E, .dtype = COMM_F32};
    }
    return n;
}

void pipe_train_init(struct pipe_train *t, const struct config *c, const struct mesh *mesh, struct model *m,
                     struct comm *stage_h, struct comm *pp, int n_micro)
{
    memset(t, 0, sizeof *t);
    t->c = c;
    t->mesh = mesh;
    t->m = m;
    t->stage_h = stage_h;
    t->pp = pp;
    t->n_micro = n_micro;
    const struct train_config *tc = &c->train;
    t->tokens_micro_global = (int64_t)mesh->d.S * tc->micro_batch_size * tc->seq_len;
    t->use_aux = tc->load_balance == MT_LB_AUX && m->E > 0;
    t->sched = mt_calloc(1, sizeof *t->sched);
    pipe_schedule_1f1b(t->sched, mesh->d.pp, mesh->me.stage, n_micro);
    MT_CHECK(t->sched->n_slots == m->st.n_slots, "pipeline: the model has %d slots, the schedule needs %d",
             m->st.n_slots, t->sched->n_slots);
    const int ns = t->sched->n_slots, E = MT_MAX(m->E, 1);
    t->carry = mt_calloc((size_t)ns, sizeof *t->carry);
    t->aux_dev = mt_calloc((size_t)ns, sizeof *t->aux_dev);
    t->aux_host = mt_calloc((size_t)ns, sizeof *t->aux_host);
    t->grad_in = mt_calloc((size_t)ns, sizeof *t->grad_in);
    t->grad_out = mt_calloc((size_t)ns, sizeof *t->grad_out);
    const size_t th = (size_t)m->T * m->H * m->be->x_size;
    for (int s = 0; s < ns; s++) {
        t->grad_in[s] = m->st.last ? NULL : m->be->alloc(th);
        t->grad_out[s] = m->st.first ? NULL : m->be->alloc(th);
        t->carry[s] = m->be->alloc((size_t)2 * E * sizeof(double));
        t->aux_dev[s] = m->be->alloc((size_t)E * sizeof(float));
        t->aux_host[s] = mt_calloc((size_t)E, sizeof(float));
    }
    t->pool = mt_calloc((size_t)2 * E, sizeof(double));
    t->layer_counts = mt_calloc((size_t)m->L * E, sizeof(double));
    t->pp_h = comm_mpi_create(mesh->pp_comm);
    t->world_h = comm_mpi_create(mesh->world_comm);
}

void pipe_train_results(struct pipe_train *t, double *ce_local, int64_t *valid_local, double *aux_sum,
                        double *layer_counts)
{
    const struct model *m = t->m;
    *ce_local = t->ce_local;
    *valid_local = t->valid_local;
    /* every rank of the last stage computed the same aux: count one of them */
    double aux = m->st.last && t->mesh->me.local == 0 ? t->aux_sum : 0;
    comm_all_reduce_sum(t->world_h, &aux, 1, COMM_F64);
    *aux_sum = aux;
    const size_t n = (size_t)m->L * MT_MAX(m->E, 1);
    memcpy(layer_counts, t->layer_counts, n * sizeof(double));
    if (m->E > 0) comm_all_reduce_sum(t->pp_h, layer_counts, n, COMM_F64);
}

void pipe_train_step(struct pipe_train *t, int step, const struct step_batch *sb)
{
    t->step = step;
    t->sb = sb;
    t->n_valid_global = sb->n_valid_global;
    t->ce_local = t->aux_sum = 0;
    t->valid_local = 0;
    memset(t->layer_counts, 0, (size_t)t->m->L * MT_MAX(t->m->E, 1) * sizeof(double));
    const struct pipe_stage st = {.ctx = t, .forward = stage_forward, .backward = stage_backward,
                                  .buffers = stage_buffers};
    /* every transfer buffer is its slot's own: transfers may run under the next compute */
    const double t0 = mt_now();
    t->wait_s += pipe_run(t->sched, t->pp, &st, true);
    t->run_s += mt_now() - t0;
}

void pipe_train_report_idle(const struct pipe_train *t, bool measured)
{
    const int pp = t->mesh->d.pp, world = t->mesh->d.pp * t->mesh->d.S, m = t->n_micro;
    double mine[3] = {t->mesh->me.stage, t->run_s, t->wait_s};
    double *all = mt_malloc((size_t)world * 3 * sizeof(double));
    comm_all_gather(t->world_h, all, mine, 3, COMM_F64);
    if (t->mesh->rank == 0) {
        const double theory = (double)(pp - 1) / (double)(m + pp - 1);
        if (!measured) {
            mt_log0("pipeline: 1F1B bubble in theory %.1f%% (pp %d, %d micro-batches per step); the stages' idle "
                    "time is measured on the CPU backend or with log.profile: true\n", 100 * theory, pp, m);
        } else {
            mt_log0("pipeline: idle share of each stage's 1F1B schedules (waiting for a neighbour), mean over its "
                    "ranks; 1F1B bubble in theory %.1f%% (pp %d, %d micro-batches per step)\n", 100 * theory, pp, m);
            for (int s = 0; s < pp; s++) {
                double run = 0, wait = 0;
                for (int r = 0; r < world; r++)
                    if ((int)all[3 * r] == s) run += all[3 * r + 1], wait += all[3 * r + 2];
                mt_log0("  stage %d: %.1f%% idle (%.3f s of %.3f s)\n", s, run > 0 ? 100 * wait / run : 0.0,
                        wait / t->mesh->d.S, run / t->mesh->d.S);
            }
        }
    }
    free(all);
}

void pipe_train_free(struct pipe_train *t)
{
    for (int s = 0; s < t->sched->n_slots; s++) {
        t->m->be->free(t->carry[s]);
        t->m->be->free(t->aux_dev[s]);
        free(t->aux_host[s]);
        if (t->grad_in[s]) t->m->be->free(t->grad_in[s]);
        if (t->grad_out[s]) t->m->be->free(t->grad_out[s]);
    }
    free(t->grad_in);
    free(t->grad_out);
    free(t->carry);
    free(t->aux_dev);
    free(t->aux_host);
    free(t->pool);
    free(t->layer_counts);
    pipe_schedule_free(t->sched);
    free(t->sched);
    comm_free(t->pp_h);
    comm_free(t->world_h);
}
