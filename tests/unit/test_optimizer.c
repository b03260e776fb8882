/* The optimizer step in one pass (adamw_update_multi over the shard's cached segment list) against
 * the per-segment calls it replaced (MT_ADAMW_PER_TENSOR=1): whole training runs of the binary on
 * the CPU backend must give the same losses, gradient norms and exported weights bit for bit, on
 * the sharded meshes (FSDP of both groups, pipeline stages), with fp32 and bf16 moments. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "../test_util.h"

/* Runs `np` ranks for 3 steps with `args`, once per path, and compares them. The profile's op
 * table shows which op each run used, so a flag that no longer switches paths fails too. */
static void one_pass_equals_per_tensor(const char *name, int np, const char *args,
                                       const char *per_tensor_op)
{
    char cmd[2048], *out[2] = {NULL, NULL};
    for (int f = 0; f < 2; f++) {
        snprintf(cmd, sizeof cmd, "rm -rf /tmp/mt_opt_%s_%d*; MT_ADAMW_PER_TENSOR=%d timeout 240 %s -np %d "
                 "%s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=3 %s "
                 "--set log.profile=true --set log.metrics=/tmp/mt_opt_%s_%d.jsonl "
                 "--set checkpoint.export_hf=/tmp/mt_opt_%s_%d --set checkpoint.export_dtype=fp32",
                 name, f, f, tu_mpirun(), np, tu_build(), args, name, f, name, f);
        cr_assert_eq(tu_run(cmd, &out[f]), 0, "%s", out[f]);
    }
    cr_expect(strstr(out[0], "    adamw_update_multi ") && !strstr(out[0], per_tensor_op), "%s", out[0]);
    cr_expect(strstr(out[1], per_tensor_op) && !strstr(out[1], "    adamw_update_multi "), "%s", out[1]);
    free(out[0]), free(out[1]);

    const char *fields[] = {"loss", "aux_loss", "grad_norm"};
    for (int k = 0; k < 3; k++) {
        double a[4], b[4];
        char pa[256], pb[256];
        snprintf(pa, sizeof pa, "/tmp/mt_opt_%s_0.jsonl", name);
        snprintf(pb, sizeof pb, "/tmp/mt_opt_%s_1.jsonl", name);
        cr_assert_eq(tu_read_metric(pa, fields[k], a, 4), 3);
        cr_assert_eq(tu_read_metric(pb, fields[k], b, 4), 3);
        for (int s = 0; s < 3; s++)
            cr_expect(a[s] == b[s], "%s %s step %d: %.9g one pass vs %.9g per tensor", name, fields[k],
                      s + 1, a[s], b[s]);
    }
    /* the final weights, every byte of the fp32 export */
    snprintf(cmd, sizeof cmd, "cmp /tmp/mt_opt_%s_0/model.safetensors /tmp/mt_opt_%s_1/model.safetensors",
             name, name);
    char *diff = NULL;
    cr_expect_eq(tu_run(cmd, &diff), 0, "%s: exported weights differ: %s", name, diff);
    free(diff);
    snprintf(cmd, sizeof cmd, "rm -rf /tmp/mt_opt_%s_*", name);
    tu_run(cmd, NULL);
}

/* 4 ranks, EP=2: the dense group sharded over 4 (padded chunks), the experts over EP_FSDP=2; the
 * frozen router leaves a hole in the segment list */
Test(optimizer, one_pass_equals_per_tensor_fsdp_fp32_moments, .timeout = 300)
{
    one_pass_equals_per_tensor("fsdp", 4, "--set parallel.expert_parallel_size=2 --set model.freeze_router=true",
                               "    adamw_update ");
}

/* 2 pipeline stages, bf16 moments, no compute copy (every gather casts from the master) */
Test(optimizer, one_pass_equals_per_tensor_pipeline_bf16_moments, .timeout = 300)
{
    one_pass_equals_per_tensor("pp_m16", 2,
                               "--set parallel.pipeline_parallel_size=2 --set train.optimizer_state_dtype=bf16 "
                               "--set train.weight_copy=cast",
                               "    adamw_update_m16 ");
}

/* 1 rank, bf16 moments with the compute copy kept */
Test(optimizer, one_pass_equals_per_tensor_one_rank_bf16_moments, .timeout = 300)
{
    one_pass_equals_per_tensor("one_m16", 1, "--set train.optimizer_state_dtype=bf16", "    adamw_update_m16 ");
}

Test(optimizer, a_bad_MT_ADAMW_PER_TENSOR_is_one_line_on_every_rank, .timeout = 120)
{
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "MT_ADAMW_PER_TENSOR=yes timeout 100 %s -np 2 %s/moetrain train configs/tiny.yaml "
             "--backend cpu --set train.steps=2 --set parallel.expert_parallel_size=2", tu_mpirun(), tu_build());
    const int rc = tu_run(cmd, &out);
    cr_expect(rc != 0 && rc != 124, "rc %d:\n%s", rc, out);
    const char *hit = strstr(out, "moetrain: error: environment variable MT_ADAMW_PER_TENSOR=yes: expected 0 or 1");
    cr_expect(hit && !strstr(hit + 1, "moetrain: error:"), "expected exactly one error line:\n%s", out);
    free(out);
}
