/* moetrain: train | plan | verify | export | route. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "common.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage:\n"
            "  moetrain train  CONFIG.yaml [--set section.key=value ...] [--resume auto|DIR] [--dry-run]\n"
            "  moetrain plan   CONFIG.yaml --world N [--gpus-per-node G] [--set ...]\n"
            "  moetrain verify MODEL_DIR|CHECKPOINT REFERENCE.safetensors [--forward-only] [--tolerance X] [--set ...]\n"
            "  moetrain export CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp32] [--max-shard-bytes N]\n"
            "                  [--tokenizer HF_DIR] [--force]   (checkpoint -> Hugging Face directory)\n"
            "  moetrain route --record OUT CONFIG.yaml [--with-weights] [--set ...]\n"
            "                                                   (routing file for data.routing_replay)\n"
            "common options: --backend cpu|cuda|auto   --help\n"
            "Launch on many ranks with: mpirun -np N moetrain train CONFIG.yaml (or srun).\n");
}

static int parse_int(const char *opt, const char *v)
{
    char *end = NULL;
    long x = strtol(v, &end, 10);
    if (!*v || *end || x <= 0 || x > 1000000000) mt_user_error("%s expects a positive integer, got '%s'", opt, v);
    return (int)x;
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    struct cli a = {.command = argv[1], .gpus_per_node = 8, .tolerance = 1e-4, .backend = "auto"};
    a.sets = calloc((size_t)argc, sizeof(char *));
    const char *pos[2] = {NULL, NULL};
    int npos = 0;
    for (int i = 2; i < argc; i++) {
        const char *s = argv[i];
        bool has_next = i + 1 < argc;
#define NEED_VALUE() do { if (!has_next) mt_user_error("option %s needs a value", s); } while (0)
        if (!strcmp(s, "--set")) {
            NEED_VALUE();
            a.sets[a.n_sets++] = argv[++i];
        } else if (!strncmp(s, "--set=", 6)) {
            a.sets[a.n_sets++] = argv[i] + 6;
        } else if (!strcmp(s, "--resume")) {
            NEED_VALUE();
            a.resume = argv[++i];
        } else if (!strcmp(s, "--record")) {
            NEED_VALUE();
            a.record = argv[++i];
        } else if (!strcmp(s, "--with-weights")) {
            a.with_weights = true;
        } else if (!strcmp(s, "--dry-run")) {
            a.dry_run = true;
        } else if (!strcmp(s, "--world")) {
            NEED_VALUE();
            a.world = parse_int(s, argv[++i]);
        } else if (!strcmp(s, "--gpus-per-node")) {
            NEED_VALUE();
            a.gpus_per_node = parse_int(s, argv[++i]);
        } else if (!strcmp(s, "--tolerance")) {
            NEED_VALUE();
            char *end = NULL;
            a.tolerance = strtod(argv[++i], &end);
            if (*end || !(a.tolerance > 0)) mt_user_error("--tolerance expects a positive number, got '%s'", argv[i]);
        } else if (!strcmp(s, "--backend")) {
            NEED_VALUE();
            a.backend = argv[++i];
            if (strcmp(a.backend, "cpu") && strcmp(a.backend, "cuda") && strcmp(a.backend, "auto"))
                mt_user_error("--backend expects cpu, cuda or auto, got '%s'", a.backend);
        } else if (!strcmp(s, "--force")) {
            a.force = true;
        } else if (!strcmp(s, "--forward-only")) {
            a.forward_only = true;
        } else if (!strcmp(s, "--dtype")) {
            NEED_VALUE();
            a.dtype = argv[++i];
            if (strcmp(a.dtype, "bf16") && strcmp(a.dtype, "fp32"))
                mt_user_error("--dtype expects bf16 or fp32, got '%s'", a.dtype);
        } else if (!strcmp(s, "--max-shard-bytes")) {
            NEED_VALUE();
            char *end = NULL;
            const char *v = argv[++i];
            errno = 0;
            unsigned long long x = strtoull(v, &end, 10);
            if (!*v || *end || *v == '-' || errno || x == 0)
                mt_user_error("--max-shard-bytes expects a positive integer, got '%s'", v);
            a.max_shard_bytes = (uint64_t)x;
        } else if (!strcmp(s, "--tokenizer")) {
            NEED_VALUE();
            a.tokenizer_from = argv[++i];
        } else if (!strcmp(s, "--help") || !strcmp(s, "-h")) {
            usage(stdout);
            return 0;
        } else if (s[0] == '-' && s[1] == '-') {
            mt_user_error("unknown option '%s' (see moetrain --help)", s);
        } else {
            if (npos == 2) mt_user_error("unexpected argument '%s' (see moetrain --help)", s);
            pos[npos++] = s;
        }
#undef NEED_VALUE
    }
    int rc;
    if (!strcmp(a.command, "train")) {
        if (npos != 1) mt_user_error("train needs exactly one CONFIG.yaml (see moetrain --help)");
        a.config_path = pos[0];
        rc = cmd_train(&a);
    } else if (!strcmp(a.command, "plan")) {
        if (npos != 1) mt_user_error("plan needs exactly one CONFIG.yaml (see moetrain --help)");
        if (a.world <= 0) mt_user_error("plan needs --world N (the number of ranks to lay out)");
        a.config_path = pos[0];
        rc = cmd_plan(&a);
    } else if (!strcmp(a.command, "verify")) {
        if (npos != 2) mt_user_error("verify needs MODEL_DIR and REFERENCE.safetensors (see moetrain --help)");
        a.model_dir = pos[0];
        a.reference = pos[1];
        rc = cmd_verify(&a);
    } else if (!strcmp(a.command, "route")) {
        if (npos != 1 || !a.record)
            mt_user_error("route needs --record OUT and exactly one CONFIG.yaml (see moetrain --help)");
        a.config_path = pos[0];
        rc = cmd_route(&a);
    } else if (!strcmp(a.command, "export")) {
        if (npos != 2) mt_user_error("export needs CHECKPOINT_DIR and OUT_DIR (see moetrain --help)");
        a.model_dir = pos[0];
        a.reference = pos[1];
        rc = cmd_export(&a);
    } else {
        mt_user_error("unknown command '%s' (expected train, plan, verify, export or route)", a.command);
    }
    free(a.sets);
    return rc;
}
