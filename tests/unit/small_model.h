/* The small model of the gradient-level tests (test_model_grad.c, test_router.c, test_documents.c):
 * 2 layers, hidden 16, 4 experts top-2 of width 8, vocabulary 40, with weights large enough
 * (initializer_range 0.2) that no gradient is tiny and an aux coefficient (0.1) large enough that
 * the aux term's gradient is a visible part of the router's. */
#ifndef MT_TEST_SMALL_MODEL_H
#define MT_TEST_SMALL_MODEL_H

#include "config.h"

static inline void small_model_config(struct model_config *mc)
{
    struct config c;
    config_defaults(&c);
    *mc = c.model;
    mc->vocab_size = 40;
    mc->hidden_size = 16;
    mc->intermediate_size = 24;
    mc->moe_intermediate_size = 8;
    mc->num_hidden_layers = 2;
    mc->num_attention_heads = 4;
    mc->num_key_value_heads = 2;
    mc->head_dim = 8;
    mc->num_experts = 4;
    mc->num_experts_per_tok = 2;
    mc->initializer_range = 0.2;
    mc->router_aux_loss_coef = 0.1;
}

#endif
