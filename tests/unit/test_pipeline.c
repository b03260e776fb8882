/* The 1F1B schedule (src/pipeline.h): every stage's action list is valid and the stages together
 * never deadlock and pair the right micro-batches; the checker and the simulator catch broken
 * lists; the executor over real MPI transfers (tests/mpi/pipe_check.c) and the grouped p2p op
 * (tests/mpi/p2p_check.c). */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "config.h"
#include "pipeline.h"
#include "step_maths.h"
#include "train_pipeline.h"
#include "../test_util.h"

static void build_all(struct pipe_schedule *s, int pp, int m)
{
    for (int st = 0; st < pp; st++) pipe_schedule_1f1b(&s[st], pp, st, m);
}

static void free_all(struct pipe_schedule *s, int pp)
{
    for (int st = 0; st < pp; st++) pipe_schedule_free(&s[st]);
}

/* the most micro-batches a list keeps in flight */
static int max_in_flight(const struct pipe_schedule *s)
{
    int cur = 0, mx = 0;
    for (int k = 0; k < s->n; k++) {
        if (s->a[k].kind == PIPE_FORWARD && ++cur > mx) mx = cur;
        if (s->a[k].kind == PIPE_BACKWARD) cur--;
    }
    return mx;
}

Test(pipeline, every_schedule_valid_and_deadlock_free)
{
    char err[256];
    for (int pp = 1; pp <= 8; pp++) {
        for (int m = 1; m <= 12; m++) {
            struct pipe_schedule s[8];
            build_all(s, pp, m);
            for (int st = 0; st < pp; st++) {
                cr_assert(pipe_schedule_valid(&s[st], err, sizeof err), "pp %d m %d stage %d: %s", pp, m, st, err);
                cr_assert_eq(s[st].n_warmup, MT_MIN(pp - st - 1, m));
                /* 1F1B's memory bound is reached, not only respected */
                cr_assert_eq(max_in_flight(&s[st]), MT_MIN(pp - st, m), "pp %d m %d stage %d", pp, m, st);
            }
            cr_assert(pipe_schedules_simulate(s, pp, err, sizeof err), "pp %d m %d: %s", pp, m, err);
            free_all(s, pp);
        }
    }
}

/* The forward-only lists (validation, the global-batch aux pre-pass): each stage forwards every
 * micro-batch once in order, receives its input before and sends its output after, and the
 * stages together pair the right micro-batches without a deadlock. */
Test(pipeline, forward_only_schedules_flow_through_every_stage)
{
    char err[256];
    for (int pp = 2; pp <= 8; pp++) {
        for (int m = 1; m <= 12; m++) {
            struct pipe_schedule s[8];
            for (int st = 0; st < pp; st++) {
                pipe_schedule_forward_only(&s[st], pp, st, m);
                cr_assert_eq(s[st].n_slots, MT_MIN(pp - st, m));
                int next = 0, recvd = st == 0 ? m : 0, sent = 0;
                for (int k = 0; k < s[st].n; k++) {
                    const struct pipe_action *a = &s[st].a[k];
                    cr_assert_neq(a->kind, PIPE_BACKWARD);
                    if (a->kind == PIPE_FORWARD) {
                        cr_assert_eq(a->micro, next, "pp %d m %d stage %d", pp, m, st);
                        cr_assert(recvd > next, "pp %d m %d stage %d: forward %d before its input", pp, m, st,
                                  next);
                        next++;
                        continue;
                    }
                    for (int j = 0; j < a->n_xfer; j++) {
                        const struct pipe_xfer *x = &a->xfer[j];
                        cr_assert(x->kind == PIPE_RECV_FORWARD || x->kind == PIPE_SEND_FORWARD);
                        if (x->kind == PIPE_RECV_FORWARD) cr_assert_eq(x->micro, recvd++);
                        else cr_assert(x->micro == sent++ && x->micro < next, "sent %d before its forward",
                                       x->micro);
                    }
                }
                cr_assert_eq(next, m);
                cr_assert_eq(sent, st == pp - 1 ? 0 : m);
            }
            cr_assert(pipe_schedules_simulate(s, pp, err, sizeof err), "pp %d m %d: %s", pp, m, err);
            free_all(s, pp);
        }
    }
}

/* the textbook shape: stage 0 of 4 with 6 micro-batches */
Test(pipeline, warmup_steady_cooldown_order)
{
    struct pipe_schedule s;
    pipe_schedule_1f1b(&s, 4, 0, 6);
    char seq[64] = "";
    for (int k = 0; k < s.n; k++) {
        if (s.a[k].kind == PIPE_COMM) continue;
        char t[8];
        snprintf(t, sizeof t, "%c%d ", s.a[k].kind == PIPE_FORWARD ? 'F' : 'B', s.a[k].micro);
        strcat(seq, t);
    }
    cr_assert_str_eq(seq, "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 ");
    /* the steady state posts send_forward + recv_backward as one group */
    bool paired = false;
    for (int k = 0; k < s.n; k++)
        if (s.a[k].kind == PIPE_COMM && s.a[k].n_xfer == 2 && s.a[k].xfer[0].kind == PIPE_SEND_FORWARD &&
            s.a[k].xfer[1].kind == PIPE_RECV_BACKWARD)
            paired = true;
    cr_assert(paired);
    pipe_schedule_free(&s);
}

/* Posting the pairs as two separate points, send first (blocking sends that wait for their
 * receive, as NCCL's do), is the classic 1F1B deadlock: stage s sends forward while s + 1 sends
 * backward. The simulator must say so. */
Test(pipeline, simulator_catches_deadlock)
{
    const int pp = 3, m = 5;
    struct pipe_schedule s[3];
    build_all(s, pp, m);
    for (int st = 0; st < pp; st++) {
        struct pipe_schedule *p = &s[st];
        struct pipe_action *a = mt_malloc((size_t)(p->n * 2) * sizeof *a);
        int n = 0;
        for (int k = 0; k < p->n; k++) {
            if (p->a[k].kind == PIPE_COMM && p->a[k].n_xfer == 2) {
                a[n++] = (struct pipe_action){.kind = PIPE_COMM, .n_xfer = 1, .xfer = {p->a[k].xfer[0]}};
                a[n++] = (struct pipe_action){.kind = PIPE_COMM, .n_xfer = 1, .xfer = {p->a[k].xfer[1]}};
            } else {
                a[n++] = p->a[k];
            }
        }
        free(p->a);
        p->a = a;
        p->n = n;
    }
    char err[256] = "";
    cr_assert_not(pipe_schedules_simulate(s, pp, err, sizeof err));
    cr_assert(strstr(err, "deadlock") != NULL, "%s", err);
    free_all(s, pp);
}

/* one stage sending its micro-batches in the wrong order */
Test(pipeline, simulator_catches_wrong_pairing)
{
    struct pipe_schedule s[2];
    build_all(s, 2, 4);
    for (int k = 0; k < s[0].n; k++)
        for (int j = 0; j < s[0].a[k].n_xfer; j++)
            if (s[0].a[k].xfer[j].kind == PIPE_SEND_FORWARD) s[0].a[k].xfer[j].micro ^= 1;
    char err[256] = "";
    cr_assert_not(pipe_schedules_simulate(s, 2, err, sizeof err));
    cr_assert(strstr(err, "meets micro-batch") != NULL, "%s", err);
    free_all(s, 2);
}

Test(pipeline, checker_catches_broken_lists)
{
    char err[256] = "";
    struct pipe_schedule s;
    /* backward before forward */
    pipe_schedule_1f1b(&s, 1, 0, 2);
    struct pipe_action t = s.a[0];
    s.a[0] = s.a[1];
    s.a[1] = t;
    cr_assert_not(pipe_schedule_valid(&s, err, sizeof err));
    cr_assert(strstr(err, "backwarded before its forward") != NULL, "%s", err);
    pipe_schedule_free(&s);
    /* forward before the input arrived */
    pipe_schedule_1f1b(&s, 3, 1, 4);
    cr_assert_eq(s.a[0].kind, PIPE_COMM);
    s.a[0].xfer[0].micro = 3;
    cr_assert_not(pipe_schedule_valid(&s, err, sizeof err));
    cr_assert(strstr(err, "before its input arrived") != NULL, "%s", err);
    pipe_schedule_free(&s);
    /* too many in flight: slots shrunk below pp - stage */
    pipe_schedule_1f1b(&s, 4, 0, 8);
    s.n_slots = 3;
    cr_assert_not(pipe_schedule_valid(&s, err, sizeof err));
    cr_assert(strstr(err, "slot") != NULL, "%s", err);
    pipe_schedule_free(&s);
    /* the first stage may not receive forward */
    pipe_schedule_1f1b(&s, 2, 0, 2);
    for (int k = 0; k < s.n; k++)
        if (s.a[k].kind == PIPE_COMM) {
            s.a[k].xfer[0].kind = PIPE_RECV_FORWARD;
            break;
        }
    cr_assert_not(pipe_schedule_valid(&s, err, sizeof err));
    pipe_schedule_free(&s);
}

/* ---- under mpirun ---- */

static void expect_mpi_ok(const char *prog, int np, const char *args)
{
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "timeout 120 %s -np %d %s/tests/mpi/%s %s", tu_mpirun(), np, tu_build(), prog, args);
    int rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 0, "%s exited %d:\n%s", cmd, rc, out);
    free(out);
}

Test(pipeline_mpi, p2p_ring, .timeout = 180) { expect_mpi_ok("p2p_check", 3, "0"); }
Test(pipeline_mpi, p2p_two_ranks_split_in_pieces, .timeout = 180) { expect_mpi_ok("p2p_check", 2, "7"); }
Test(pipeline_mpi, p2p_start_wait_two_groups_in_flight, .timeout = 180) { expect_mpi_ok("p2p_check", 3, "5 1"); }
Test(pipeline_mpi, executor_pp2, .timeout = 180) { expect_mpi_ok("pipe_check", 2, "5"); }
Test(pipeline_mpi, executor_pp4_fewer_micro_than_stages, .timeout = 180) { expect_mpi_ok("pipe_check", 4, "3"); }
Test(pipeline_mpi, executor_pp4, .timeout = 180) { expect_mpi_ok("pipe_check", 4, "9"); }
Test(pipeline_mpi, executor_pp4_overlapped, .timeout = 180) { expect_mpi_ok("pipe_check", 4, "9 1"); }
Test(pipeline_mpi, executor_pp3_overlapped_few_micro, .timeout = 180) { expect_mpi_ok("pipe_check", 3, "2 1"); }

/* ---- the pooled router statistics that ride with the activations ---- */

/* Pooling layer by layer across stage boundaries gives aux_from_stats' number bit for bit,
 * whatever the split, with dense layers in between. */
Test(pipeline, pooled_aux_equals_the_single_stage_statistic)
{
    struct config c;
    config_defaults(&c);
    struct model_config *mc = &c.model;
    mc->num_hidden_layers = 7;
    mc->num_experts = 5;
    mc->n_mlp_only_layers = 2;
    mc->mlp_only_layers[0] = 0;
    mc->mlp_only_layers[1] = 4;
    const int L = 7, E = 5, n_moe = 5;
    const int64_t tokens = 96;
    float stats[7 * 2 * 5];
    mt_rng r;
    mt_rng_seed(&r, 3);
    for (int j = 0; j < L * 2 * E; j++) stats[j] = (float)(mt_rng_uniform(&r) * 40);
    double want, cnt[5];
    aux_from_stats(stats, L, mc, tokens, &want, cnt);
    const int splits[][4] = {{0, 7, 7, 7}, {0, 3, 7, 7}, {0, 1, 2, 7}, {0, 5, 6, 7}};
    for (size_t k = 0; k < sizeof splits / sizeof splits[0]; k++) {
        double ps[5] = {0}, ct[5] = {0};
        for (int s = 0; s < 3; s++) {
            const int l0 = splits[k][s], l1 = splits[k][s + 1];
            pipe_pool_stats(mc, stats + (size_t)l0 * 2 * E, l0, l1, ps, ct);
        }
        const double got = pipe_aux_pooled(ps, ct, E, n_moe, tokens);
        cr_assert(memcmp(&got, &want, sizeof got) == 0, "split %zu: %.17g vs %.17g", k, got, want);
        cr_assert(memcmp(ct, cnt, sizeof cnt) == 0, "split %zu: counts differ", k);
    }
}
