#include "hf_export.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "hf_load.h"

bool hf_write_config_json(const char *path, const struct model_config *m, char *err, int errcap)
{
    json_t *o = json_object();
    json_t *layers = json_array();
    for (int i = 0; i < m->n_mlp_only_layers; i++) json_array_append_new(layers, json_integer(m->mlp_only_layers[i]));
#define SET(k, v) json_object_set_new(o, k, v)
    SET("architectures", json_pack("[s]", "Qwen3MoeForCausalLM"));
    SET("model_type", json_string("qwen3_moe"));
    SET("vocab_size", json_integer(m->vocab_size));
    SET("hidden_size", json_integer(m->hidden_size));
    SET("intermediate_size", json_integer(m->intermediate_size));
    SET("moe_intermediate_size", json_integer(m->moe_intermediate_size));
    SET("num_hidden_layers", json_integer(m->num_hidden_layers));
    SET("num_attention_heads", json_integer(m->num_attention_heads));
    SET("num_key_value_heads", json_integer(m->num_key_value_heads));
    SET("head_dim", json_integer(config_head_dim(m)));
    SET("num_experts", json_integer(m->num_experts));
    SET("num_experts_per_tok", json_integer(m->num_experts_per_tok));
    SET("decoder_sparse_step", json_integer(m->decoder_sparse_step));
    SET("mlp_only_layers", layers);
    SET("norm_topk_prob", json_boolean(m->norm_topk_prob));
    SET("tie_word_embeddings", json_boolean(m->tie_word_embeddings));
    SET("rope_theta", json_real(m->rope_theta));
    SET("rope_scaling", json_null());
    SET("rms_norm_eps", json_real(m->rms_norm_eps));
    SET("router_aux_loss_coef", json_real(m->router_aux_loss_coef));
    SET("initializer_range", json_real(m->initializer_range));
    SET("max_position_embeddings", json_integer(m->max_position_embeddings));
    SET("hidden_act", json_string("silu"));
    SET("attention_bias", json_false());
    SET("attention_dropout", json_real(0.0));
    SET("use_sliding_window", json_false());
    SET("output_router_logits", json_false());
    SET("torch_dtype", json_string("float32"));
#undef SET
    int rc = json_dump_file(o, path, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(o);
    if (rc != 0) {
        snprintf(err, (size_t)errcap, "%s: cannot write config.json: %s", path, strerror(errno));
        return false;
    }
    return true;
}

bool hf_export_model(const char *dir, const struct model_config *m, const struct tensor_table *tt,
                     const float *const global[TG_COUNT], char *err, int errcap)
{
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
        snprintf(err, (size_t)errcap, "%s: cannot create the export directory: %s", dir, strerror(errno));
        return false;
    }
    char path[MT_PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (!hf_write_config_json(path, m, err, errcap)) return false;
    return hf_save_weights(dir, tt, global, "F32", err, errcap);
}
