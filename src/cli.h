/* Command-line entry points. main.c parses the shared options and dispatches. */
#ifndef MT_CLI_H
#define MT_CLI_H

#include <stdbool.h>
#include <stdint.h>

struct cli {
    const char *command;       /* "train", "plan", "verify" */
    const char *config_path;   /* train, plan */
    int n_sets;                /* --set section.key=value, in order */
    char **sets;
    const char *resume;        /* --resume auto|DIR, or NULL */
    bool dry_run;              /* train --dry-run: print the layout from the real ranks and exit 0 */
    int world;                 /* plan --world N */
    int gpus_per_node;         /* plan --gpus-per-node G (default 8) */
    const char *model_dir;     /* verify MODEL_DIR */
    const char *reference;     /* verify REFERENCE.safetensors */
    double tolerance;          /* verify --tolerance (default 1e-4) */
    const char *backend;       /* --backend cpu|cuda|auto (default auto) */
    bool force;                /* --force: replace existing output (export directory) */
    const char *dtype;         /* export --dtype bf16|fp32 (default bf16) */
    uint64_t max_shard_bytes;  /* export --max-shard-bytes N (0 = 5e9) */
    const char *tokenizer_from;/* export --tokenizer DIR (default: the checkpoint's model.init_from) */
    bool forward_only;         /* verify --forward-only: logits and loss only, no gradient dump */
    const char *record;        /* route --record OUT */
    bool with_weights;         /* route --with-weights: the file carries the gate weights too */
};

int cmd_train(const struct cli *a);
int cmd_plan(const struct cli *a);
int cmd_verify(const struct cli *a);
/* route --record OUT CONFIG.yaml: a routing file for data.routing_replay (route_replay.h) */
int cmd_route(const struct cli *a);
/* export CHECKPOINT OUT_DIR: model_dir = the checkpoint, reference = the output directory */
int cmd_export(const struct cli *a);

#endif
