/* mpirun -np PP pipe_check N_MICRO [OVERLAP]
 *
 * Runs the 1F1B executor (src/pipeline.h) over real MPI point-to-point transfers, one stage per
 * rank, on a toy pipeline: stage s maps a vector x[D] to y = a_s·x + c·x², the first stage's input
 * is a function of the micro-batch, and the last stage's loss is Σ y. Each stage keeps x in its
 * activation slot for the backward (dx = dy·(a_s + 2c·x), da_s += Σ dy·x), so a slot reused too
 * early or a transfer of the wrong micro-batch changes the numbers. Every transfer also carries
 * the micro-batch index as a second buffer, checked on arrival. Every rank recomputes the whole
 * chain serially and compares its stage's da_s (and, on the last stage, each loss) exactly.
 * OVERLAP 1 runs the executor with transfers started and waited for late (comm_p2p_start/wait).
 * Exit 0 when all match; otherwise the failing rank prints why and all exit 1. */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "comm.h"
#include "common.h"
#include "pipeline.h"

#define D 33
#define C 0.01

struct toy {
    int stage, pp, n_micro, bad;
    double a;
    double *x, *y, *dy, *dx;     /* [n_slots][D] each */
    int64_t *tag_in, *tag_out;   /* [n_slots] micro index riding with the data */
    double da, *loss;            /* loss[n_micro] on the last stage */
};

static double a_of(int s) { return 0.9 + 0.05 * s; }
static double input_of(int micro, int j) { return sin(1.0 + micro * 0.37 + j * 0.11); }

static void fwd(void *ctx, int slot, int micro)
{
    struct toy *t = ctx;
    double *x = t->x + slot * D, *y = t->y + slot * D;
    if (t->stage == 0) {
        for (int j = 0; j < D; j++) x[j] = input_of(micro, j);
    } else if (t->tag_in[slot] != micro && !t->bad++) {
        fprintf(stderr, "pipe_check: stage %d: forward of %d found the input of %lld\n", t->stage, micro, (long long)t->tag_in[slot]);
    }
    for (int j = 0; j < D; j++) y[j] = t->a * x[j] + C * x[j] * x[j];
    t->tag_out[slot] = micro;
    if (t->stage == t->pp - 1) {
        double l = 0;
        for (int j = 0; j < D; j++) l += y[j];
        t->loss[micro] = l;
    }
}

static void bwd(void *ctx, int slot, int micro)
{
    struct toy *t = ctx;
    double *x = t->x + slot * D, *dy = t->dy + slot * D, *dx = t->dx + slot * D;
    if (t->stage == t->pp - 1) {
        for (int j = 0; j < D; j++) dy[j] = 1;
    } else if (t->tag_in[slot] != micro && !t->bad++) {
        fprintf(stderr, "pipe_check: stage %d: backward of %d found the gradient of %lld\n", t->stage, micro, (long long)t->tag_in[slot]);
    }
    for (int j = 0; j < D; j++) {
        t->da += dy[j] * x[j];
        dx[j] = dy[j] * (t->a + 2 * C * x[j]);
    }
    t->tag_out[slot] = micro;
}

static int bufs(void *ctx, enum pipe_xfer_kind k, int slot, int micro, struct comm_p2p_op *ops)
{
    struct toy *t = ctx;
    double *data = k == PIPE_RECV_FORWARD ? t->x : k == PIPE_SEND_FORWARD ? t->y : k == PIPE_RECV_BACKWARD ? t->dy : t->dx;
    int64_t *tag = k == PIPE_RECV_FORWARD || k == PIPE_RECV_BACKWARD ? t->tag_in : t->tag_out;
    ops[0] = (struct comm_p2p_op){.buf = data + slot * D, .count = D, .dtype = COMM_F64};
    ops[1] = (struct comm_p2p_op){.buf = tag + slot, .count = 1, .dtype = COMM_I64};
    return 2;
}

int main(int argc, char **argv)
{
    MT_CHECK_MPI(MPI_Init(&argc, &argv));
    struct comm *pp = comm_mpi_create(MPI_COMM_WORLD);
    struct toy t = {.stage = pp->rank, .pp = pp->size, .n_micro = argc > 1 ? atoi(argv[1]) : 4};
    t.a = a_of(t.stage);
    struct pipe_schedule s;
    pipe_schedule_1f1b(&s, t.pp, t.stage, t.n_micro);
    const size_t n = (size_t)s.n_slots * D;
    t.x = mt_calloc(n, sizeof(double)); t.y = mt_calloc(n, sizeof(double));
    t.dy = mt_calloc(n, sizeof(double)); t.dx = mt_calloc(n, sizeof(double));
    t.tag_in = mt_calloc((size_t)s.n_slots, sizeof(int64_t));
    t.tag_out = mt_calloc((size_t)s.n_slots, sizeof(int64_t));
    t.loss = mt_calloc((size_t)t.n_micro, sizeof(double));
    struct pipe_stage st = {.ctx = &t, .forward = fwd, .backward = bwd, .buffers = bufs};
    pipe_run(&s, t.pp > 1 ? pp : NULL, &st, argc > 2 && atoi(argv[2]) != 0);

    /* the same chain, serially, the same operations in the same order per element */
    double da_ref = 0, x[D], xs[64][D];
    for (int i = 0; i < t.n_micro; i++) {
        for (int j = 0; j < D; j++) x[j] = input_of(i, j);
        for (int q = 0; q < t.pp; q++) {
            for (int j = 0; j < D; j++) {
                xs[q][j] = x[j];
                x[j] = a_of(q) * x[j] + C * x[j] * x[j];
            }
        }
        double l = 0, dy[D];
        for (int j = 0; j < D; j++) l += x[j];
        if (t.stage == t.pp - 1 && l != t.loss[i] && !t.bad++)
            fprintf(stderr, "pipe_check: micro-batch %d loss %.17g, serial %.17g\n", i, t.loss[i], l);
        for (int j = 0; j < D; j++) dy[j] = 1;
        for (int q = t.pp - 1; q >= 0; q--) {
            for (int j = 0; j < D; j++) {
                if (q == t.stage) da_ref += dy[j] * xs[q][j];
                dy[j] = dy[j] * (a_of(q) + 2 * C * xs[q][j]);
            }
        }
    }
    if (da_ref != t.da && !t.bad++)
        fprintf(stderr, "pipe_check: stage %d da %.17g, serial %.17g\n", t.stage, t.da, da_ref);
    int any = t.bad > 0, all = 0;
    MT_CHECK_MPI(MPI_Allreduce(&any, &all, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    pipe_schedule_free(&s);
    free(t.x); free(t.y); free(t.dy); free(t.dx); free(t.tag_in); free(t.tag_out); free(t.loss);
    comm_free(pp);
    MT_CHECK_MPI(MPI_Finalize());
    return all ? 1 : 0;
}
