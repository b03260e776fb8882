/* The forward-only pass through a pipeline (pipeline_forward.h). */
#include "pipeline_forward.h"

#include <string.h>

#include "common.h"
#include "data.h"
#include "model_step.h"
#include "pipeline.h"
#include "route_replay.h"

static void forward(void *ctx, int slot, int micro)
{
    struct pipe_forward *f = ctx;
    struct model *m = f->m;
    const struct step_batch *b = f->b;
    const size_t at = (size_t)micro * b->mb * b->S;
    if (f->replay)
        route_replay_load(m, slot, data_first_seq(f->step, micro, b->n_micro, b->dp_rank, b->dp_size, b->mb));
    model_set_documents(m, slot, b->documents ? b->pos + at : NULL, b->documents ? b->seg + at : NULL);
    struct model_step_out o;
    model_stage_forward(m, slot, b->ids + at, b->labels + at, &o);
    f->ce_sum += o.ce_sum;
    f->n_valid += o.n_valid;
    if (!f->stats_sum || m->E == 0) return;
    const int E = m->E;
    comm_all_reduce_sum(f->stage_h, m->stats_h, (size_t)m->L * 2 * E, COMM_F32);
    for (size_t i = (size_t)m->st.layer0 * 2 * E; i < (size_t)m->st.layer1 * 2 * E; i++)
        f->stats_sum[i] += m->stats_h[i];
}

static void backward(void *ctx, int slot, int micro)
{
    (void)ctx;
    mt_fatal("forward-only pipeline pass: a backward of micro-batch %d (slot %d) was scheduled", micro, slot);
}

static int buffers(void *ctx, enum pipe_xfer_kind k, int slot, int micro, struct comm_p2p_op *ops)
{
    (void)micro;
    struct pipe_forward *f = ctx;
    struct model *m = f->m;
    const size_t th = (size_t)m->T * m->H;
    const enum comm_dtype xt = comm_dtype_of_x(m->be->x_size);
    MT_CHECK(k == PIPE_RECV_FORWARD || k == PIPE_SEND_FORWARD, "forward-only pipeline pass: transfer kind %d", (int)k);
    void *buf = k == PIPE_RECV_FORWARD ? model_stage_input(m, slot) : model_stage_output(m, slot);
    ops[0] = (struct comm_p2p_op){.buf = buf, .count = th, .dtype = xt};
    return 1;
}

void pipe_forward_run(struct pipe_forward *f)
{
    struct model *m = f->m;
    MT_CHECK(f->pp && f->pp->size > 1, "forward-only pipeline pass without a pipeline");
    MT_CHECK(!f->stats_sum || f->stage_h, "forward-only pipeline pass: statistics without the stage's comm");
    f->ce_sum = 0;
    f->n_valid = 0;
    struct pipe_schedule s;
    pipe_schedule_forward_only(&s, f->pp->size, f->pp->rank, f->b->n_micro);
    MT_CHECK(s.n_slots <= m->st.n_slots, "forward-only pipeline pass: %d slots, the model has %d", s.n_slots,
             m->st.n_slots);
    const struct pipe_stage st = {.ctx = f, .forward = forward, .backward = backward, .buffers = buffers};
    /* each slot's input and output are its own: a send may run under the next forward */
    pipe_run(&s, f->pp, &st, true);
    pipe_schedule_free(&s);
}
