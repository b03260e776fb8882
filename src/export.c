/* `moetrain export CHECKPOINT OUT_DIR`: a checkpoint as a Hugging Face model directory, on one
 * process, streamed: the checkpoint's rank files are read one tensor piece at a time
 * (ckpt_reader_read) and written before the next is read, so the host needs a few hundred MB
 * whatever the model's size. The training run's own export is export_stream.c. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "cli.h"
#include "common.h"
#include "hf_export.h"

static bool fetch_from_checkpoint(void *ctx, int tensor, int64_t gstart, int64_t n, float *dst, char *err,
                                  int errcap)
{
    char mine[1024];
    if (ckpt_reader_read(ctx, tensor, gstart, n, dst, mine, sizeof mine)) return true;
    if (!*err) mt_strlcpy(err, mine, (size_t)errcap);
    return false;
}

int cmd_export(const struct cli *a)
{
    MT_CHECK_MPI(MPI_Init(NULL, NULL));
    if (mt_world() != 1) mt_user_error("export runs on one process (launched on %d)", mt_world());
    /* the saved config's model keys are all explicit; its hf_config / init_from may not exist here */
    char *sets[] = {"model.hf_config=", "parallel.pipeline_parallel_size=1",
                    "parallel.expert_parallel_size=1", "parallel.backend=cpu", "checkpoint.dir=",
                    "checkpoint.export_hf=", "log.metrics="};
    struct config c;
    char err[1024];
    if (!ckpt_read_config(a->model_dir, (int)(sizeof sets / sizeof sets[0]), sets, &c, err, sizeof err))
        mt_user_error("%s", err);
    if (!hf_export_check_dir(a->reference, a->force, err, sizeof err)) mt_user_error("%s", err);
    struct tensor_table tt;
    tensor_table_build(&tt, &c.model);
    float *bias = NULL;
    int step = 0;
    struct ckpt_reader *r = ckpt_reader_open(a->model_dir, &c, &tt, &bias, &step, err, sizeof err);
    if (!r) mt_user_error("%s", err);
    const bool fp32 = a->dtype && !strcmp(a->dtype, "fp32");
    struct hf_export_opts o = {
        .dtype = fp32 ? ST_F32 : ST_BF16,
        .max_shard_bytes = a->max_shard_bytes,
        .force = a->force,
        .tokenizer_from = a->tokenizer_from ? a->tokenizer_from
                          : ckpt_is_checkpoint(c.model.init_from) ? "" : c.model.init_from,
    };
    bool ok = hf_export_stream(a->reference, &c.model, &tt, bias, &o, true, fetch_from_checkpoint, r, err, sizeof err);
    ckpt_reader_close(r);
    if (!ok) mt_user_error("%s (%s not written)", err, a->reference);
    printf("exported step %d of %s to %s (%s%s)\n", step, a->model_dir, a->reference, fp32 ? "fp32" : "bf16",
           bias ? ", with the balancing bias" : "");
    free(bias);
    tensor_table_free(&tt);
    MT_CHECK_MPI(MPI_Finalize());
    return 0;
}
