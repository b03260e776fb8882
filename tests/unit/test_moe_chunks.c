/* The chunked, overlapped MoE exchange (parallel.moe_chunks, src/moe_exchange.c), its loopback
 * (MT_MOE_LOOPBACK) and timeline (MT_MOE_TIMELINE), and the asynchronous all-to-all under it
 * (comm_all_to_all_v_start):
 *  - the layer against the one-chunk path on chosen routings (tests/mpi/chunks_check.c): output,
 *    input and routing-weight gradients bit-identical, expert weight gradients to rounding;
 *  - whole training runs: the same losses with 1, 2 or 3 chunks on EP = 1, EP = 2,
 *    EP = 2 x EP_FSDP = 2, PP = 2 x EP = 2, with recompute, and with the loopback at EP = 1;
 *  - the timeline's report;
 *  - the fixed exchange (parallel.moe_fixed_exchange): every bit of the counted one, and the
 *    re-run of a step whose layer outgrew its rows. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../test_util.h"
#include "comm.h"

static void expect_chunks_check(int np, const char *args)
{
    char cmd[1024], *out = NULL, kase[32];
    snprintf(cmd, sizeof cmd, "timeout 120 %s -np %d %s/tests/mpi/chunks_check %s", tu_mpirun(), np,
             tu_build(), args);
    int rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 0, "chunks_check %s on %d rank(s) exited %d:\n%s", args, np, rc, out);
    sscanf(args, "%31s", kase);
    char want[128];
    snprintf(want, sizeof want, "chunks_check %s: ok on %d rank(s)", kase, np);
    cr_expect(out && strstr(out, want), "no '%s' in:\n%s", want, out ? out : "");
    free(out);
}

/* hashed top-2: chunks 2 and 3 on 1, 2 and 4 EP ranks (7 + 4·rank tokens: uneven chunks) */
Test(moe_chunks, layer_spread_matches_one_chunk, .timeout = 400)
{
    expect_chunks_check(1, "spread 3");
    expect_chunks_check(2, "spread 2");
    expect_chunks_check(4, "spread 3");
}

/* half of each rank's tokens to the last rank: chunks whose pairs all go to one rank (zero counts
 * to the others), and in the next round the other half */
Test(moe_chunks, layer_chunk_to_one_rank_matches_one_chunk, .timeout = 400)
{
    expect_chunks_check(2, "skew 2");
    expect_chunks_check(2, "skew 3");
    expect_chunks_check(4, "skew 2");
}

/* every token to every expert: a pair with several experts on its rank */
Test(moe_chunks, layer_top_k_equals_experts_matches_one_chunk, .timeout = 400)
{
    expect_chunks_check(2, "topE 3");
}

/* MT_MOE_LOOPBACK on one rank: the pair path and an exchange with itself, chunked or not */
Test(moe_chunks, layer_loopback_matches_the_direct_path, .timeout = 400)
{
    expect_chunks_check(1, "skew 1 loopback");
    expect_chunks_check(1, "spread 3 loopback");
}

/* the check can fail: one output value of the chunked run moved by one ulp must be reported */
Test(moe_chunks, an_altered_output_is_reported, .timeout = 200)
{
    char cmd[512], *out = NULL;
    snprintf(cmd, sizeof cmd, "timeout 60 %s -np 2 %s/tests/mpi/chunks_check spread 2 corrupt", tu_mpirun(),
             tu_build());
    cr_expect_eq(tu_run(cmd, &out), 1, "%s", out);
    cr_expect(out && strstr(out, "chunks_check spread: rank 1 of 2: round 0: out["), "%s", out ? out : "");
    free(out);
}

/* The MPI comm's all_to_all_v_start: MPI_Ialltoallv, two in flight (comm_split_check, which also
 * runs every other collective; tests/unit/test_reliability.c runs it on the split path). */
Test(moe_chunks, mpi_all_to_all_v_start_two_in_flight, .timeout = 200)
{
    for (int np = 1; np <= 3; np++) {
        char cmd[512], *out = NULL;
        snprintf(cmd, sizeof cmd, "timeout 100 %s -np %d %s/tests/mpi/comm_split_check 20", tu_mpirun(), np,
                 tu_build());
        cr_expect_eq(tu_run(cmd, &out), 0, "%s", out);
        cr_expect(out && strstr(out, "0 problems"), "%s", out ? out : "");
        free(out);
    }
}

/* A NULL comm (a group of one in host memory) copies at once and leaves nothing in flight. */
Test(moe_chunks, null_comm_all_to_all_v_start_copies_at_once)
{
    float send[5] = {1, 2, 3, 4, 5}, recv[5] = {0};
    int64_t n[1] = {5};
    struct comm_p2p_req r = {(void *)1};
    comm_all_to_all_v_start(NULL, recv, n, send, n, COMM_F32, &r);
    cr_expect_null(r.state);
    cr_expect_eq(memcmp(recv, send, sizeof send), 0);
    comm_p2p_wait(NULL, &r);
}

/* ---- whole runs ---------------------------------------------------------------------------- */

#define STEPS 4

/* Trains tiny.yaml for STEPS steps on np ranks (np 1: no mpirun) with `extra`; fills loss[] and
 * grad_norm[]; returns the run's output. */
static char *train(int np, const char *env, const char *extra, const char *tag, double *loss, double *gnorm)
{
    char cmd[2048], metrics[256], *out = NULL;
    snprintf(metrics, sizeof metrics, "/tmp/mt_chunks_%s_%d.jsonl", tag, (int)getpid());
    unlink(metrics);
    char launch[256];
    if (np > 1) snprintf(launch, sizeof launch, "timeout 240 %s -np %d", tu_mpirun(), np);
    else snprintf(launch, sizeof launch, "timeout 240");
    snprintf(cmd, sizeof cmd, "%s %s %s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=%d "
             "--set train.global_batch_size=8 --set train.micro_batch_size=%d --set log.metrics=%s %s",
             env, launch, tu_build(), STEPS, 8 / np, metrics, extra);
    int rc = tu_run(cmd, &out);
    cr_assert_eq(rc, 0, "run %s failed:\n%s", tag, out);
    cr_assert_eq(tu_read_losses(metrics, loss, STEPS), STEPS, "%s", out);
    cr_assert_eq(tu_read_metric(metrics, "grad_norm", gnorm, STEPS), STEPS, "%s", out);
    unlink(metrics);
    return out;
}

/* Step 1's loss is the forward of identical weights: identical; later steps follow updates whose
 * expert gradients were summed chunk by chunk (rounding), so 1e-6 relative. */
static void expect_same_run(const char *what, const double *a, const double *ga, const double *b, const double *gb)
{
    cr_expect_eq(a[0], b[0], "%s: step 1 loss %.9g vs %.9g", what, a[0], b[0]);
    for (int s = 0; s < STEPS; s++) {
        cr_expect(fabs(a[s] - b[s]) <= 1e-6 * fabs(b[s]), "%s: step %d loss %.9g vs %.9g", what, s + 1, a[s], b[s]);
        cr_expect(fabs(ga[s] - gb[s]) <= 1e-5 * fabs(gb[s]), "%s: step %d grad_norm %.9g vs %.9g", what, s + 1,
                  ga[s], gb[s]);
    }
}

static void chunks_vs_one(int np, const char *mesh, const char *env, const int *chunks, int n, const char *tag)
{
    double l1[STEPS], g1[STEPS], l[STEPS], g[STEPS];
    char extra[512], t[64];
    snprintf(extra, sizeof extra, "%s --set parallel.moe_chunks=1", mesh);
    snprintf(t, sizeof t, "%s_1", tag);
    free(train(np, "", extra, t, l1, g1));
    for (int i = 0; i < n; i++) {
        snprintf(extra, sizeof extra, "%s --set parallel.moe_chunks=%d", mesh, chunks[i]);
        snprintf(t, sizeof t, "%s_%d", tag, chunks[i]);
        free(train(np, env, extra, t, l, g));
        char what[128];
        snprintf(what, sizeof what, "%s, %d chunks%s", tag, chunks[i], *env ? " (loopback)" : "");
        expect_same_run(what, l, g, l1, g1);
    }
}

/* 8 sequences of 64 tokens per micro-batch on one rank: 2 and 3 chunks (3 does not divide 512) */
Test(moe_chunks, train_ep1_losses_match_one_chunk, .timeout = 300)
{
    chunks_vs_one(1, "", "", (const int[]){2, 3}, 2, "ep1");
}

Test(moe_chunks, train_ep2_losses_match_one_chunk, .timeout = 300)
{
    chunks_vs_one(2, "--set parallel.expert_parallel_size=2", "", (const int[]){3}, 1, "ep2");
}

/* EP = 2 x EP_FSDP = 2 on 4 ranks (the experts' rows sharded over the FSDP pair too) */
Test(moe_chunks, train_ep2_fsdp2_losses_match_one_chunk, .timeout = 300)
{
    chunks_vs_one(4, "--set parallel.expert_parallel_size=2", "", (const int[]){2}, 1, "ep2f2");
}

/* the loopback at EP = 1 (pairs, a self all-to-all), with 1 and 2 chunks, against the plain path */
Test(moe_chunks, train_loopback_losses_match_the_direct_path, .timeout = 300)
{
    chunks_vs_one(1, "", "MT_MOE_LOOPBACK=1", (const int[]){1, 2}, 2, "loop");
}

/* two pipeline stages of EP = 2: each micro-batch slot keeps its own chunk plans from its forward
 * to its backward (1F1B runs other slots in between) */
Test(moe_chunks, train_pp2_ep2_losses_match_one_chunk, .timeout = 300)
{
    chunks_vs_one(4, "--set parallel.pipeline_parallel_size=2 --set parallel.expert_parallel_size=2", "",
                  (const int[]){2}, 1, "pp2");
}

/* activation checkpointing recomputes the forward (and its chunk plans) inside the backward */
Test(moe_chunks, train_recompute_losses_match_one_chunk, .timeout = 300)
{
    chunks_vs_one(2, "--set parallel.expert_parallel_size=2 --set train.activation_checkpointing=true", "",
                  (const int[]){2}, 1, "ac");
}

/* MT_MOE_TIMELINE=1 prints every chunk's GEMMs and transfers of both passes, and the summary */
Test(moe_chunks, timeline_lists_every_chunk, .timeout = 200)
{
    double l[STEPS], g[STEPS];
    char *out = train(1, "MT_MOE_TIMELINE=1 MT_MOE_LOOPBACK=1", "--set parallel.moe_chunks=3", "tl", l, g);
    const char *want[] = {"moe timeline: layer 0 forward", "moe timeline: layer 0 backward",
                          "moe timeline: forward: transfers", "moe timeline: backward: transfers",
                          "(host clock: a transfer spans its start call to its wait"};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        cr_expect(strstr(out, want[i]), "no '%s' in:\n%s", want[i], out);
    /* each chunk: its GEMMs (forward and backward) and its dispatch and combine both ways */
    const char *spans[] = {"compute gemms ", "compute gemms_bwd", "comm    dispatch ", "comm    combine ",
                           "comm    dispatch_bwd", "comm    combine_bwd", "comm    weights_bwd"};
    for (int c = 0; c < 3; c++)
        for (size_t i = 0; i < sizeof spans / sizeof *spans; i++) {
            char line[96];
            snprintf(line, sizeof line, "moe timeline:   %5d %s", c, spans[i]);
            cr_expect(strstr(out, line), "no '%s' in:\n%s", line, out);
        }
    free(out);
    /* without it, nothing */
    out = train(1, "MT_MOE_LOOPBACK=1", "--set parallel.moe_chunks=3", "tl0", l, g);
    cr_expect_null(strstr(out, "moe timeline"), "%s", out);
    free(out);
}

/* the switches take 0 or 1; anything else stops the run at start-up with one line naming it; the
 * timeline with one chunk says it recorded nothing */
Test(moe_chunks, bad_switch_values_are_refused, .timeout = 120)
{
    const char *vars[] = {"MT_MOE_LOOPBACK=yes", "MT_MOE_TIMELINE=2"};
    for (int i = 0; i < 2; i++) {
        char cmd[1024], *out = NULL, want[96];
        snprintf(cmd, sizeof cmd, "%s timeout 60 %s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=1",
                 vars[i], tu_build());
        cr_expect_neq(tu_run(cmd, &out), 0, "%s", out);
        snprintf(want, sizeof want, "environment variable %s: expected 0 or 1", vars[i]);
        cr_expect(out && strstr(out, want), "no '%s' in:\n%s", want, out ? out : "");
        cr_expect(out && !strstr(out, "step 1"), "the run went on:\n%s", out ? out : "");
        free(out);
    }
    double l[STEPS], g[STEPS];
    char *out = train(1, "MT_MOE_TIMELINE=1", "", "tl1", l, g);
    cr_expect(strstr(out, "moe timeline: nothing recorded"), "%s", out);
    free(out);
}

/* The o_proj and q_proj weight gradients held back under the next MoE layer's backward exchanges
 * (model_enable_deferred_wgrads) are the same GEMMs on the same inputs, later: the run keeps every
 * printed digit against MT_NO_DEFERRED_WGRAD=1. EP = 2, reduce_grads=step and 2 micro-steps (the
 * deferral needs a later backward in the step); the startup line must say it was on. A dropped
 * deferred gradient changes step 1's grad_norm (checked by hand when this test was written). */
static void deferred_vs_in_place(int chunks)
{
    double l_on[STEPS], g_on[STEPS], l_off[STEPS], g_off[STEPS];
    char mesh[256], tag[32];
    snprintf(mesh, sizeof mesh, "--set parallel.expert_parallel_size=2 --set parallel.reduce_grads=step "
             "--set train.micro_batch_size=2 --set parallel.moe_chunks=%d", chunks);
    snprintf(tag, sizeof tag, "defer_on_%d", chunks);
    char *out = train(2, "", mesh, tag, l_on, g_on);
    cr_expect(strstr(out, "q_proj weight gradients deferred") != NULL, "deferral not on:\n%s", out);
    free(out);
    snprintf(tag, sizeof tag, "defer_off_%d", chunks);
    out = train(2, "MT_NO_DEFERRED_WGRAD=1", mesh, tag, l_off, g_off);
    cr_expect(strstr(out, "weight gradients deferred") == NULL, "MT_NO_DEFERRED_WGRAD=1 left it on:\n%s", out);
    free(out);
    for (int s = 0; s < STEPS; s++) {
        cr_expect_eq(l_on[s], l_off[s], "%d chunk(s): step %d loss %.9g vs %.9g", chunks, s + 1, l_on[s], l_off[s]);
        cr_expect_eq(g_on[s], g_off[s], "%d chunk(s): step %d grad_norm %.9g vs %.9g", chunks, s + 1, g_on[s],
                     g_off[s]);
    }
}

/* ... with one exchange a layer (moe.c) and in chunks (moe_exchange.c) */
Test(moe_chunks, train_deferred_wgrads_change_no_bit, .timeout = 300)
{
    deferred_vs_in_place(1);
    deferred_vs_in_place(2);
}

/* Expert wgrad jobs (src/moe_wgrad_jobs.c, parallel.expert_wgrad_jobs): a pair's grouped weight gradients
 * queued at its second backward, run in parts at later exchange waits (on the CPU backend
 * MT_CPU_WGRAD_PART_EXPERTS experts a part: none, one, all) and finished at the layer's next
 * backward keep every bit of the grouped GEMM in place. EP = 2, 6 micro-steps: pairs queued as
 * jobs by micro-steps 2 and 4, each finished in the next backward; the last pair in place. */
Test(moe_chunks, train_wgrad_jobs_change_no_bit, .timeout = 400)
{
    double l_off[STEPS], g_off[STEPS], l[STEPS], g[STEPS];
    const char *mesh = "--set parallel.expert_parallel_size=2 --set parallel.reduce_grads=step "
                       "--set train.micro_batch_size=1 --set train.global_batch_size=12 "
                       "--set parallel.expert_wgrad_pairs=true";
    char *out = train(2, "", mesh, "jobs_off", l_off, g_off);
    cr_expect(strstr(out, "as jobs") == NULL, "jobs on by default:\n%s", out);
    free(out);
    char on[512];
    snprintf(on, sizeof on, "%s --set parallel.expert_wgrad_jobs=true", mesh);
    const char *parts[] = {"0", "1", "1000"};
    for (int i = 0; i < 3; i++) {
        char env[96], tag[32];
        snprintf(env, sizeof env, "MT_CPU_WGRAD_PART_EXPERTS=%s", parts[i]);
        snprintf(tag, sizeof tag, "jobs_%s", parts[i]);
        out = train(2, env, on, tag, l, g);
        cr_expect(strstr(out, "weight gradients wait as jobs") != NULL, "jobs not on:\n%s", out);
        free(out);
        for (int s = 0; s < STEPS; s++) {
            cr_expect_eq(l[s], l_off[s], "%s: step %d loss %.9g vs %.9g", env, s + 1, l[s], l_off[s]);
            cr_expect_eq(g[s], g_off[s], "%s: step %d grad_norm %.9g vs %.9g", env, s + 1, g[s], g_off[s]);
        }
    }
    /* where pairs resolve off (auto on the CPU backend) the key says it does nothing */
    out = train(2, "", "--set parallel.expert_parallel_size=2 --set parallel.expert_wgrad_jobs=true", "jobs_nop", l, g);
    cr_expect(strstr(out, "parallel.expert_wgrad_jobs: no effect") != NULL, "no warning:\n%s", out);
    cr_expect(strstr(out, "as jobs") == NULL, "jobs on without pairs:\n%s", out);
    free(out);
}

/* where each layer's gradient is reduce-scattered right after its backward (reduce_grads=
 * micro_step), a deferred gradient would miss its reduction: the deferral stays off */
Test(moe_chunks, no_deferred_wgrads_with_per_micro_step_reduction, .timeout = 120)
{
    double l[STEPS], g[STEPS];
    char *out = train(2, "", "--set parallel.expert_parallel_size=2 --set parallel.reduce_grads=micro_step "
                      "--set train.micro_batch_size=2", "defer_micro", l, g);
    cr_expect(strstr(out, "gradients reduce-scattered every micro-step") != NULL, "%s", out);
    cr_expect(strstr(out, "weight gradients deferred") == NULL, "deferred with per-micro-step reduction:\n%s", out);
    free(out);
}

/* calls a step of the profile table's `download` row in a run's output (-1: no such row) */
static int download_calls(const char *out)
{
    const char *p = strstr(out, "\n    download ");
    int calls = -1;
    if (p && sscanf(p, " download %*d %d", &calls) != 1) calls = -1;
    return calls;
}

/* Issue 18's "no host synchronisation in the step except the metrics": with EP = 2 a step
 * downloads no more than on one rank (the metrics) but for the fixed exchange's one capacity check
 * (model_fixed_exchange_overflow, read with them). With the counted exchange (moe_fixed_exchange
 * false, or in chunks) the expert-row count comes with the pair counts instead of being read back
 * from each MoE layer's route plan, but the pair counts themselves cross on the host (moe_pair_plan
 * waits); the fixed exchange's route plans wait for nothing (ops.h moe_pair_plan with a block). */
Test(moe_chunks, ep2_step_downloads_only_what_one_rank_does, .timeout = 200)
{
    double l[STEPS], g[STEPS];
    char *one = train(1, "", "--set log.profile=true --set train.micro_batch_size=4", "dl1", l, g);
    const int base = download_calls(one);
    cr_assert_gt(base, 0, "no download row in the profile:\n%s", one);
    free(one);
    const char *ways[] = {"--set parallel.moe_chunks=1 --set parallel.moe_fixed_exchange=false",
                          "--set parallel.moe_chunks=2", "--set parallel.moe_chunks=1"};
    for (int i = 0; i < 3; i++) {
        char extra[256], tag[16];
        snprintf(extra, sizeof extra, "--set parallel.expert_parallel_size=2 --set train.micro_batch_size=2 "
                 "--set log.profile=true %s", ways[i]);
        snprintf(tag, sizeof tag, "dl2_%d", i);
        char *out = train(2, "", extra, tag, l, g);
        const int want = base + (i == 2);
        cr_expect_eq(download_calls(out), want, "EP=2, %s: %d downloads a step against %d expected:\n%s",
                     ways[i], download_calls(out), want, out);
        free(out);
    }
}

/* ---- the fixed exchange (parallel.moe_fixed_exchange, model.h fixed_exchange) -------------------
 * Blocks of T pairs with padding and expert rows held to a capacity change no sum and no order, so
 * a run keeps every bit against the counted exchange; a step whose layer outgrew the capacity runs
 * again (same batch, bigger buffers) and ends with the same bits too. */
static void fixed_vs_counted(int np, const char *mesh, const char *env, const char *tag, int want_reruns)
{
    double lf[STEPS], gf[STEPS], lc[STEPS], gc[STEPS];
    char extra[512], t[64];
    snprintf(extra, sizeof extra, "%s --set parallel.moe_fixed_exchange=false", mesh);
    snprintf(t, sizeof t, "%s_counted", tag);
    free(train(np, "", extra, t, lc, gc));
    snprintf(extra, sizeof extra, "%s --set parallel.moe_fixed_exchange=true", mesh);
    snprintf(t, sizeof t, "%s_fixed", tag);
    char *out = train(np, env, extra, t, lf, gf);
    int reruns = 0, lines = 0;
    for (const char *p = out; (p = strstr(p, "running the step again")) != NULL; p++) reruns++;
    for (const char *p = out; (p = strstr(p, " | ran 2x")) != NULL; p++) lines++;
    cr_expect_eq(reruns, want_reruns, "%s: %d re-run steps, expected %d:\n%s", tag, reruns, want_reruns, out);
    cr_expect_eq(lines, want_reruns, "%s: %d step lines say 'ran 2x', expected %d:\n%s", tag, lines, want_reruns, out);
    free(out);
    for (int s = 0; s < STEPS; s++) {
        cr_expect_eq(lf[s], lc[s], "%s: step %d loss %.9g vs %.9g", tag, s + 1, lf[s], lc[s]);
        cr_expect_eq(gf[s], gc[s], "%s: step %d grad_norm %.9g vs %.9g", tag, s + 1, gf[s], gc[s]);
    }
}

Test(moe_fixed, train_ep2_keeps_every_bit, .timeout = 300)
{
    fixed_vs_counted(2, "--set parallel.expert_parallel_size=2", "", "fx_ep2", 0);
}

/* EP = 2 x EP_FSDP = 2 on 4 ranks, EP = 4 (more ranks than top-2 choices: blocks of T pairs
 * outnumber the expert rows), and recompute (the backward re-plans each layer) */
Test(moe_fixed, train_ep2_fsdp2_ep4_and_recompute_keep_every_bit, .timeout = 400)
{
    fixed_vs_counted(4, "--set parallel.expert_parallel_size=2", "", "fx_f2", 0);
    fixed_vs_counted(4, "--set parallel.expert_parallel_size=4", "", "fx_ep4", 0);
    fixed_vs_counted(2, "--set parallel.expert_parallel_size=2 --set train.activation_checkpointing=true", "",
                     "fx_ac", 0);
}

/* the loopback at EP = 1 (pairs and a self exchange): the one-GPU path the bench can time */
Test(moe_fixed, train_loopback_keeps_every_bit, .timeout = 300)
{
    fixed_vs_counted(1, "", "MT_MOE_LOOPBACK=1", "fx_loop", 0);
}

/* expert rows held to 0.3x the mean: step 1 outgrows them on some rank, every rank runs it again
 * with room, and no later step needs more (the same routing within 25%); also with EP_FSDP = 2
 * reducing every micro-step (the re-run waits for the reduce-scatters in flight first) */
Test(moe_fixed, an_outgrown_capacity_runs_the_step_again, .timeout = 400)
{
    fixed_vs_counted(2, "--set parallel.expert_parallel_size=2", "MT_MOE_ROW_CAPACITY=0.3", "fx_over", 1);
    fixed_vs_counted(4, "--set parallel.expert_parallel_size=2 --set parallel.reduce_grads=micro_step "
                        "--set parallel.reshard_after_forward=true", "MT_MOE_ROW_CAPACITY=0.3", "fx_over_f2", 1);
}

/* the same re-run with the expert wgrad in groups of 4 (auto's choice with EP on a GPU since the
 * fifty-fourth session): the three micro-steps a group parks in the outgrown step are dropped with
 * it, and the re-run and the counted exchange give the same bits */
Test(moe_fixed, an_outgrown_capacity_with_wgrad_groups_runs_the_step_again, .timeout = 300)
{
    fixed_vs_counted(2, "--set parallel.expert_parallel_size=2 --set parallel.expert_wgrad_pairs=true "
                        "--set parallel.expert_wgrad_group=4", "MT_MOE_ROW_CAPACITY=0.3", "fx_over_g4", 1);
}

/* parallel.moe_combine_self_last (moe.c, on by default): the down projection of the other ranks'
 * rows first, their pair sums sent while this rank's own rows run, written straight into the
 * inbox's block to self. Every row and pair sum is the one-piece path's: every bit the same, with
 * the fixed and the counted exchange, at EP = 4 (ranks 1 and 2 have rows from ranks before and
 * after them), with recompute, through a capacity re-run and in the loopback at EP = 1. */
static void self_last_vs_off(int np, const char *mesh, const char *env, const char *tag)
{
    double l_on[STEPS], g_on[STEPS], l_off[STEPS], g_off[STEPS];
    char extra[512], t[64];
    const char *line = "forward combine: the other ranks' rows through the down projection first";
    snprintf(t, sizeof t, "%s_self_last", tag);
    char *out = train(np, env, mesh, t, l_on, g_on);
    cr_expect(strstr(out, line) != NULL, "%s: the start-up does not say the combine runs self last:\n%s", tag, out);
    free(out);
    snprintf(extra, sizeof extra, "%s --set parallel.moe_combine_self_last=false", mesh);
    snprintf(t, sizeof t, "%s_one_piece", tag);
    out = train(np, env, extra, t, l_off, g_off);
    cr_expect(strstr(out, line) == NULL, "%s: the start-up says self last with the key false:\n%s", tag, out);
    free(out);
    for (int s = 0; s < STEPS; s++) {
        cr_expect_eq(l_on[s], l_off[s], "%s: step %d loss %.9g vs %.9g", tag, s + 1, l_on[s], l_off[s]);
        cr_expect_eq(g_on[s], g_off[s], "%s: step %d grad_norm %.9g vs %.9g", tag, s + 1, g_on[s], g_off[s]);
    }
}

Test(moe_fixed, combine_self_last_keeps_every_bit, .timeout = 600)
{
    self_last_vs_off(2, "--set parallel.expert_parallel_size=2", "", "sl_ep2");
    self_last_vs_off(2, "--set parallel.expert_parallel_size=2 --set parallel.moe_fixed_exchange=false", "",
                     "sl_counted");
    self_last_vs_off(4, "--set parallel.expert_parallel_size=4", "", "sl_ep4");
    self_last_vs_off(2, "--set parallel.expert_parallel_size=2 --set train.activation_checkpointing=true", "",
                     "sl_ac");
    self_last_vs_off(2, "--set parallel.expert_parallel_size=2", "MT_MOE_ROW_CAPACITY=0.3", "sl_over");
    self_last_vs_off(1, "", "MT_MOE_LOOPBACK=1", "sl_loop");
}

/* The dispatch's copy by slot (ops.h dispatch_rows, the default) against the gather by row
 * (MT_MOE_DISPATCH=gather): the same rows, so every bit the same, through each way
 * moe_dispatch_rows copies: the fixed exchange with the self-last parts (EP = 2, and EP = 4 where
 * ranks 1 and 2 have blocks before and after their own), without them, the counted exchange, a
 * capacity re-run, the loopback and EP = 1 without pairs */
static void slot_vs_gather(int np, const char *mesh, const char *env, const char *tag)
{
    double l_slot[STEPS], g_slot[STEPS], l_row[STEPS], g_row[STEPS];
    char e[256], t[64];
    snprintf(t, sizeof t, "%s_by_slot", tag);
    free(train(np, env, mesh, t, l_slot, g_slot));
    snprintf(e, sizeof e, "%s MT_MOE_DISPATCH=gather", env);
    snprintf(t, sizeof t, "%s_by_row", tag);
    free(train(np, e, mesh, t, l_row, g_row));
    for (int s = 0; s < STEPS; s++) {
        cr_expect_eq(l_slot[s], l_row[s], "%s: step %d loss %.9g vs %.9g", tag, s + 1, l_slot[s], l_row[s]);
        cr_expect_eq(g_slot[s], g_row[s], "%s: step %d grad_norm %.9g vs %.9g", tag, s + 1, g_slot[s], g_row[s]);
    }
}

Test(moe_fixed, dispatch_by_slot_keeps_every_bit, .timeout = 600)
{
    slot_vs_gather(2, "--set parallel.expert_parallel_size=2", "", "ds_ep2");
    slot_vs_gather(4, "--set parallel.expert_parallel_size=4", "", "ds_ep4");
    slot_vs_gather(2, "--set parallel.expert_parallel_size=2 --set parallel.moe_combine_self_last=false", "",
                   "ds_whole");
    slot_vs_gather(2, "--set parallel.expert_parallel_size=2 --set parallel.moe_fixed_exchange=false", "",
                   "ds_counted");
    slot_vs_gather(2, "--set parallel.expert_parallel_size=2", "MT_MOE_ROW_CAPACITY=0.3", "ds_over");
    slot_vs_gather(1, "", "MT_MOE_LOOPBACK=1", "ds_loop");
    slot_vs_gather(1, "", "", "ds_ep1");
}

Test(moe_fixed, impossible_settings_are_refused, .timeout = 120)
{
    const char *runs[][2] = {
        {"", "--set parallel.moe_fixed_exchange=true --set parallel.moe_chunks=2"},
        {"", "--set parallel.moe_fixed_exchange=true --set parallel.pipeline_parallel_size=2"},
        {"MT_MOE_ROW_CAPACITY=lots", ""},
        {"MT_MOE_DISPATCH=scatter", ""},
    };
    const char *want[] = {"parallel.moe_fixed_exchange: true needs parallel.moe_chunks: 1",
                          "parallel.moe_fixed_exchange: true needs parallel.pipeline_parallel_size: 1",
                          "environment variable MT_MOE_ROW_CAPACITY=lots: expected a positive number",
                          "environment variable MT_MOE_DISPATCH=scatter: expected one of slot, gather"};
    for (int i = 0; i < 4; i++) {
        char cmd[1024], *out = NULL;
        snprintf(cmd, sizeof cmd, "%s timeout 60 %s -np 2 %s/moetrain train configs/tiny.yaml --backend cpu "
                 "--set train.steps=1 --set parallel.expert_parallel_size=2 %s", runs[i][0], tu_mpirun(),
                 tu_build(), runs[i][1]);
        cr_expect_neq(tu_run(cmd, &out), 0, "%s", out);
        cr_expect(out && strstr(out, want[i]), "no '%s' in:\n%s", want[i], out ? out : "");
        cr_expect(out && !strstr(out, "step 1/"), "the run went on:\n%s", out ? out : "");
        free(out);
    }
}
