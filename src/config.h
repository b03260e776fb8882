/* The run configuration: typed structs filled from a YAML file (libyaml), defaults, --set overrides,
 * and optionally a Hugging Face config.json for the model section (both the 4.x and 5.x spellings).
 * Every section/key name here is stable: users' configs and scripts depend on them (design.md). */
#ifndef MT_CONFIG_H
#define MT_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "common.h"

#define MT_MAX_LAYERS 1024

enum mt_precision { MT_PREC_BF16 = 0, MT_PREC_FP32 = 1 };
enum mt_load_balance { MT_LB_AUX = 0, MT_LB_BIAS = 1, MT_LB_NONE = 2 };
enum mt_data_kind { MT_DATA_SYNTHETIC = 0, MT_DATA_TOKENS = 1 };
enum mt_backend_choice { MT_BACKEND_AUTO = 0, MT_BACKEND_CPU = 1, MT_BACKEND_CUDA = 2 };
/* A boolean setting that may also be left to the program (`auto`). */
enum mt_tri { MT_TRI_FALSE = 0, MT_TRI_TRUE = 1, MT_TRI_AUTO = 2 };
/* parallel.reduce_grads: reduce-scatter a sharded unit's gradients after every micro-step's
 * backward (one unit's fp32 buffer), or accumulate them unsharded over the step and reduce once;
 * auto: once a step where the plan with it fits the device (memory_estimate.h) */
enum mt_reduce_grads { MT_REDUCE_MICRO_STEP = 0, MT_REDUCE_STEP = 1, MT_REDUCE_AUTO = 2 };
/* train.weight_copy: keep a compute-dtype copy of the shard, or cast the master at every gather */
enum mt_weight_copy { MT_COPY_AUTO = 0, MT_COPY_KEEP = 1, MT_COPY_CAST = 2 };
enum mt_state_dtype { MT_STATE_FP32 = 0, MT_STATE_BF16 = 1 };
/* train.master_weights: the fp32 master as one array, or split into the bf16 compute copy and its
 * low 16 bits (src/master_split.h); auto: split where that copy exists (config_resolve_master_weights) */
enum mt_master_weights { MT_MASTER_FP32 = 0, MT_MASTER_SPLIT = 1, MT_MASTER_AUTO = 2 };
enum mt_scoring { MT_SCORE_SOFTMAX = 0, MT_SCORE_SIGMOID = 1 };
enum mt_aux_scope { MT_AUX_MICRO_BATCH = 0, MT_AUX_GLOBAL_BATCH = 1 };
enum mt_nonfinite { MT_NONFINITE_SKIP = 0, MT_NONFINITE_STOP = 1 };

struct model_config {
    char hf_config[MT_PATH_MAX];  /* path to a config.json; its fields fill the ones below */
    char init_from[MT_PATH_MAX];  /* HF model directory or checkpoint directory; "" = random init */
    int vocab_size;
    int hidden_size;              /* H */
    int intermediate_size;        /* dense MLP width (layers in mlp_only_layers / decoder_sparse_step) */
    int moe_intermediate_size;    /* I, per expert */
    int num_hidden_layers;        /* L */
    int num_attention_heads;      /* Hq */
    int num_key_value_heads;      /* Hkv */
    int head_dim;                 /* D; 0 = hidden_size / num_attention_heads */
    int num_experts;              /* E; 0 = every layer dense */
    int num_experts_per_tok;      /* k */
    int decoder_sparse_step;      /* layer i is MoE iff (i+1) % step == 0 and i not in mlp_only_layers */
    int n_mlp_only_layers;
    int mlp_only_layers[MT_MAX_LAYERS];
    bool norm_topk_prob;
    bool tie_word_embeddings;
    double rope_theta;
    double rms_norm_eps;
    double router_aux_loss_coef;
    double initializer_range;
    int max_position_embeddings;  /* recorded only; default RoPE ignores it */
    enum mt_precision precision;  /* bf16 | fp32 (GPU); the CPU backend always computes in fp32 */
    bool router_fp32;             /* router logits/softmax in fp32 (GPU) */
    bool freeze_router;           /* router weight gets no update at all */
    bool train_router;            /* false: routing weights detached before they scale the experts'
                                   * outputs (the router learns from the aux loss only) */
    bool router_weight_decay;     /* apply weight decay to the router weight */
    /* routing variants (docs/router.md); the defaults are Qwen3-MoE's router */
    enum mt_scoring scoring;      /* softmax | sigmoid */
    double route_scale;           /* routing weights × this after the renormalisation */
    int n_group;                  /* experts in n_group equal groups; 1 = no group limit */
    int topk_group;               /* groups a token may use; 0 = all n_group */
    bool debug_force_balance;     /* round-robin routing, for benchmarks */
};

struct parallel_config {
    int pipeline_parallel_size;   /* pp */
    int expert_parallel_size;     /* ep; ep_fsdp = ranks per stage / ep */
    bool ep_outside;              /* local = e*ep_fsdp + f instead of f*ep + e */
    int n_pipeline_layers;        /* 0 = split the layers evenly over the stages */
    int pipeline_layers[MT_MAX_LAYERS]; /* layers of each stage, in order; sums to num_hidden_layers */
    enum mt_backend_choice backend; /* auto | cpu | cuda */
    enum mt_tri reshard_after_forward; /* free a layer's gathered weights after its forward (FSDP);
                                        * auto: false where the plan without it fits */
    bool prefetch;                /* gather the next layer while this one computes (FSDP) */
    enum mt_reduce_grads reduce_grads; /* micro_step | step | auto (FSDP) */
    int moe_chunks;               /* MoE exchange in this many chunks overlapping the expert GEMMs */
    enum mt_tri moe_fixed_exchange; /* MoE exchange without host waits (model.h fixed_exchange);
                                     * auto: on with ep > 1, moe_chunks 1 and no pipeline */
    enum mt_tri expert_wgrad_pairs; /* two micro-steps' expert weight gradients in one GEMM (model.h
                                     * struct expert_wgrad_stash); auto: on a GPU where it fits */
    int wgrad_pair_layers;        /* not a key: with expert_wgrad_pairs true, how many of each stage's
                                   * MoE layers (its first ones) pair; auto resolves it to what fits
                                   * (MT_MAX_LAYERS = all, the default) */
    int expert_wgrad_group;       /* micro-steps a grouping layer's expert weight gradients wait for:
                                   * 2 .. MT_WGRAD_MAX_SETS, 0 = auto (2, and 4 in the layers where
                                   * that fits too, 8 in every layer where that fits) */
    bool moe_combine_self_last;   /* the forward combine's rows for other ranks computed and sent
                                   * first, this rank's own under their transfer; the dispatch's own
                                   * token rows read from this rank's memory, the all-gathers without
                                   * their copy to self (moe_dispatch.c; ep > 1, moe_chunks 1) */
    bool expert_wgrad_jobs;       /* grouped expert wgrads fill later exchanges' waits
                                   * (moe_wgrad_jobs.h; EP > 1 with expert_wgrad_pairs) */
    int wgrad_group_layers;       /* not a key: how many of the pairing layers (their first ones) take
                                   * groups of wgrad_group micro-steps instead of 2 */
    int wgrad_group;              /* not a key: the resolved group of those layers (2 .. 8) */
    int wgrad_big_layers;         /* not a key: of the grouping layers, how many (their first ones) take
                                   * groups of MT_WGRAD_AUTO_GROUP_MAX instead (auto,
                                   * where not every layer fits them; MT_WGRAD_GROUP_MIX=0: none) */
    bool stash_in_grads;          /* not a key: the parked expert rows lie in lower layers' expert
                                   * gradients where they fit (MT_STASH_IN_GRADS, stash_place.h) */
};

struct train_config {
    int steps;
    int seq_len;
    int global_batch_size;        /* sequences per optimizer step, whole job */
    int micro_batch_size;         /* sequences per rank per micro-step */
    double lr;
    double min_lr;
    int warmup_steps;
    double weight_decay;
    double beta1, beta2, adam_eps;
    double grad_clip;             /* 0 = off */
    uint64_t seed;
    bool activation_checkpointing;
    enum mt_load_balance load_balance;  /* aux | bias | none */
    double bias_update_rate;      /* aux-loss-free balancing: bias += rate * sign(mean - load) */
    enum mt_weight_copy weight_copy;   /* compute copy of the shard: auto | keep | cast */
    enum mt_state_dtype optimizer_state_dtype; /* Adam moments: fp32 | bf16 */
    enum mt_master_weights master_weights; /* fp32 | split | auto (resolved before use) */
    int watchdog_s;               /* seconds without progress before the job aborts; 0 = off */
    char no_decay_modules[512];   /* "[gate, norm, ...]": modules without weight decay (router_params.h) */
    enum mt_aux_scope aux_loss_scope; /* micro_batch | global_batch: what the aux statistic pools */
    enum mt_nonfinite nonfinite;  /* a step with a non-finite loss or gradient norm: skip | stop */
    int max_skipped_steps;        /* consecutive skipped steps that stop the run */
    double spike_factor;          /* skip a step whose loss > factor x recent mean; 0 = off */
};

struct data_config {
    enum mt_data_kind kind;       /* synthetic | tokens */
    char path[MT_PATH_MAX];       /* kind tokens: token files, directories or globs, comma-separated */
    char sources[MT_PATH_MAX];    /* blended datasets "PATH:WEIGHT,..." ("" = data.path alone) */
    bool shuffle;                 /* permute each dataset's sequences, per epoch, from data.seed */
    uint64_t seed;                /* shuffling and blending order */
    int eos_id;                   /* document separator token; -1 = none */
    bool document_masking;        /* attention and positions restart after each eos_id */
    bool loss_after_eos;          /* false: no loss on predicting a document's first token */
    char validation_path[MT_PATH_MAX];  /* held-out token files ("" = no validation) */
    int validation_interval;      /* steps between validation passes */
    int validation_batches;       /* global batches per validation pass */
    int synthetic_branching;      /* successors per state of the synthetic Markov chain */
    uint64_t synthetic_seed;
    char routing_replay[MT_PATH_MAX]; /* routing file (route_replay.h) the MoE layers follow; "" = none */
};

struct ckpt_config {
    char dir[MT_PATH_MAX];        /* "" = no checkpoints */
    int interval;                 /* steps between checkpoints; 0 = only at the end */
    int keep;                     /* newest checkpoints kept; 0 = all */
    char export_hf[MT_PATH_MAX];  /* after training, write a Hugging Face model directory here
                                   * (docs/export.md); "" = none */
    enum mt_precision export_dtype;   /* bf16 (default) | fp32 weights in the export */
    uint64_t export_shard_bytes;      /* tensor data per safetensors shard (default 5e9) */
};

struct log_config {
    int interval;                 /* steps between step lines */
    char metrics[MT_PATH_MAX];    /* JSONL file, "" = none */
    bool profile;                 /* time every op by category (synchronises after each op) */
    int collapse_steps;           /* warn when an expert got no tokens for this many steps; 0 = off */
    double load_warn;             /* warn when a layer's max/mean expert load exceeds this; 0 = off */
};

struct config {
    char path[MT_PATH_MAX];       /* the YAML file it came from ("" for defaults only) */
    struct model_config model;
    struct parallel_config parallel;
    struct train_config train;
    struct data_config data;
    struct ckpt_config checkpoint;
    struct log_config log;
};

/* Defaults (a tiny model) for every field. */
void config_defaults(struct config *c);

/* Load YAML file `path` over the defaults, then apply `n_sets` overrides "section.key=value", then
 * resolve model.hf_config (JSON fields fill the model section unless also set in YAML or --set), then
 * validate. Any problem: mt_user_error naming file:line:column and the problem (nearest valid key
 * suggested for typos). */
void config_load(struct config *c, const char *path, int n_sets, char **sets);

/* Same as config_load but returns false and writes the one-line message into err instead of exiting
 * (for tests and for tools that want to report themselves). */
bool config_load_checked(struct config *c, const char *path, int n_sets, char **sets,
                         char *err, int errcap);

/* Same as config_load_checked for YAML text already in memory (a checkpoint manifest); `name` is
 * used in messages and as the directory for a relative model.hf_config (may be NULL). */
bool config_load_string_checked(struct config *c, const char *name, const char *yaml, size_t len,
                                int n_sets, char **sets, char *err, int errcap);

/* The checks config_load runs after merging (ranges, heads % kv_heads, min_lr <= lr, ...), for
 * configs built in code. */
bool config_validate(struct config *c, char *err, int errcap);

/* Fill the model section from a Hugging Face config.json (both spellings). */
bool config_read_hf_json(struct model_config *m, const char *json_path, char *err, int errcap);

/* Derived facts. */
int config_head_dim(const struct model_config *m);
bool config_layer_is_moe(const struct model_config *m, int layer);
/* Whether MoE layers take the fixed exchange (parallel.moe_fixed_exchange, model.h fixed_exchange):
 * true / false as set; auto: with expert_parallel_size > 1, moe_chunks 1, no pipeline, and blocks
 * of T pairs that uniform top-k routing would fill to 75% or more (1 - (1 - 1/ep)^k >= 0.75: ep <= 6
 * at top-8, ep 2 at top-2), since the padding crosses the wire too. */
bool config_moe_fixed_exchange(const struct config *c);
/* train.master_weights auto, resolved to split where the master's high half can be the kept bf16
 * compute copy (model.precision bf16, a backend computing in bf16: bf16_compute, train.weight_copy
 * not cast), to fp32 elsewhere; split and fp32 stay as set. Before anything sizes the shard. */
void config_resolve_master_weights(struct config *c, bool bf16_compute);

/* Print the config as YAML (rank 0 start-up table, checkpoint manifests). Returns chars written. */
int config_to_yaml(const struct config *c, char *buf, int cap);

#endif
