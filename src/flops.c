#include "flops.h"

double flops_matmul_params_per_token(const struct model_config *m)
{
    double H = m->hidden_size, D = config_head_dim(m), Hq = m->num_attention_heads;
    double Hkv = m->num_key_value_heads, E = m->num_experts, k = m->num_experts_per_tok;
    double attn = H * Hq * D * 2 + H * Hkv * D * 2;
    double n = 0;
    for (int l = 0; l < m->num_hidden_layers; l++) {
        n += attn;
        if (config_layer_is_moe(m, l)) n += H * E + k * 3.0 * H * m->moe_intermediate_size;
        else n += 3.0 * H * m->intermediate_size;
    }
    return n + (double)m->vocab_size * H;
}

double flops_train_per_token(const struct model_config *m, int seq_len)
{
    double attn = 6.0 * m->num_hidden_layers * m->num_attention_heads * config_head_dim(m) *
                  (seq_len + 1.0);
    return 6.0 * flops_matmul_params_per_token(m) + attn;
}
