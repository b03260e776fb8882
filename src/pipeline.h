/* Pipeline parallelism: the 1F1B schedule (PipeDream-Flush / Megatron's non-interleaved schedule)
 * as data, and an executor that runs it against an abstract stage.
 *
 * For stage s of pp with m micro-batches:
 *   warm-up    w = min(pp - s - 1, m) forwards,
 *   steady     m - w times: forward of the next micro-batch, backward of the oldest in flight,
 *   cool-down  the w backwards left.
 * At most pp - s micro-batches are in flight on stage s (forwarded, backward not yet run), so a
 * stage keeps pp - s activation slots and micro-batch i lives in slot i % (pp - s).
 *
 * Between the compute actions sit communication points: the transfers posted there form ONE group
 * (comm_p2p), so that the pairs send_forward_recv_backward / send_backward_recv_forward of
 * neighbours, which each wait for the other, complete together instead of deadlocking.
 * The model never sees neighbours: the executor asks the stage for the buffers of a transfer. */
#ifndef MT_PIPELINE_H
#define MT_PIPELINE_H

#include <stdbool.h>

#include "comm.h"

enum pipe_xfer_kind {
    PIPE_RECV_FORWARD,  /* the input activations of a micro-batch, from stage s - 1 */
    PIPE_SEND_FORWARD,  /* the output activations of a micro-batch, to stage s + 1 */
    PIPE_RECV_BACKWARD, /* dL/d(output) of a micro-batch, from stage s + 1 */
    PIPE_SEND_BACKWARD, /* dL/d(input) of a micro-batch, to stage s - 1 */
};

struct pipe_xfer {
    enum pipe_xfer_kind kind;
    int micro;
};

enum pipe_action_kind { PIPE_COMM, PIPE_FORWARD, PIPE_BACKWARD };

struct pipe_action {
    enum pipe_action_kind kind;
    int micro;                 /* PIPE_FORWARD / PIPE_BACKWARD */
    int n_xfer;                /* PIPE_COMM: 1 or 2 transfers, posted as one group */
    struct pipe_xfer xfer[2];
};

struct pipe_schedule {
    int pp, stage, n_micro;
    int n_slots;               /* activation slots the stage needs: min(pp - stage, n_micro) */
    int n_warmup;
    int n;                     /* actions */
    struct pipe_action *a;     /* [n] */
};

/* Builds stage `stage`'s 1F1B list (0 <= stage < pp, n_micro >= 1). Transfers with no neighbour
 * (receiving forward on the first stage, sending forward on the last, ...) are left out. */
void pipe_schedule_1f1b(struct pipe_schedule *s, int pp, int stage, int n_micro);
/* Stage `stage`'s forward-only list (validation, the global-batch aux pre-pass): each micro-batch
 * received, forwarded and sent on in order, no backward; micro-batch i in slot i % n_slots with
 * the 1F1B schedule's n_slots. pipe_schedule_valid does not apply (it wants the backwards);
 * pipe_schedules_simulate does. */
void pipe_schedule_forward_only(struct pipe_schedule *s, int pp, int stage, int n_micro);
void pipe_schedule_free(struct pipe_schedule *s);
static inline int pipe_slot(const struct pipe_schedule *s, int micro) { return micro % s->n_slots; }

/* Checks one stage's list: every micro-batch forwarded once then backwarded once, at most
 * pp - stage in flight, each input received before its forward, each output sent after it, each
 * output gradient received before the backward and each input gradient sent after it, no transfer
 * toward a missing neighbour, and no two micro-batches sharing a slot while in flight. Returns
 * false with a one-line reason. */
bool pipe_schedule_valid(const struct pipe_schedule *s, char *err, int errcap);

/* Runs every stage's list (s[pp]) as ranks would, with a grouped transfer point completing only
 * when each of its transfers has met its counterpart (the k-th send from a to b meets b's k-th
 * receive from a) at the peer's current point. Returns false with a reason on a deadlock or when a
 * send meets a receive of another micro-batch. */
bool pipe_schedules_simulate(const struct pipe_schedule *s, int pp, char *err, int errcap);

/* What the executor needs from a stage. Each callback gets `ctx` back. */
struct pipe_stage {
    void *ctx;
    /* forward of micro-batch `micro` in activation slot `slot`; its input (on a stage other than
     * the first) is already in the buffer the PIPE_RECV_FORWARD transfer filled */
    void (*forward)(void *ctx, int slot, int micro);
    /* backward of `micro`; on a stage other than the last, dL/d(output) already received */
    void (*backward)(void *ctx, int slot, int micro);
    /* the buffers of one transfer of `micro` in `slot`: writes up to PIPE_MAX_BUFS ops (buf, count,
     * dtype; kind and peer are the executor's) and returns how many. Both neighbours must list the
     * same counts and dtypes in the same order for a transfer. */
    int (*buffers)(void *ctx, enum pipe_xfer_kind kind, int slot, int micro, struct comm_p2p_op *ops);
};
#define PIPE_MAX_BUFS 4

/* Runs the schedule of this rank's stage: pp_comm has rank = stage and size = pp (a NULL comm
 * for pp = 1) and carries nothing else meanwhile.
 * overlap false: each transfer point completes before the next action.
 * overlap true: a transfer point is started (comm_p2p_start) and waited for only before the
 * compute that reads what it receives, or that runs in the slot of a micro-batch it sends, so
 * sends run under the next compute. The stage must then keep each slot's transfer buffers
 * apart from what compute on other slots writes. */
/* Returns the seconds the host spent waiting for transfers: the stage's idle time on the CPU (MPI
 * waits block); on a GPU only under log.profile, whose comm timer synchronises the device around
 * each wait (otherwise the waits are queued and return at once). */
double pipe_run(const struct pipe_schedule *s, struct comm *pp_comm, const struct pipe_stage *st, bool overlap);

#endif
