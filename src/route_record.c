/* `moetrain route --record OUT CONFIG.yaml [--with-weights] [--set ...]`: writes a routing file
 * (route_replay.h) from moetrain's own forward, for every sequence the config's first train.steps
 * steps train on (q = 0 .. steps × global_batch_size − 1), with the starting weights (random init
 * from train.seed, or model.init_from as a Hugging Face directory). One rank; no backward. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_select.h"
#include "checkpoint.h"
#include "cli.h"
#include "common.h"
#include "config.h"
#include "data.h"
#include "model_step.h"
#include "params.h"
#include "route_replay.h"

int cmd_route(const struct cli *a)
{
    MT_CHECK_MPI(MPI_Init(NULL, NULL));
    int world;
    MT_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &world));
    if (world != 1) mt_user_error("route --record runs on one rank (launched on %d)", world);
    struct config c;
    config_load(&c, a->config_path, a->n_sets, a->sets);
    c.parallel.backend = backend_choice_from_cli(a->backend, c.parallel.backend);
    const struct train_config *tc = &c.train;
    if (c.model.num_experts == 0) mt_user_error("%s: the model has no MoE layer to record", c.path);
    if (*c.data.routing_replay)
        mt_user_error("%s: data.routing_replay is set; route --record records the model's own routing", c.path);
    const int mb = tc->micro_batch_size;
    const int64_t n_seq = (int64_t)tc->steps * tc->global_batch_size;
    if (n_seq % mb != 0)
        mt_user_error("%s: train.steps x global_batch_size (%lld) is not a multiple of micro_batch_size %d",
                      c.path, (long long)n_seq, mb);

    char err[1024];
    struct data_source *data = data_open(&c.data, tc, c.model.vocab_size, err, sizeof err);
    if (!data) mt_user_error("%s", err);
    const struct backend *be = backend_select(c.parallel.backend, c.model.precision, 0);
    struct model m;
    model_init(&m, be, &c.model, mb, tc->seq_len, NULL, false);
    struct params p;
    params_init(&p, &m, NULL, NULL);
    if (*c.model.init_from && ckpt_is_checkpoint(c.model.init_from))
        mt_user_error("%s: route --record starts from a Hugging Face directory or a random init, not the "
                      "checkpoint %s (export it first: moetrain export)", c.path, c.model.init_from);
    if (*c.model.init_from) {
        if (!params_load_hf(&p, c.model.init_from, err, sizeof err)) mt_user_error("%s", err);
    } else {
        params_init_random(&p, tc->seed);
    }
    params_gather_weights(&p);

    FILE *f = fopen(a->record, "wb");
    if (!f) mt_user_error("%s: cannot create the routing file", a->record);
    const int S = tc->seq_len, K = m.K, nm = m.n_moe_layers;
    struct route_file_header h = {ROUTE_FILE_VERSION, (uint32_t)nm, (uint32_t)K, (uint32_t)S,
                                  (uint64_t)n_seq, m.E <= 32767 ? 2u : 4u,
                                  a->with_weights ? ROUTE_FILE_HAS_WEIGHTS : 0u, (uint32_t)m.E};
    bool ok = route_file_write_header(f, &h);
    const size_t tk = (size_t)m.T * K, per_seq = (size_t)nm * S * K;
    int32_t *ids = mt_malloc((size_t)m.T * sizeof(int32_t)), *idx = mt_malloc((size_t)nm * tk * sizeof(int32_t));
    float *w = mt_malloc((size_t)nm * tk * sizeof(float));
    void *rec_idx = mt_malloc(per_seq * h.index_width);
    float *rec_w = mt_malloc(per_seq * sizeof(float));
    for (int64_t first = 0; first < n_seq && ok; first += mb) {
        data_get_sequences(data, first, mb, ids);
        struct model_step_out o;
        model_forward(&m, ids, NULL, &o);
        for (int l = 0, k = 0; l < m.L; l++) {
            if (!config_layer_is_moe(&m.cfg, l)) continue;
            /* with ep = 1 and no recompute each layer keeps its top-k (ascending expert id) */
            be->download(idx + (size_t)k * tk, m.layers[l].topk_idx, tk * sizeof(int32_t));
            be->download(w + (size_t)k * tk, m.layers[l].topk_w, tk * sizeof(float));
            k++;
        }
        for (int b = 0; b < mb && ok; b++) {
            for (int k = 0; k < nm; k++)
                for (size_t s = 0; s < (size_t)S * K; s++) {
                    const size_t from = (size_t)k * tk + (size_t)b * S * K + s, to = (size_t)k * S * K + s;
                    if (h.index_width == 2) ((int16_t *)rec_idx)[to] = (int16_t)idx[from];
                    else ((int32_t *)rec_idx)[to] = idx[from];
                    rec_w[to] = w[from];
                }
            ok = fwrite(rec_idx, h.index_width, per_seq, f) == per_seq &&
                 (!a->with_weights || fwrite(rec_w, sizeof(float), per_seq, f) == per_seq);
        }
    }
    if (fclose(f) != 0) ok = false;
    if (!ok) mt_user_error("%s: writing the routing file failed", a->record);
    printf("recorded the routing of %lld sequences x %d MoE layers x %d tokens (top-%d%s) to %s\n",
           (long long)n_seq, nm, S, K, a->with_weights ? ", with weights" : "", a->record);
    free(ids), free(idx), free(w), free(rec_idx), free(rec_w);
    params_free(&p);
    model_free(&m);
    data_close(data);
    MT_CHECK_MPI(MPI_Finalize());
    return 0;
}
