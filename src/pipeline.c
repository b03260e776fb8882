/* The 1F1B schedule (pipeline.h): building, checking, simulating and running it. */
#include "pipeline.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* Appends a transfer point from up to two transfers, dropping those without a neighbour. */
static void push_comm(struct pipe_schedule *s, int n, const struct pipe_xfer *x)
{
    const bool first = s->stage == 0, last = s->stage == s->pp - 1;
    struct pipe_action a = {.kind = PIPE_COMM};
    for (int i = 0; i < n; i++) {
        const enum pipe_xfer_kind k = x[i].kind;
        if ((first && (k == PIPE_RECV_FORWARD || k == PIPE_SEND_BACKWARD)) ||
            (last && (k == PIPE_SEND_FORWARD || k == PIPE_RECV_BACKWARD)))
            continue;
        a.xfer[a.n_xfer++] = x[i];
    }
    if (a.n_xfer) s->a[s->n++] = a;
}

static void push_one(struct pipe_schedule *s, enum pipe_xfer_kind k, int micro)
{
    struct pipe_xfer x = {k, micro};
    push_comm(s, 1, &x);
}

static void push_two(struct pipe_schedule *s, enum pipe_xfer_kind k0, int m0, enum pipe_xfer_kind k1, int m1)
{
    struct pipe_xfer x[2] = {{k0, m0}, {k1, m1}};
    push_comm(s, 2, x);
}

static void push_compute(struct pipe_schedule *s, enum pipe_action_kind k, int micro)
{
    s->a[s->n++] = (struct pipe_action){.kind = k, .micro = micro};
}

void pipe_schedule_1f1b(struct pipe_schedule *s, int pp, int stage, int n_micro)
{
    MT_CHECK(pp >= 1 && stage >= 0 && stage < pp && n_micro >= 1, "1F1B schedule: stage %d of %d, %d micro-batches",
             stage, pp, n_micro);
    memset(s, 0, sizeof *s);
    s->pp = pp;
    s->stage = stage;
    s->n_micro = n_micro;
    s->n_slots = MT_MIN(pp - stage, n_micro);
    s->n_warmup = MT_MIN(pp - stage - 1, n_micro);
    /* per micro-batch: 2 computes and at most 4 transfer points */
    s->a = mt_malloc((size_t)6 * n_micro * sizeof *s->a);
    const int w = s->n_warmup, steady = n_micro - w;

    for (int i = 0; i < w; i++) {
        push_one(s, PIPE_RECV_FORWARD, i);
        push_compute(s, PIPE_FORWARD, i);
        push_one(s, PIPE_SEND_FORWARD, i);
    }
    if (steady > 0) push_one(s, PIPE_RECV_FORWARD, w);
    for (int i = 0; i < steady; i++) {
        const int fwd = w + i, bwd = i;
        push_compute(s, PIPE_FORWARD, fwd);
        push_two(s, PIPE_SEND_FORWARD, fwd, PIPE_RECV_BACKWARD, bwd);
        push_compute(s, PIPE_BACKWARD, bwd);
        if (i == steady - 1) push_one(s, PIPE_SEND_BACKWARD, bwd);
        else push_two(s, PIPE_SEND_BACKWARD, bwd, PIPE_RECV_FORWARD, fwd + 1);
    }
    for (int i = steady; i < n_micro; i++) {
        push_one(s, PIPE_RECV_BACKWARD, i);
        push_compute(s, PIPE_BACKWARD, i);
        push_one(s, PIPE_SEND_BACKWARD, i);
    }
}

void pipe_schedule_forward_only(struct pipe_schedule *s, int pp, int stage, int n_micro)
{
    MT_CHECK(pp >= 1 && stage >= 0 && stage < pp && n_micro >= 1,
             "forward-only schedule: stage %d of %d, %d micro-batches", stage, pp, n_micro);
    memset(s, 0, sizeof *s);
    s->pp = pp;
    s->stage = stage;
    s->n_micro = n_micro;
    s->n_slots = MT_MIN(pp - stage, n_micro);   /* the model's slots under 1F1B, reused */
    s->a = mt_malloc((size_t)3 * n_micro * sizeof *s->a);
    push_one(s, PIPE_RECV_FORWARD, 0);
    for (int i = 0; i < n_micro; i++) {
        push_compute(s, PIPE_FORWARD, i);
        /* the next input is posted with this output, so it arrives while the send runs */
        if (i + 1 < n_micro) push_two(s, PIPE_SEND_FORWARD, i, PIPE_RECV_FORWARD, i + 1);
        else push_one(s, PIPE_SEND_FORWARD, i);
    }
}

void pipe_schedule_free(struct pipe_schedule *s)
{
    free(s->a);
    s->a = NULL;
    s->n = 0;
}

/* ---- checking ---------------------------------------------------------------------------- */

#define FAIL(...)                                                    \
    do {                                                             \
        if (err && errcap > 0) snprintf(err, (size_t)errcap, __VA_ARGS__); \
        ok = false;                                                  \
        goto out;                                                    \
    } while (0)

/* per micro-batch progress bits */
enum { GOT_INPUT = 1, FORWARDED = 2, SENT_OUTPUT = 4, GOT_GRAD = 8, BACKWARDED = 16, SENT_GRAD = 32 };

static const char *xfer_name(enum pipe_xfer_kind k)
{
    static const char *names[] = {"recv_forward", "send_forward", "recv_backward", "send_backward"};
    return names[k];
}

bool pipe_schedule_valid(const struct pipe_schedule *s, char *err, int errcap)
{
    const bool first = s->stage == 0, last = s->stage == s->pp - 1;
    int *st = mt_calloc((size_t)s->n_micro, sizeof *st), *slot_of = mt_malloc((size_t)s->n_slots * sizeof *slot_of);
    for (int i = 0; i < s->n_slots; i++) slot_of[i] = -1;
    bool ok = true;
    int in_flight = 0;
    for (int k = 0; k < s->n; k++) {
        const struct pipe_action *a = &s->a[k];
        if (a->kind == PIPE_COMM) {
            if (a->n_xfer < 1 || a->n_xfer > 2) FAIL("action %d: %d transfers in one point", k, a->n_xfer);
            for (int j = 0; j < a->n_xfer; j++) {
                const int i = a->xfer[j].micro;
                const enum pipe_xfer_kind x = a->xfer[j].kind;
                if (i < 0 || i >= s->n_micro) FAIL("action %d: %s of micro-batch %d", k, xfer_name(x), i);
                int *b = &st[i];
                switch (x) {
                case PIPE_RECV_FORWARD:
                    if (first) FAIL("action %d: the first stage receives forward", k);
                    if (*b & GOT_INPUT) FAIL("action %d: micro-batch %d's input received twice", k, i);
                    *b |= GOT_INPUT;
                    break;
                case PIPE_SEND_FORWARD:
                    if (last) FAIL("action %d: the last stage sends forward", k);
                    if (!(*b & FORWARDED) || (*b & SENT_OUTPUT)) FAIL("action %d: micro-batch %d's output sent before its forward or twice", k, i);
                    *b |= SENT_OUTPUT;
                    break;
                case PIPE_RECV_BACKWARD:
                    if (last) FAIL("action %d: the last stage receives backward", k);
                    if (!(*b & SENT_OUTPUT) || (*b & GOT_GRAD)) FAIL("action %d: micro-batch %d's output gradient received before its output was sent, or twice", k, i);
                    *b |= GOT_GRAD;
                    break;
                case PIPE_SEND_BACKWARD:
                    if (first) FAIL("action %d: the first stage sends backward", k);
                    if (!(*b & BACKWARDED) || (*b & SENT_GRAD)) FAIL("action %d: micro-batch %d's input gradient sent before its backward or twice", k, i);
                    *b |= SENT_GRAD;
                    break;
                }
            }
            continue;
        }
        const int i = a->micro;
        if (i < 0 || i >= s->n_micro) FAIL("action %d: compute on micro-batch %d", k, i);
        const int slot = pipe_slot(s, i);
        if (a->kind == PIPE_FORWARD) {
            if (st[i] & FORWARDED) FAIL("action %d: micro-batch %d forwarded twice", k, i);
            if (!first && !(st[i] & GOT_INPUT)) FAIL("action %d: micro-batch %d forwarded before its input arrived", k, i);
            if (slot_of[slot] >= 0) FAIL("action %d: micro-batch %d takes slot %d still held by %d", k, i, slot, slot_of[slot]);
            slot_of[slot] = i;
            st[i] |= FORWARDED;
            if (++in_flight > s->pp - s->stage) FAIL("action %d: %d micro-batches in flight on stage %d of %d", k, in_flight, s->stage, s->pp);
        } else {
            if (!(st[i] & FORWARDED) || (st[i] & BACKWARDED)) FAIL("action %d: micro-batch %d backwarded before its forward or twice", k, i);
            if (!last && !(st[i] & GOT_GRAD)) FAIL("action %d: micro-batch %d backwarded before its output gradient arrived", k, i);
            st[i] |= BACKWARDED;
            slot_of[slot] = -1;
            in_flight--;
        }
    }
    for (int i = 0; i < s->n_micro; i++) {
        int want = FORWARDED | BACKWARDED | (first ? 0 : GOT_INPUT | SENT_GRAD) | (last ? 0 : SENT_OUTPUT | GOT_GRAD);
        if (st[i] != want) FAIL("micro-batch %d ends with progress %#x, expected %#x", i, st[i], want);
    }
out:
    free(st);
    free(slot_of);
    return ok;
}

/* ---- simulation -------------------------------------------------------------------------- */

/* A channel carries one direction between neighbours: forward a -> a + 1 (activations) or
 * backward a + 1 -> a (gradients). The k-th send on it meets the k-th receive. */
struct channel {
    int *sent, n_sent;     /* micro-batch of each send posted, in order */
    int *recvd, n_recvd;   /* micro-batch of each receive posted */
};

static struct channel *channel_of(struct channel *fw, struct channel *bw, int stage, enum pipe_xfer_kind k)
{
    switch (k) {
    case PIPE_SEND_FORWARD: return &fw[stage];
    case PIPE_RECV_FORWARD: return &fw[stage - 1];
    case PIPE_SEND_BACKWARD: return &bw[stage - 1];
    case PIPE_RECV_BACKWARD: return &bw[stage];
    }
    return NULL;
}

static bool is_send(enum pipe_xfer_kind k) { return k == PIPE_SEND_FORWARD || k == PIPE_SEND_BACKWARD; }

bool pipe_schedules_simulate(const struct pipe_schedule *s, int pp, char *err, int errcap)
{
    bool ok = true;
    const int cap = 4 * s[0].n_micro + 4;
    struct channel *fw = mt_calloc((size_t)pp, sizeof *fw), *bw = mt_calloc((size_t)pp, sizeof *bw);
    for (int i = 0; i < pp; i++) {
        fw[i].sent = mt_malloc((size_t)cap * sizeof(int));
        fw[i].recvd = mt_malloc((size_t)cap * sizeof(int));
        bw[i].sent = mt_malloc((size_t)cap * sizeof(int));
        bw[i].recvd = mt_malloc((size_t)cap * sizeof(int));
    }
    int *pc = mt_calloc((size_t)pp, sizeof *pc);        /* next action of each stage */
    int *posted = mt_calloc((size_t)pp, sizeof *posted); /* its transfer point is posted */
    int *index = mt_malloc((size_t)pp * 2 * sizeof *index); /* position of each posted transfer on its channel */
    for (;;) {
        bool progress = false, done = true;
        for (int st = 0; st < pp; st++) {
            const struct pipe_schedule *me = &s[st];
            while (pc[st] < me->n) {
                const struct pipe_action *a = &me->a[pc[st]];
                if (a->kind != PIPE_COMM) {
                    pc[st]++;
                    progress = true;
                    continue;
                }
                if (!posted[st]) {
                    for (int j = 0; j < a->n_xfer; j++) {
                        struct channel *ch = channel_of(fw, bw, st, a->xfer[j].kind);
                        if (is_send(a->xfer[j].kind)) {
                            index[2 * st + j] = ch->n_sent;
                            ch->sent[ch->n_sent++] = a->xfer[j].micro;
                        } else {
                            index[2 * st + j] = ch->n_recvd;
                            ch->recvd[ch->n_recvd++] = a->xfer[j].micro;
                        }
                    }
                    posted[st] = 1;
                    progress = true;
                }
                bool complete = true;
                for (int j = 0; j < a->n_xfer; j++) {
                    struct channel *ch = channel_of(fw, bw, st, a->xfer[j].kind);
                    const int at = index[2 * st + j];
                    const bool send = is_send(a->xfer[j].kind);
                    if ((send ? ch->n_recvd : ch->n_sent) <= at) {
                        complete = false;
                        continue;
                    }
                    const int other = send ? ch->recvd[at] : ch->sent[at];
                    if (other != a->xfer[j].micro)
                        FAIL("stage %d's %s of micro-batch %d meets micro-batch %d at its neighbour", st,
                             xfer_name(a->xfer[j].kind), a->xfer[j].micro, other);
                }
                if (!complete) break;
                posted[st] = 0;
                pc[st]++;
                progress = true;
            }
            if (pc[st] < me->n) done = false;
        }
        if (done) break;
        if (!progress) {
            int st = 0;
            while (pc[st] >= s[st].n) st++;
            FAIL("deadlock: stage %d waits at action %d of %d", st, pc[st], s[st].n);
        }
    }
out:
    for (int i = 0; i < pp; i++) {
        free(fw[i].sent); free(fw[i].recvd); free(bw[i].sent); free(bw[i].recvd);
    }
    free(fw); free(bw); free(pc); free(posted); free(index);
    return ok;
}

/* ---- execution --------------------------------------------------------------------------- */

/* a transfer point in flight (overlap) */
struct in_flight {
    struct comm_p2p_req req;
    struct pipe_action a;
    bool live;
};

/* Waits for every point in flight that receives into, or sends from, what the compute of `micro`
 * (kind k) touches: its input (forward) or output gradient (backward), and its slot's sends. */
static void wait_for(const struct pipe_schedule *s, struct comm *c, struct in_flight *fl, int n_fl,
                     enum pipe_action_kind k, int micro, double *waited)
{
    const enum pipe_xfer_kind needed = k == PIPE_FORWARD ? PIPE_RECV_FORWARD : PIPE_RECV_BACKWARD;
    for (int f = 0; f < n_fl; f++) {
        if (!fl[f].live) continue;
        bool hit = false;
        for (int j = 0; j < fl[f].a.n_xfer; j++) {
            const struct pipe_xfer *x = &fl[f].a.xfer[j];
            hit |= x->kind == needed && x->micro == micro;
            hit |= is_send(x->kind) && pipe_slot(s, x->micro) == pipe_slot(s, micro);
        }
        if (hit) {
            const double t0 = mt_now();
            comm_p2p_wait(c, &fl[f].req);
            *waited += mt_now() - t0;
            fl[f].live = false;
        }
    }
}

double pipe_run(const struct pipe_schedule *s, struct comm *pp_comm, const struct pipe_stage *st, bool overlap)
{
    double waited = 0;
    MT_CHECK(s->pp == 1 || (pp_comm && pp_comm->size == s->pp && pp_comm->rank == s->stage),
             "pipeline: the PP comm (rank %d of %d) does not match stage %d of %d",
             pp_comm ? pp_comm->rank : 0, pp_comm ? pp_comm->size : 1, s->stage, s->pp);
    struct comm_p2p_op ops[2 * PIPE_MAX_BUFS];
    struct in_flight *fl = overlap ? mt_calloc((size_t)MT_MAX(s->n, 1), sizeof *fl) : NULL;
    int n_fl = 0;
    for (int k = 0; k < s->n; k++) {
        const struct pipe_action *a = &s->a[k];
        if (a->kind != PIPE_COMM && overlap) wait_for(s, pp_comm, fl, n_fl, a->kind, a->micro, &waited);
        if (a->kind == PIPE_FORWARD) {
            st->forward(st->ctx, pipe_slot(s, a->micro), a->micro);
            continue;
        }
        if (a->kind == PIPE_BACKWARD) {
            st->backward(st->ctx, pipe_slot(s, a->micro), a->micro);
            continue;
        }
        int n = 0;
        for (int j = 0; j < a->n_xfer; j++) {
            const struct pipe_xfer *x = &a->xfer[j];
            const int got = st->buffers(st->ctx, x->kind, pipe_slot(s, x->micro), x->micro, ops + n);
            MT_CHECK(got >= 0 && got <= PIPE_MAX_BUFS, "pipeline: %d buffers for one transfer", got);
            const bool toward_next = x->kind == PIPE_SEND_FORWARD || x->kind == PIPE_RECV_BACKWARD;
            for (int b = n; b < n + got; b++) {
                ops[b].kind = is_send(x->kind) ? COMM_SEND : COMM_RECV;
                ops[b].peer = s->stage + (toward_next ? 1 : -1);
            }
            n += got;
        }
        if (!overlap) {
            const double t0 = mt_now();
            comm_p2p(pp_comm, ops, n);
            waited += mt_now() - t0;
            continue;
        }
        fl[n_fl].a = *a;
        fl[n_fl].live = true;
        comm_p2p_start(pp_comm, ops, n, &fl[n_fl++].req);
    }
    const double t0 = mt_now();
    for (int f = 0; f < n_fl; f++)
        if (fl[f].live) comm_p2p_wait(pp_comm, &fl[f].req);
    waited += mt_now() - t0;
    free(fl);
    return waited;
}
