/* MT_STASH_IN_GRADS (src/stash_place.h): parked expert rows placed in lower layers' expert
 * gradients. The placement itself on made-up sizes, then training on the CPU backend with and
 * without it. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moe_buffers.h"
#include "stash_place.h"
#include "../test_util.h"

/* Every placed buffer lies in a host below its own layer, inside the host, on the alignment, and no
 * two buffers of a host overlap; the bytes returned are the placed buffers' sum. Layers 0..4 each
 * park 3 buffers of ~100 bytes, hosts are layers 0..3's gradients: at 250 bytes a host holds one
 * buffer (the next would start at 256), and bottom-up first fit gives each of layers 1..4 one
 * (none to layer 0: no host below it); at 1 KiB all of layers 1..4's fit. */
Test(stash_place, places_rows_only_below_their_layer)
{
    struct stash_host hosts[4];
    for (int h = 0; h < 4; h++) hosts[h] = (struct stash_host){3 - h, 250}; /* given top-down */
    struct stash_buf bufs[15];
    int n = 0;
    for (int l = 4; l >= 0; l--) /* given top-down too: the placement orders them */
        for (int k = 0; k < 3; k++) bufs[n++] = (struct stash_buf){.layer = l, .bytes = 100 + k};
    const int64_t placed = stash_place(hosts, 4, bufs, n);
    int64_t sum = 0;
    int per_layer[5] = {0};
    for (int i = 0; i < n; i++) {
        const struct stash_buf *b = &bufs[i];
        if (b->host < 0) continue;
        cr_assert(b->host < 4);
        cr_expect_lt(hosts[b->host].layer, b->layer, "a buffer of layer %d in the gradients of layer %d", b->layer,
                     hosts[b->host].layer);
        cr_expect_eq(b->off % MT_STASH_PLACE_ALIGN, 0);
        cr_expect_leq(b->off + b->bytes, hosts[b->host].bytes);
        for (int j = 0; j < i; j++)
            if (bufs[j].host == b->host)
                cr_expect(bufs[j].off + bufs[j].bytes <= b->off || b->off + b->bytes <= bufs[j].off,
                          "buffers %d and %d overlap", i, j);
        sum += b->bytes;
        per_layer[b->layer]++;
    }
    cr_expect_eq(placed, sum);
    cr_expect_eq(per_layer[0], 0);
    for (int l = 1; l <= 4; l++) cr_expect_eq(per_layer[l], 1, "layer %d: %d buffers placed", l, per_layer[l]);
    for (int h = 0; h < 4; h++) hosts[h].bytes = 1024;
    cr_expect_eq(stash_place(hosts, 4, bufs, n), 12 * 100 + 4 * (1 + 2));
    for (int i = 0; i < n; i++) cr_expect_eq(bufs[i].host >= 0, bufs[i].layer > 0, "buffer %d", i);
}

/* the group rule the model and the plan share */
Test(stash_place, layer_slots_follow_the_groups)
{
    /* 6 pairing layers, the first 4 grouping 4 micro-steps, the first 2 of those 8 */
    const int want[] = {7, 7, 3, 3, 1, 1, 0};
    for (int n = 0; n < 7; n++) cr_expect_eq(stash_layer_slots(n, 6, 4, 4, 2, 8), want[n], "layer %d", n);
    int64_t b[4];
    stash_slot_bytes(512, 256, 64, 32, 96, 2, b); /* R = 512: act and d_gu sized for the dense layer */
    cr_expect_eq(b[0], 512 * 64 * 2);
    cr_expect_eq(b[1], 256 * 96 * 2);
    cr_expect_eq(b[2], 256 * 2 * 96 * 2);
    cr_expect_eq(b[3], 512 * 64 * 2);
    /* with EP the rows are the fixed exchange's first capacity (model_enable_fixed_exchange:
     * moe_capacity of the mean, at most ep times it), so that the plan places what the model does */
    const int64_t T = 8192, k = 8;
    cr_expect_eq(stash_slot_rows(T, k, 1), T * k);
    for (int ep = 2; ep <= 16; ep *= 2) cr_expect_eq(stash_slot_rows(T, k, ep), moe_capacity(0, T * k), "ep %d", ep);
    cr_expect_eq(stash_slot_rows(1, 1, 2), 2, "a capacity past ep x the mean is held to it");
}

/* "acts MEASURED/PLAN" of the run's last memory line */
static bool acts_of(const char *out, double *measured, double *plan)
{
    const char *p = strstr(out, "measured/plan MiB:");
    return p && (p = strstr(p, " acts ")) && sscanf(p, " acts %lf/%lf", measured, plan) == 2;
}

/* The tiny model with 4 layers of 64 experts, groups of all 8 micro-steps, on the CPU: with the
 * parked rows in lower layers' gradients the gradient norms and losses are the same bits as
 * without (a buffer placed in its own layer's or a higher layer's gradients changes them from the
 * second step), the start-up line says how much lies there, and the activations measured fall by
 * what the plan takes off (to 1%). The same at EP=2 and EP=4 when asked for (MT_STASH_IN_GRADS=1;
 * auto is for GPUs), also through steps that run again with more rows; a bad value is refused. */
Test(stash_place, parking_in_the_gradients_keeps_every_bit, .timeout = 300)
{
    char cmd[1024], *out = NULL, path[2][64];
    double acts[2][2] = {{0}};
    for (int v = 0; v < 2; v++) {
        snprintf(path[v], sizeof path[v], "/tmp/mt_stash_grads_%d_%d.jsonl", v, (int)getpid());
        snprintf(cmd, sizeof cmd,
                 "MT_STASH_IN_GRADS=%d timeout 120 %s -np 1 %s/moetrain train configs/tiny.yaml --backend cpu "
                 "--set train.steps=3 --set parallel.expert_wgrad_pairs=true --set parallel.expert_wgrad_group=8 "
                 "--set model.num_experts=64 --set model.num_hidden_layers=4 --set log.metrics=%s",
                 v, tu_mpirun(), tu_build(), path[v]);
        cr_assert_eq(tu_run(cmd, &out), 0, "MT_STASH_IN_GRADS=%d: %s", v, out);
        const char *line = strstr(out, "  parked rows ");
        cr_expect((line != NULL) == (v == 1), "MT_STASH_IN_GRADS=%d: the start-up line %s:\n%s", v,
                  line ? "is there" : "is missing", out);
        if (line) cr_expect(strncmp(line, "  parked rows 0.00 ", 19) != 0, "nothing placed:\n%s", out);
        cr_expect(acts_of(out, &acts[v][0], &acts[v][1]), "no memory line:\n%s", out);
        free(out);
    }
    const char *fields[] = {"grad_norm", "loss"};
    for (int f = 0; f < 2; f++) {
        double a[4], b[4];
        cr_assert_eq(tu_read_metric(path[1], fields[f], a, 4), 3);
        cr_assert_eq(tu_read_metric(path[0], fields[f], b, 4), 3);
        for (int i = 0; i < 3; i++)
            cr_expect_eq(a[i], b[i], "%s step %d: %.17g parked in the gradients, %.17g apart", fields[f], i + 1, a[i],
                         b[i]);
    }
    const double fell = acts[0][0] - acts[1][0], planned = acts[0][1] - acts[1][1];
    cr_expect_gt(planned, 0, "the plan took nothing off: %g -> %g MiB", acts[0][1], acts[1][1]);
    cr_expect(fabs(fell - planned) <= 0.01 * planned, "activations fell by %g MiB, the plan by %g", fell, planned);
    unlink(path[0]), unlink(path[1]);

    /* EP=2 and EP=4 (the fixed exchange; tiny's top-2 takes the counted one at 4 unless told):
     * the same bits, also through steps that run again with more rows (MT_MOE_ROW_CAPACITY: a
     * first capacity too small), where the buffers are placed again at the grown capacity. The
     * plan's fall is the model's where no step runs again; at EP=4 the tiny model's first step
     * runs again by itself (its first capacity is one row short), so only the bits are compared. */
    const struct {
        int ep, rerun, plan;
    } cases[] = {{2, 0, 1}, {2, 1, 0}, {4, 0, 0}};
    for (int ci = 0; ci < 3; ci++) {
        const int ep = cases[ci].ep, rerun = cases[ci].rerun;
        for (int v = 0; v < 2; v++) {
            snprintf(cmd, sizeof cmd,
                     "%s MT_STASH_IN_GRADS=%d timeout 120 %s -np %d %s/moetrain train configs/tiny.yaml --backend cpu "
                     "--set train.steps=3 --set parallel.expert_parallel_size=%d --set parallel.expert_wgrad_pairs=true "
                     "--set parallel.expert_wgrad_group=8 --set model.num_experts=64 --set model.num_hidden_layers=4 "
                     "%s --set log.metrics=%s",
                     rerun ? "MT_MOE_ROW_CAPACITY=0.6" : "", v, tu_mpirun(), ep, tu_build(), ep,
                     ep == 4 ? "--set parallel.moe_fixed_exchange=true --set train.global_batch_size=128" : "", path[v]);
            cr_assert_eq(tu_run(cmd, &out), 0, "EP=%d, MT_STASH_IN_GRADS=%d: %s", ep, v, out);
            const char *line = strstr(out, "  parked rows ");
            cr_expect((line != NULL) == (v == 1), "EP=%d, MT_STASH_IN_GRADS=%d: the start-up line %s:\n%s", ep, v,
                      line ? "is there" : "is missing", out);
            if (line) cr_expect(strncmp(line, "  parked rows 0.00 ", 19) != 0, "EP=%d: nothing placed:\n%s", ep, out);
            cr_expect(!rerun || strstr(out, "running the step again"), "no step ran again:\n%s", out);
            cr_expect(acts_of(out, &acts[v][0], &acts[v][1]), "no memory line:\n%s", out);
            free(out);
        }
        for (int f = 0; f < 2; f++) {
            double a[4], b[4];
            cr_assert_eq(tu_read_metric(path[1], fields[f], a, 4), 3);
            cr_assert_eq(tu_read_metric(path[0], fields[f], b, 4), 3);
            for (int i = 0; i < 3; i++)
                cr_expect_eq(a[i], b[i], "EP=%d%s, %s step %d: %.17g parked in the gradients, %.17g apart", ep,
                             rerun ? " (steps run again)" : "", fields[f], i + 1, a[i], b[i]);
        }
        if (cases[ci].plan) { /* the plan's fall (at the first capacity) is the model's */
            const double fell2 = acts[0][0] - acts[1][0], planned2 = acts[0][1] - acts[1][1];
            cr_expect(planned2 > 0 && fabs(fell2 - planned2) <= 0.05 * planned2,
                      "EP=%d: activations fell by %g MiB, the plan by %g", ep, fell2, planned2);
        }
        unlink(path[0]), unlink(path[1]);
    }

    snprintf(cmd, sizeof cmd, "MT_STASH_IN_GRADS=yes timeout 60 %s -np 1 %s/moetrain train configs/tiny.yaml "
             "--backend cpu --set train.steps=1", tu_mpirun(), tu_build());
    cr_expect_neq(tu_run(cmd, &out), 0, "MT_STASH_IN_GRADS=yes ran");
    cr_expect(out && strstr(out, "environment variable MT_STASH_IN_GRADS=yes: expected one of 0, 1, auto"),
              "no one-line error in:\n%s", out ? out : "");
    cr_expect(out && !strstr(out, "step 1/"), "the run went on:\n%s", out ? out : "");
    free(out);
}
