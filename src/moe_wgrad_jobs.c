/* Expert weight-gradient jobs (moe_wgrad_jobs.h): queued by the backward that completes a layer's
 * group, run in parts at exchange waits, finished at the layer's next backward. */
#include "moe_wgrad_jobs.h"

#include "comm.h"
#include "common.h"
#include "model.h"

void model_enable_wgrad_jobs(struct model *m)
{
    MT_CHECK(m->wstash, "expert wgrad jobs need parallel.expert_wgrad_pairs");
    for (int l = 0; l < m->L; l++) /* a job outlives the step's last backward, where the hosts are written */
        MT_CHECK(!m->wstash[l].direct, "expert wgrad jobs with parked rows in the gradients (MT_STASH_IN_GRADS)");
    m->wgrad_jobs = true;
}

/* Runs job l's two weight gradients (down: dw_down += Σ d_y_expᵀ act; gate_up: dw_gu += Σ d_guᵀ
 * x_exp over the slots' rows) as far as `until` lets them (NULL: to the end) */
static void job_run(struct model *m, int l, const struct exchange_arrival *until)
{
    struct expert_wgrad_stash *s = &m->wstash[l];
    const int H = m->H, I = m->I, nl = m->n_local_experts, n = s->pending;
    struct expert_rows down[MT_WGRAD_MAX_SETS], gu[MT_WGRAD_MAX_SETS];
    for (int k = 0; k < n; k++) {
        const struct expert_rows_parked *p = &s->slot[k];
        down[k] = (struct expert_rows){p->d_y_exp, p->act, p->off, p->rows};
        gu[k] = (struct expert_rows){p->d_gu, p->x_exp, p->off, p->rows};
    }
    m->be->expert_matmul_wgrad_part(grad_of(m, TR_EXP_DOWN, l), down, n, nl, I, H, s->job_fresh, s->cursor, until);
    m->be->expert_matmul_wgrad_part(grad_of(m, TR_EXP_GATE_UP, l), gu, n, nl, H, 2 * I, s->job_fresh,
                                    s->cursor + 2, until);
}

void moe_wgrad_job_queue(struct model *m, int l, bool fresh)
{
    struct expert_wgrad_stash *s = &m->wstash[l];
    MT_CHECK(!s->job && s->pending >= 1, "moe_wgrad_job_queue: layer %d has a job or no rows", l);
    if (!s->cursor) s->cursor = m->be->alloc(4 * sizeof(int32_t));
    m->be->zero(s->cursor, 4 * sizeof(int32_t));
    s->job = true;
    s->job_fresh = fresh;
    s->job_seq = m->wgrad_job_seq++;
}

void moe_wgrad_job_finish(struct model *m, int l)
{
    struct expert_wgrad_stash *s = m->wstash ? &m->wstash[l] : NULL;
    if (!s || !s->job) return;
    job_run(m, l, NULL);
    s->job = false;
    s->pending = 0;
}

void moe_wgrad_jobs_fill(struct model *m, const struct comm_p2p_req *r)
{
    if (!m->wgrad_jobs) return;
    int oldest = -1;
    for (int l = 0; l < m->L; l++)
        if (m->wstash[l].job && (oldest < 0 || m->wstash[l].job_seq < m->wstash[oldest].job_seq)) oldest = l;
    if (oldest < 0) return;
    struct exchange_arrival until = {0};
    if (!comm_exchange_arrival(m->ep_comm, r, &until)) until.flags = NULL; /* a backend that cannot see it takes none (CPU: its test setting) */
    job_run(m, oldest, &until);
}
