/* The layout table and the command line: table rows against the grid formulas, a 1024-rank plan on
 * the real Qwen3-30B-A3B shapes, the folded table of a large world, and `plan --world 8` against
 * `train --dry-run` under mpirun (needs build/moetrain and configs/). The memory estimate's tests
 * are in test_plan.c. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../test_util.h"
#include "common.h"
#include "mesh.h"
#include "plan.h"
#include "plan_test_util.h"

/* plan_print_opts into memory. */
static char *plan_text_opts(const struct config *c, const struct mesh_dims *d, const int *nodes, bool fold,
                            double device_bytes)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cr_assert_not_null(f);
    plan_print_opts(f, c, d, nodes, fold, device_bytes);
    fclose(f);
    return buf;
}

/* plan_print (what `plan` prints) into memory. */
static char *plan_text(const struct config *c, const struct mesh_dims *d, const int *nodes)
{
    return plan_text_opts(c, d, nodes, false, PLAN_DEVICE_BYTES);
}

static int *nodes_of(int world, int per_node)
{
    int *n = malloc((size_t)world * sizeof *n);
    for (int g = 0; g < world; g++) n[g] = g / per_node;
    return n;
}

/* Parses the table rows ("rank node stage [l0,l1) ep fsdp [e0,e1) ...") and checks them against the
 * grid formulas; returns the number of rows. */
static int check_rows(const char *text, const struct config *c, const struct mesh_dims *d, const int *nodes)
{
    int rows = 0;
    const char *p = strstr(text, "\n  rank ");
    cr_assert_not_null(p, "no table header");
    p = strchr(p + 1, '\n') + 1;
    while (*p && strncmp(p, "legend", 6)) {
        int g, node, stage, l0, l1, e, f, e0, e1;
        if (sscanf(p, "%d %d %d [%d,%d) %d %d [%d,%d)", &g, &node, &stage, &l0, &l1, &e, &f, &e0, &e1) == 9) {
            const int S = d->S, local = g % S;
            cr_assert_eq(stage, g / S);
            cr_assert_eq(node, nodes[g]);
            int we = d->ep_outside ? local / d->ep_fsdp : local % d->ep;
            int wf = d->ep_outside ? local % d->ep_fsdp : local / d->ep;
            cr_assert(e == we && f == wf, "row %d: e %d f %d, want %d %d", g, e, f, we, wf);
            const int E = c->model.num_experts;
            cr_assert(e0 == e * E / d->ep && e1 == (e + 1) * E / d->ep);
            int ml0, ml1;
            mesh_stage_layers(c->model.num_hidden_layers, d->pp, stage, &ml0, &ml1);
            cr_assert(l0 == ml0 && l1 == ml1);
            rows++;
        } else {
            cr_assert(strstr(p, "ranks not shown") && p[0] == ' ', "unexpected line: %.80s", p);
        }
        p = strchr(p, '\n');
        cr_assert_not_null(p);
        p++;
    }
    return rows;
}

Test(plan, world_1024_real_shapes, .timeout = 60)
{
    struct config c;
    qwen3_30b_config(&c, 4, 8);
    struct mesh_dims d;
    dims(&c, 1024, &d);
    int *nodes = nodes_of(1024, 8);
    double t0 = mt_now();
    char *text = plan_text(&c, &d, nodes);
    double dt = mt_now() - t0;
    cr_assert_lt(dt, 5.0, "plan for 1024 ranks took %.2f s", dt);
    cr_assert_eq(check_rows(text, &c, &d, nodes), 2 * PLAN_EDGE_ROWS);
    cr_assert_not_null(strstr(text, "896 ranks not shown"));
    cr_assert_not_null(strstr(text, "parameters: 30532122624 total"), "30.5 B parameters expected");
    /* experts: 128 / 8 = 16 per EP rank; gate_up 1536 rows / 32 = 48, down 2048 rows / 32 = 64 */
    cr_assert_not_null(strstr(text, "16x48x2048"));
    cr_assert_not_null(strstr(text, "16x64x768"));
    cr_assert_not_null(strstr(text, "... 120 more"));  /* 128 EP groups, 8 listed */
    cr_assert_null(strstr(text, "warning:"), "EP groups of 8 on 8-GPU nodes stay inside a node");
    free(text);
    free(nodes);
}

Test(plan, full_table_and_groups_small_world)
{
    struct config c;
    hand_config(&c, 2, 2);
    c.parallel.ep_outside = true;
    struct mesh_dims d;
    dims(&c, 8, &d);
    int *nodes = nodes_of(8, 8);
    char *text = plan_text(&c, &d, nodes);
    cr_assert_eq(check_rows(text, &c, &d, nodes), 8);
    /* ep_outside: local = e * 2 + f, so stage 0's EP group of f 0 is {0, 2}, its EP_FSDP group of e 1 is
     * {2, 3}; PP group of local 1 is {1, 5} */
    cr_assert_not_null(strstr(text, "    stage 0 f 0: [0 2]\n"));
    cr_assert_not_null(strstr(text, "    stage 0 e 1: [2 3]\n"));
    cr_assert_not_null(strstr(text, "    stage 1: [4 5 6 7]\n"));
    cr_assert_not_null(strstr(text, "    local 1: [1 5]\n"));
    cr_assert_null(strstr(text, "warning:"));
    free(text);
    free(nodes);
    /* one GPU per node: every EP group of 2 spans two nodes */
    nodes = nodes_of(8, 1);
    text = plan_text(&c, &d, nodes);
    cr_assert_not_null(strstr(text, "warning: 4 of 4 EP groups span more than one node"), "%s", text);
    free(text);
    free(nodes);
}

/* ---- the command line (needs build/moetrain and configs/) ---- */

static int sh(const char *cmd)
{
    int st = system(cmd);
    cr_assert(st != -1 && WIFEXITED(st), "could not run: %s", cmd);
    return WEXITSTATUS(st);
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s", path);
    char *buf = NULL;
    size_t len = 0, cap = 0, n;
    char chunk[4096];
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) {
        if (len + n + 1 > cap) {
            cap = 2 * (len + n + 1);
            buf = realloc(buf, cap);
        }
        memcpy(buf + len, chunk, n);
        len += n;
    }
    fclose(f);
    if (!buf) buf = calloc(1, 1);
    buf[len] = 0;
    return buf;
}

/* On the CPU backend (named, so that `plan`, which sees no device, and the dry run, which selects
 * the backend, decide the auto FSDP settings alike) both print the same layout. */
Test(plan_cli, dry_run_equals_plan, .timeout = 240)
{
    char plan_out[] = "/tmp/mt_plan_XXXXXX", dry_out[] = "/tmp/mt_dry_XXXXXX";
    cr_assert(mkstemp(plan_out) >= 0 && mkstemp(dry_out) >= 0);
    const char *b = tu_build(), *mpirun = tu_mpirun();
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "%s/moetrain plan configs/tiny.yaml --world 8 --set parallel.expert_parallel_size=2 "
             "--set parallel.backend=cpu > %s",
             b, plan_out);
    cr_assert_eq(sh(cmd), 0, "%s", cmd);
    snprintf(cmd, sizeof cmd,
             "timeout 200 %s -np 8 %s/moetrain train configs/tiny.yaml --dry-run "
             "--set parallel.expert_parallel_size=2 --set parallel.backend=cpu > %s", mpirun, b, dry_out);
    cr_assert_eq(sh(cmd), 0, "%s", cmd);
    char *a = slurp(plan_out), *d = slurp(dry_out);
    unlink(plan_out);
    unlink(dry_out);
    cr_assert_not_null(strstr(a, "ep 2 x ep_fsdp 4"), "plan output:\n%s", a);
    /* EP = 2 at top-2: the fixed exchange's blocks fill 75%, so auto takes it and plan says so */
    cr_expect_not_null(strstr(a, "MoE exchange: fixed (parallel.moe_fixed_exchange): blocks of 256 pairs"),
                       "plan output:\n%s", a);
    cr_assert_str_eq(a, d, "plan --world 8 and train --dry-run differ");
    free(a);
    free(d);
}

Test(plan_cli, impossible_world_is_one_line_error)
{
    char err[] = "/tmp/mt_plan_err_XXXXXX";
    cr_assert(mkstemp(err) >= 0);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "%s/moetrain plan configs/tiny.yaml --world 6 --set parallel.pipeline_parallel_size=4 "
             ">/dev/null 2> %s", tu_build(), err);
    cr_assert_eq(sh(cmd), 1);
    char *text = slurp(err);
    unlink(err);
    cr_assert_not_null(strstr(text, "world size 6 is not divisible by pipeline_parallel_size 4"), "%s", text);
    cr_assert_eq(strchr(text, '\n'), text + strlen(text) - 1, "expected one line: %s", text);
    free(text);
}

/* train's start-up table folds every stage's identical ranks into one row: for 64 ranks in 4
 * stages, 4 rows whose totals are those of the per-rank table. */
Test(plan, folded_table_has_one_row_per_stage)
{
    struct config c;
    qwen3_30b_config(&c, 4, 8);
    struct mesh_dims d;
    dims(&c, 64, &d);
    int *nodes = nodes_of(64, 8);
    char *full = plan_text(&c, &d, nodes), *folded = plan_text_opts(&c, &d, nodes, true, PLAN_DEVICE_BYTES);
    const char *p = strstr(folded, "\n      ranks ");
    cr_assert(p, "%s", folded);
    p = strchr(p + 1, '\n') + 1;
    const char *want_ranks[4] = {"0-15", "16-31", "32-47", "48-63"};
    for (int s = 0; s < 4; s++) {
        char ranks[32], nodes_s[32], total_full[32];
        int stage = -1;
        cr_assert_eq(sscanf(p, "%31s %31s %d", ranks, nodes_s, &stage), 3, "%.120s", p);
        cr_expect_str_eq(ranks, want_ranks[s]);
        cr_expect_eq(stage, s);
        const char *eol = strchr(p, '\n');
        const char *last = eol;
        while (last > p && last[-1] != ' ') last--;
        /* the per-rank row of the stage's first rank ends with the same total */
        char key[32];
        snprintf(key, sizeof key, "\n%6d ", s * 16);
        const char *row = strstr(full, key);
        cr_assert(row, "no row for rank %d", s * 16);
        const char *reol = strchr(row + 1, '\n'), *rlast = reol;
        while (rlast > row && rlast[-1] != ' ') rlast--;
        snprintf(total_full, sizeof total_full, "%.*s", (int)(reol - rlast), rlast);
        cr_expect(!strncmp(last, total_full, (size_t)(eol - last)), "stage %d: total %.*s vs %s", s,
                  (int)(eol - last), last, total_full);
        p = eol + 1;
    }
    cr_expect(!strncmp(p, "legend", 6), "a fifth row: %.80s", p);
    free(full);
    free(folded);
    free(nodes);
}

/* train's start-up table is the layout the job runs: the auto settings resolved for the job's
 * GPUs, whose memory the header names; `plan` and --dry-run resolve them for PLAN_DEVICE_BYTES.
 * The full 30B model on one rank fits nothing auto trades for speed in 80 GiB, and groups of eight
 * micro-steps in every layer in 1 TiB. */
Test(plan, start_up_table_on_the_jobs_gpus)
{
    struct config c;
    qwen3_30b_config(&c, 1, 1);
    c.parallel.backend = MT_BACKEND_CUDA, c.parallel.moe_chunks = 1;
    c.parallel.expert_wgrad_pairs = MT_TRI_AUTO, c.parallel.reduce_grads = MT_REDUCE_AUTO;
    c.parallel.reshard_after_forward = MT_TRI_AUTO, c.train.weight_copy = MT_COPY_AUTO;
    c.train.global_batch_size = 8;
    struct mesh_dims d;
    dims(&c, 1, &d);
    int *nodes = nodes_of(1, 1);
    char *at_plan = plan_text(&c, &d, nodes);
    char *at_job = plan_text_opts(&c, &d, nodes, false, 1024.0 * 1024 * 1024 * 1024);
    cr_expect_not_null(strstr(at_plan, "(estimate, auto settings as on GPUs of 80.0 GiB; legend below)"), "%s",
                       at_plan);
    cr_expect_not_null(strstr(at_job, "(estimate, auto settings as on GPUs of 1024.0 GiB; legend below)"), "%s",
                       at_job);
    cr_expect_null(strstr(at_plan, "parallel.expert_wgrad_pairs"), "%s", at_plan);
    cr_expect_not_null(strstr(at_job, "(7 in the first 48: parallel.expert_wgrad_group 8)"), "%s", at_job);
    free(at_plan), free(at_job), free(nodes);
}
