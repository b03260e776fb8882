/* The plan tests' model configs (test_plan.c, test_plan_table.c): a small hand-countable model and
 * the Qwen3-30B-A3B shapes, and the mesh dimensions of a world. Header-only, static. */
#ifndef MT_TESTS_PLAN_TEST_UTIL_H
#define MT_TESTS_PLAN_TEST_UTIL_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "mesh.h"

/* V 101, H 16, L 3, Hq 4, Hkv 2, D 3, E 4, top-2, I 5: small, with uneven splits on purpose. */
static inline void hand_config(struct config *c, int pp, int ep)
{
    memset(c, 0, sizeof *c);
    struct model_config *m = &c->model;
    m->vocab_size = 101;
    m->hidden_size = 16;
    m->num_hidden_layers = 3;
    m->num_attention_heads = 4;
    m->num_key_value_heads = 2;
    m->head_dim = 3;
    m->num_experts = 4;
    m->num_experts_per_tok = 2;
    m->moe_intermediate_size = 5;
    m->intermediate_size = 7;
    m->decoder_sparse_step = 1;
    c->parallel.pipeline_parallel_size = pp;
    c->parallel.expert_parallel_size = ep;
    c->parallel.reshard_after_forward = MT_TRI_TRUE;
    c->train.seq_len = 8;
    c->train.micro_batch_size = 2;
    c->train.global_batch_size = 16;
}

static inline void qwen3_30b_config(struct config *c, int pp, int ep)
{
    memset(c, 0, sizeof *c);
    struct model_config *m = &c->model;
    m->vocab_size = 151936;
    m->hidden_size = 2048;
    m->num_hidden_layers = 48;
    m->num_attention_heads = 32;
    m->num_key_value_heads = 4;
    m->head_dim = 128;
    m->num_experts = 128;
    m->num_experts_per_tok = 8;
    m->moe_intermediate_size = 768;
    m->intermediate_size = 6144;
    m->decoder_sparse_step = 1;
    c->parallel.pipeline_parallel_size = pp;
    c->parallel.expert_parallel_size = ep;
    c->train.seq_len = 4096;
    c->train.micro_batch_size = 1;
    c->train.global_batch_size = 1024;
    snprintf(c->path, sizeof c->path, "qwen3-30b-a3b (test shapes)");
}

static inline void dims(const struct config *c, int world, struct mesh_dims *d)
{
    char err[256];
    cr_assert(mesh_dims_of(c, world, d, err, sizeof err), "%s", err);
}

#endif
