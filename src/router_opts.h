/* The router's knobs outside the ops (docs/router.md): the routing options of a model config, and
 * train.no_decay_modules (which parameter groups AdamW's weight decay skips). */
#ifndef MT_ROUTER_OPTS_H
#define MT_ROUTER_OPTS_H

#include <stdbool.h>
#include <stddef.h>

#include "config.h"
#include "ops.h"
#include "tensors.h"

/* The router ops' options for model config mc (topk_group 0 -> n_group). */
struct router_opts router_opts_of(const struct model_config *mc);

/* The routing checks config validation runs: n_group divides num_experts (and is <= 64),
 * topk_group <= n_group, and top-k fits in the topk_group groups a token may use. On failure
 * writes a one-line message naming the keys and returns false. */
bool router_opts_check(const struct model_config *mc, char *err, size_t cap);

/* Module names of train.no_decay_modules and the tensors each covers:
 *   gate     the MoE router weight (mlp.gate.weight)
 *   norm     every RMSNorm weight (input/post-attention layernorms, q_norm, k_norm, model.norm)
 *   embed    model.embed_tokens.weight
 *   lm_head  lm_head.weight (nothing with tie_word_embeddings)
 *   attn     q_proj, k_proj, v_proj, o_proj
 *   experts  the routed experts' gate_up_proj and down_proj
 *   mlp      the dense MLP layers' gate_up_proj and down_proj */
enum no_decay_module { ND_GATE, ND_NORM, ND_EMBED, ND_LM_HEAD, ND_ATTN, ND_EXPERTS, ND_MLP, ND_COUNT };

/* Parses "[gate, norm]" / "gate,norm" / "" into a bit mask over enum no_decay_module; an unknown or
 * repeated name is a one-line error naming the key and the known names. */
bool no_decay_parse(const char *text, unsigned *mask, char *err, size_t cap);

/* Applies train.no_decay_modules to the tensor table (before params_init reads the flags): with
 * a non-empty list, exactly the listed modules' tensors skip weight decay; with "" the table's
 * defaults stay (norms skip it; the router unless model.router_weight_decay). */
void no_decay_apply(struct tensor_table *tt, const char *list);

/* The start-up line naming what weight decay skips, e.g. "gate, norm (25 tensors)". */
void no_decay_describe(const struct tensor_table *tt, char *buf, size_t cap);

#endif
