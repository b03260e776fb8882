/* The [PP, EP, EP_FSDP] grid: mesh.c's formulas against groups re-derived here by enumerating
 * coordinates the way design.md "The grid" defines them, plus the real communicators under mpirun. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../test_util.h"
#include "mesh.h"

static void small_config(struct config *c, int pp, int ep, bool outside, int layers, int experts)
{
    memset(c, 0, sizeof *c);
    c->model.vocab_size = 64;
    c->model.hidden_size = 32;
    c->model.num_hidden_layers = layers;
    c->model.num_attention_heads = 4;
    c->model.num_key_value_heads = 2;
    c->model.head_dim = 8;
    c->model.num_experts = experts;
    c->model.num_experts_per_tok = experts > 1 ? 2 : experts;
    c->model.moe_intermediate_size = 16;
    c->model.intermediate_size = 48;
    c->model.decoder_sparse_step = 1;
    c->parallel.pipeline_parallel_size = pp;
    c->parallel.expert_parallel_size = ep;
    c->parallel.ep_outside = outside;
    c->train.seq_len = 8;
    c->train.micro_batch_size = 1;
    c->train.global_batch_size = 8;
}

struct expect {
    int stage, e, f;
};

/* Checks one (world, pp, ep, outside) grid against the enumeration; asserts on the first mismatch. */
static void check_grid(int world, int pp, int ep, bool outside)
{
    const int S = world / pp, F = S / ep, E = 3 * ep;
    struct config c;
    small_config(&c, pp, ep, outside, 2 * pp + 1, E);
    struct mesh_dims d;
    char err[256] = "";
    cr_assert(mesh_dims_of(&c, world, &d, err, sizeof err), "W%d pp%d ep%d: %s", world, pp, ep, err);
    cr_assert(d.world == world && d.pp == pp && d.ep == ep && d.S == S && d.ep_fsdp == F &&
              d.ep_outside == outside);

    /* Enumerate ranks in order: stage-major, then inside a stage the slower index first
     * (f when EP is inside, e when ep_outside), so a running counter is the global rank. */
    struct expect *x = calloc((size_t)world, sizeof *x);
    int g = 0;
    for (int s = 0; s < pp; s++)
        for (int slow = 0; slow < (outside ? ep : F); slow++)
            for (int fast = 0; fast < (outside ? F : ep); fast++, g++) {
                x[g].stage = s;
                x[g].e = outside ? slow : fast;
                x[g].f = outside ? fast : slow;
            }
    cr_assert_eq(g, world);

    int *ep_hits = calloc((size_t)world, sizeof(int)), *fsdp_hits = calloc((size_t)world, sizeof(int));
    int *stage_hits = calloc((size_t)world, sizeof(int)), *pp_hits = calloc((size_t)world, sizeof(int));
    for (int r = 0; r < world; r++) {
        struct mesh_coord co;
        mesh_coord_of(&d, r, &co);
        cr_assert(co.stage == x[r].stage && co.ep_rank == x[r].e && co.fsdp_rank == x[r].f &&
                  co.local == r - x[r].stage * S,
                  "W%d pp%d ep%d out%d rank %d: got (s%d e%d f%d l%d), want (s%d e%d f%d)", world, pp, ep,
                  outside, r, co.stage, co.ep_rank, co.fsdp_rank, co.local, x[r].stage, x[r].e, x[r].f);
        cr_assert_eq(mesh_rank_of(&d, x[r].stage, x[r].e, x[r].f), r);
    }

    /* EP groups: members are the ranks with one (stage, f); every expert exactly once per group. */
    for (int s = 0; s < pp; s++)
        for (int f = 0; f < F; f++) {
            int n = 0, *expert_hits = calloc((size_t)E, sizeof(int));
            for (int r = 0; r < world; r++) {
                if (x[r].stage != s || x[r].f != f) continue;
                n++;
                ep_hits[r]++;
                int e0, e1;
                mesh_expert_range(E, ep, x[r].e, &e0, &e1);
                cr_assert(e0 >= 0 && e1 <= E && e1 - e0 == E / ep);
                for (int i = e0; i < e1; i++) expert_hits[i]++;
            }
            cr_assert_eq(n, ep);
            for (int i = 0; i < E; i++) cr_assert_eq(expert_hits[i], 1, "expert %d held %d times", i, expert_hits[i]);
            free(expert_hits);
        }
    /* EP_FSDP groups: one (stage, e); all members hold the same experts. */
    for (int s = 0; s < pp; s++)
        for (int e = 0; e < ep; e++) {
            int n = 0, first0 = -1, first1 = -1;
            for (int r = 0; r < world; r++) {
                if (x[r].stage != s || x[r].e != e) continue;
                n++;
                fsdp_hits[r]++;
                int e0, e1;
                mesh_expert_range(E, ep, x[r].e, &e0, &e1);
                if (first0 < 0) { first0 = e0; first1 = e1; }
                cr_assert(e0 == first0 && e1 == first1);
            }
            cr_assert_eq(n, F);
        }
    /* Stage groups and PP groups. */
    for (int s = 0; s < pp; s++) {
        int n = 0;
        for (int r = 0; r < world; r++)
            if (x[r].stage == s) { n++; stage_hits[r]++; }
        cr_assert_eq(n, S);
    }
    for (int l = 0; l < S; l++) {
        int n = 0;
        for (int r = 0; r < world; r++)
            if (r - x[r].stage * S == l) { n++; pp_hits[r]++; }
        cr_assert_eq(n, pp);
    }
    for (int r = 0; r < world; r++)
        cr_assert(ep_hits[r] == 1 && fsdp_hits[r] == 1 && stage_hits[r] == 1 && pp_hits[r] == 1,
                  "rank %d in %d/%d/%d/%d groups", r, ep_hits[r], fsdp_hits[r], stage_hits[r], pp_hits[r]);

    /* Consecutive ranks share an EP group (EP inside), or an EP_FSDP group (ep_outside): blocks of
     * ep (resp. ep_fsdp) consecutive ranks, aligned. */
    const int block = outside ? F : ep;
    for (int r = 0; r + 1 < world; r++) {
        bool same_block = r / block == (r + 1) / block;
        struct mesh_coord a, b;
        mesh_coord_of(&d, r, &a);
        mesh_coord_of(&d, r + 1, &b);
        bool same_group = a.stage == b.stage && (outside ? a.ep_rank == b.ep_rank : a.fsdp_rank == b.fsdp_rank);
        cr_assert_eq(same_block, same_group, "W%d pp%d ep%d out%d ranks %d,%d", world, pp, ep, outside, r, r + 1);
    }
    free(x);
    free(ep_hits);
    free(fsdp_hits);
    free(stage_hits);
    free(pp_hits);
}

Test(mesh, grid_sweep_matches_enumeration)
{
    int grids = 0;
    for (int world = 1; world <= 64; world++)
        for (int pp = 1; pp <= world; pp++) {
            if (world % pp) continue;
            for (int ep = 1; ep <= world / pp; ep++) {
                if ((world / pp) % ep) continue;
                check_grid(world, pp, ep, false);
                check_grid(world, pp, ep, true);
                grids += 2;
            }
        }
    cr_assert_gt(grids, 500);
}

Test(mesh, stage_layers_contiguous_balanced)
{
    for (int L = 1; L <= 60; L++)
        for (int pp = 1; pp <= L; pp++) {
            int next = 0, prev_size = L + 1;
            for (int s = 0; s < pp; s++) {
                int l0, l1;
                mesh_stage_layers(L, pp, s, &l0, &l1);
                cr_assert_eq(l0, next, "L%d pp%d stage %d starts at %d", L, pp, s, l0);
                int size = l1 - l0;
                cr_assert(size >= 1 && size <= prev_size, "L%d pp%d stage %d size %d", L, pp, s, size);
                cr_assert(size == L / pp || size == L / pp + 1);
                prev_size = size;
                next = l1;
            }
            cr_assert_eq(next, L);
        }
}

Test(mesh, stage_layers_from_pipeline_layers)
{
    struct config c;
    config_defaults(&c);
    c.model.num_hidden_layers = 10;
    c.parallel.pipeline_parallel_size = 3;
    int l0, l1;
    /* no list: the even split */
    mesh_stage_layers_cfg(&c, 3, 1, &l0, &l1);
    cr_assert(l0 == 4 && l1 == 7, "[%d, %d)", l0, l1);
    c.parallel.n_pipeline_layers = 3;
    c.parallel.pipeline_layers[0] = 2;
    c.parallel.pipeline_layers[1] = 5;
    c.parallel.pipeline_layers[2] = 3;
    const int want[4] = {0, 2, 7, 10};
    for (int s = 0; s < 3; s++) {
        mesh_stage_layers_cfg(&c, 3, s, &l0, &l1);
        cr_assert(l0 == want[s] && l1 == want[s + 1], "stage %d [%d, %d)", s, l0, l1);
    }
    struct mesh_dims d;
    char err[256];
    cr_assert(mesh_dims_of(&c, 6, &d, err, sizeof err), "%s", err);
    c.parallel.pipeline_layers[2] = 2;
    cr_assert_not(mesh_dims_of(&c, 6, &d, err, sizeof err));
    cr_assert(strstr(err, "parallel.pipeline_layers has 3 entries summing to 9"), "%s", err);
}

static void expect_reject(const struct config *c, int world, const char *want)
{
    struct mesh_dims d;
    char err[256] = "";
    cr_assert_not(mesh_dims_of(c, world, &d, err, sizeof err), "accepted, expected '%s'", want);
    cr_assert(strstr(err, want), "message '%s' lacks '%s'", err, want);
    cr_assert_null(strchr(err, '\n'), "message must be one line: '%s'", err);
}

Test(mesh, constraint_violations_rejected_with_reason)
{
    struct config c;
    small_config(&c, 4, 1, false, 8, 8);
    expect_reject(&c, 6, "world size 6 is not divisible by pipeline_parallel_size 4");

    small_config(&c, 2, 2, false, 8, 8);
    expect_reject(&c, 6, "ranks per stage 3 (world size 6 / pipeline_parallel_size 2) is not divisible by "
                         "expert_parallel_size 2");

    small_config(&c, 1, 4, false, 8, 6);
    expect_reject(&c, 8, "num_experts 6 is not divisible by expert_parallel_size 4");
    /* without experts there is nothing to divide */
    small_config(&c, 1, 4, false, 8, 0);
    struct mesh_dims d;
    char err[256];
    cr_assert(mesh_dims_of(&c, 8, &d, err, sizeof err), "%s", err);

    small_config(&c, 4, 1, false, 3, 8);
    expect_reject(&c, 4, "num_hidden_layers 3 is smaller than pipeline_parallel_size 4");

    small_config(&c, 1, 1, false, 4, 8);
    c.model.num_attention_heads = 6;
    c.model.num_key_value_heads = 4;
    expect_reject(&c, 2, "num_attention_heads 6 is not divisible by num_key_value_heads 4");

    small_config(&c, 0, 1, false, 4, 8);
    expect_reject(&c, 2, "pipeline_parallel_size must be positive, got 0");
    small_config(&c, 1, -2, false, 4, 8);
    expect_reject(&c, 2, "expert_parallel_size must be positive, got -2");
    small_config(&c, 1, 1, false, 4, 8);
    expect_reject(&c, 0, "world size must be positive, got 0");
    c.model.num_key_value_heads = 0;
    expect_reject(&c, 2, "num_key_value_heads must be positive, got 0");
    small_config(&c, 1, 1, false, 0, 8);
    expect_reject(&c, 2, "num_hidden_layers must be positive, got 0");
}

/* ---- real communicators under mpirun (tests/mpi/mesh_check.c) ---- */

/* Runs mesh_check under mpirun; returns its exit status, stderr copied to errpath if not NULL. */
static int run_mesh_check(int np, const char *args, const char *errpath)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "timeout 120 %s -np %d %s/tests/mpi/mesh_check %s > /dev/null 2> %s",
             tu_mpirun(), np, tu_build(), args,
             errpath ? errpath : "/dev/null");
    int st = system(cmd);
    cr_assert(st != -1 && WIFEXITED(st), "could not run: %s", cmd);
    return WEXITSTATUS(st);
}

static void expect_mesh_ok(int np, const char *args)
{
    char errpath[] = "/tmp/mt_mesh_check_XXXXXX";
    int fd = mkstemp(errpath);
    cr_assert(fd >= 0);
    int rc = run_mesh_check(np, args, errpath);
    char buf[4096] = "";
    FILE *f = fdopen(fd, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    buf[n] = 0;
    if (f) fclose(f);
    unlink(errpath);
    cr_assert_eq(rc, 0, "mesh_check -np %d %s exited %d:\n%s", np, args, rc, buf);
}

/* args: pp ep ep_outside [layers experts] */
Test(mesh_mpi, single_rank) { expect_mesh_ok(1, "1 1 0"); }
Test(mesh_mpi, np4_ep2_fsdp2, .timeout = 180) { expect_mesh_ok(4, "1 2 0"); }
Test(mesh_mpi, np4_pp2_ep2, .timeout = 180) { expect_mesh_ok(4, "2 2 0"); }
Test(mesh_mpi, np6_pp2_ep3_outside, .timeout = 180) { expect_mesh_ok(6, "2 3 1 5 6"); }
Test(mesh_mpi, np8_ep2_fsdp4, .timeout = 180) { expect_mesh_ok(8, "1 2 0"); }
Test(mesh_mpi, np8_pp2_ep2_outside, .timeout = 180) { expect_mesh_ok(8, "2 2 1"); }
Test(mesh_mpi, np8_pp4_ep1, .timeout = 180) { expect_mesh_ok(8, "4 1 0"); }
Test(mesh_mpi, np8_ep8, .timeout = 180) { expect_mesh_ok(8, "1 8 0"); }

/* Every rank detects the impossible mesh: exactly one error line, non-zero exit, no hang. */
Test(mesh_mpi, impossible_mesh_fails_cleanly, .timeout = 180)
{
    char errpath[] = "/tmp/mt_mesh_bad_XXXXXX";
    int fd = mkstemp(errpath);
    cr_assert(fd >= 0);
    int rc = run_mesh_check(6, "4 1 0", errpath);
    FILE *f = fdopen(fd, "r");
    cr_assert_not_null(f);
    char line[1024], all[8192] = "";
    int errors = 0, right = 0;
    while (fgets(line, sizeof line, f)) {
        if (strstr(line, "moetrain: error:")) errors++;
        if (strstr(line, "world size 6 is not divisible by pipeline_parallel_size 4")) right++;
        strncat(all, line, sizeof all - strlen(all) - 1);
    }
    fclose(f);
    unlink(errpath);
    cr_assert_neq(rc, 124, "mpirun hung (killed by timeout)");
    cr_assert_neq(rc, 0, "an impossible mesh must exit non-zero");
    cr_assert_eq(errors, 1, "expected one error line, got %d (exit %d):\n%s", errors, rc, all);
    cr_assert_eq(right, 1, "the error line must give the reason");
}
