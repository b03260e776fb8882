/* `moetrain plan` and the layout table it shares with `train --dry-run`.
 *
 * Cost: O(tensors) per stage for the memory estimate plus O(world) for rows, groups and node checks;
 * every rank of a stage has the same padded shard sizes, so no per-rank tensor walk is needed.
 * Tables of more than PLAN_FULL_TABLE_MAX ranks show their first and last PLAN_EDGE_ROWS rows only
 * (the elided rows follow the same formulas; `plan` with a smaller --world shows a full table). */
#include "plan.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "common.h"
#include "memory_estimate.h"
#include "tensors.h"


/* Largest --world plan accepts: it keeps one int per rank. */
#define PLAN_MAX_WORLD (1 << 22)

static void human_count(char *buf, size_t cap, int64_t n)
{
    const double x = (double)n;
    if (x >= 1e9) snprintf(buf, cap, "%.2f B", x / 1e9);
    else if (x >= 1e6) snprintf(buf, cap, "%.2f M", x / 1e6);
    else if (x >= 1e3) snprintf(buf, cap, "%.2f K", x / 1e3);
    else snprintf(buf, cap, "%" PRId64, n);
}

/* One communicator group, its members generated from the grid formulas (no per-rank tables). */
struct group_iter {
    const struct mesh_dims *d;
    int kind, a, b;  /* kind 0 EP (a stage, b f), 1 EP_FSDP (a stage, b e), 2 stage (a), 3 PP (a local) */
};

/* Member i of the group, in communicator rank order. */
static int group_member(const struct group_iter *g, int i)
{
    switch (g->kind) {
    case 0: return mesh_rank_of(g->d, g->a, i, g->b);
    case 1: return mesh_rank_of(g->d, g->a, g->b, i);
    case 2: return g->a * g->d->S + i;
    default: return i * g->d->S + g->a;
    }
}

static int group_size(const struct group_iter *g)
{
    switch (g->kind) {
    case 0: return g->d->ep;
    case 1: return g->d->ep_fsdp;
    case 2: return g->d->S;
    default: return g->d->pp;
    }
}

/* "[a b c]" for groups of up to 16 ranks, "[8 first ... last 2] (n ranks)" for longer ones. */
static void print_group(FILE *f, const struct group_iter *g)
{
    const int n = group_size(g);
    fputc('[', f);
    for (int i = 0; i < n; i++) {
        if (n > 16 && i == 8) {
            fprintf(f, " ...");
            i = n - 3;
            continue;
        }
        fprintf(f, i ? " %d" : "%d", group_member(g, i));
    }
    fputc(']', f);
    if (n > 16) fprintf(f, " (%d ranks)", n);
    fputc('\n', f);
}

static void print_groups(FILE *f, const struct mesh_dims *d)
{
    static const char *title[4] = {
        "EP groups (same stage and ep_fsdp rank f; expert all-to-all)",
        "EP_FSDP groups (same stage and ep rank e; hold the same experts)",
        "stage groups (one stage; FSDP of non-expert weights, data parallel)",
        "PP groups (same local index; one pipeline)",
    };
    const int count[4] = {d->pp * d->ep_fsdp, d->pp * d->ep, d->pp, d->S};
    fprintf(f, "\ncommunicator groups:\n");
    for (int k = 0; k < 4; k++) {
        struct group_iter g = {.d = d, .kind = k};
        fprintf(f, "  %s: %d group%s of %d rank%s\n", title[k], count[k], count[k] == 1 ? "" : "s",
                group_size(&g), group_size(&g) == 1 ? "" : "s");
        const int shown = MT_MIN(count[k], PLAN_MAX_GROUPS);
        for (int i = 0; i < shown; i++) {
            switch (k) {
            case 0: g.a = i / d->ep_fsdp; g.b = i % d->ep_fsdp;
                fprintf(f, "    stage %d f %d: ", g.a, g.b); break;
            case 1: g.a = i / d->ep; g.b = i % d->ep;
                fprintf(f, "    stage %d e %d: ", g.a, g.b); break;
            case 2: g.a = i; fprintf(f, "    stage %d: ", g.a); break;
            default: g.a = i; fprintf(f, "    local %d: ", g.a); break;
            }
            print_group(f, &g);
        }
        if (count[k] > shown) fprintf(f, "    ... %d more\n", count[k] - shown);
    }
}

/* One warning line when EP groups span nodes: their all-to-all then crosses the network. */
static void print_ep_node_warning(FILE *f, const struct mesh_dims *d, const int *node_of_rank)
{
    int spanning = 0, first = -1, first_lo = 0, first_hi = 0;
    const int n_groups = d->pp * d->ep_fsdp;
    for (int i = 0; i < n_groups; i++) {
        struct group_iter g = {.d = d, .kind = 0, .a = i / d->ep_fsdp, .b = i % d->ep_fsdp};
        int lo = node_of_rank[group_member(&g, 0)], hi = lo;
        for (int e = 1; e < d->ep; e++) {
            int nd = node_of_rank[group_member(&g, e)];
            lo = MT_MIN(lo, nd);
            hi = MT_MAX(hi, nd);
        }
        if (lo != hi) {
            if (first < 0) { first = i; first_lo = lo; first_hi = hi; }
            spanning++;
        }
    }
    if (!spanning) return;
    fprintf(f, "\nwarning: %d of %d EP groups span more than one node (first: stage %d f %d on nodes %d..%d); "
            "their all-to-all crosses the network (ep_outside: false keeps an EP group on consecutive ranks)\n",
            spanning, n_groups, first / d->ep_fsdp, first % d->ep_fsdp, first_lo, first_hi);
}

static void print_header(FILE *f, const struct config *c, const struct mesh_dims *d,
                         const struct tensor_table *tt, int n_nodes)
{
    const struct model_config *m = &c->model;
    const struct train_config *t = &c->train;
    struct model_counts mc;
    estimate_model_counts(tt, m, &mc);
    int n_moe = 0;
    for (int l = 0; l < m->num_hidden_layers; l++) n_moe += config_layer_is_moe(m, l);
    char tot[32], act[32], ex[32], nex[32];
    human_count(tot, sizeof tot, mc.total);
    human_count(act, sizeof act, mc.active);
    human_count(ex, sizeof ex, mc.expert);
    human_count(nex, sizeof nex, mc.non_expert);

    fprintf(f, "moetrain layout: %s\n", c->path[0] ? c->path : "(defaults)");
    fprintf(f, "model: %d layers (%d MoE, %d dense), hidden %d, heads %d q / %d kv x head_dim %d, vocab %d, ",
            m->num_hidden_layers, n_moe, m->num_hidden_layers - n_moe, m->hidden_size,
            m->num_attention_heads, m->num_key_value_heads, config_head_dim(m), m->vocab_size);
    if (m->num_experts > 0)
        fprintf(f, "experts %d (top-%d, width %d)", m->num_experts, m->num_experts_per_tok,
                m->moe_intermediate_size);
    else
        fprintf(f, "no experts");
    /* bf16 is a GPU setting: the CPU backend computes in fp32 whatever model.precision says */
    const char *prec = m->precision == MT_PREC_FP32 ? "fp32" :
                       c->parallel.backend == MT_BACKEND_CPU ? "fp32 (CPU backend; model.precision bf16 is for the GPU)" :
                       c->parallel.backend == MT_BACKEND_AUTO ? "bf16 on the GPU (the CPU backend computes in fp32)" :
                       "bf16";
    fprintf(f, ", tied embeddings %s, precision %s\n", m->tie_word_embeddings ? "yes" : "no", prec);
    fprintf(f, "parameters: %" PRId64 " total (%s; expert %s, non-expert %s), %" PRId64
            " active per token (%s)\n", mc.total, tot, ex, nex, mc.active, act);
    fprintf(f, "mesh: world %d = pp %d x %d ranks per stage (ep %d x ep_fsdp %d), ep_outside %s, nodes %d\n",
            d->world, d->pp, d->S, d->ep, d->ep_fsdp, d->ep_outside ? "true" : "false", n_nodes);
    const int64_t per_micro = (int64_t)d->S * t->micro_batch_size;
    fprintf(f, "batch: %d sequences x %d tokens per step; micro_batch_size %d per rank, data parallel %d",
            t->global_batch_size, t->seq_len, t->micro_batch_size, d->S);
    if (per_micro > 0 && t->global_batch_size > 0 && t->global_batch_size % per_micro == 0)
        fprintf(f, ", %" PRId64 " micro-batches per step", t->global_batch_size / per_micro);
    else
        fprintf(f, " (global_batch_size is not a multiple of %" PRId64 ")", per_micro);
    fprintf(f, "; activation checkpointing %s\n", t->activation_checkpointing ? "on" : "off");
}

/* "16x192x2048" for the expert tensor of role `role` in layer l held by EP_FSDP rank fr. */
static void expert_shape(char *buf, size_t cap, const struct tensor_table *tt, const struct mesh_dims *d,
                         int role, int layer, int er, int fr)
{
    int i = tensor_lookup(tt, (enum tensor_role)role, layer);
    if (i < 0) {
        snprintf(buf, cap, "-");
        return;
    }
    struct tensor_shard sh;
    tensor_shard_of(&tt->t[i], d->ep, er, d->ep_fsdp, fr, d->S, 0, &sh);
    snprintf(buf, cap, "%" PRId64 "x%" PRId64 "x%" PRId64, sh.ne, sh.nr, sh.row_elems);
}

static void print_row(FILE *f, const struct config *c, const struct mesh_dims *d,
                      const struct tensor_table *tt, const struct stage_estimate *st,
                      const int *first_moe, const int *node_of_rank, int g, double unit)
{
    struct mesh_coord co;
    mesh_coord_of(d, g, &co);
    const struct stage_estimate *e = &st[co.stage];
    char layers[32], experts[32], gu[48], dn[48];
    snprintf(layers, sizeof layers, "[%d,%d)", e->layer0, e->layer1);
    if (c->model.num_experts > 0) {
        int e0, e1;
        mesh_expert_range(c->model.num_experts, d->ep, co.ep_rank, &e0, &e1);
        snprintf(experts, sizeof experts, "[%d,%d)", e0, e1);
    } else {
        snprintf(experts, sizeof experts, "-");
    }
    if (first_moe[co.stage] >= 0) {
        expert_shape(gu, sizeof gu, tt, d, TR_EXP_GATE_UP, first_moe[co.stage], co.ep_rank, co.fsdp_rank);
        expert_shape(dn, sizeof dn, tt, d, TR_EXP_DOWN, first_moe[co.stage], co.ep_rank, co.fsdp_rank);
    } else {
        snprintf(gu, sizeof gu, "-");
        snprintf(dn, sizeof dn, "-");
    }
    fprintf(f, "%6d %5d %5d %-10s %4d %5d %-11s %17s %17s %12" PRId64 " %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f\n",
            g, node_of_rank[g], co.stage, layers, co.ep_rank, co.fsdp_rank, experts, gu, dn,
            e->dense_numel, e->param_bytes / unit, e->grad_bytes / unit, e->master_bytes / unit,
            e->adam_bytes / unit, e->act_bytes / unit, e->buffer_bytes / unit, e->total_bytes / unit);
}

/* "a" or "a-b" */
static void span(char *buf, size_t cap, int a, int b)
{
    if (a == b) snprintf(buf, cap, "%d", a);
    else snprintf(buf, cap, "%d-%d", a, b);
}

/* The folded table: every rank of a stage has the same layers, shard shapes and memory (the padded
 * shards are equal), so one row per stage with the ranges of ranks, nodes, EP and EP_FSDP ranks. */
static void print_stage_row(FILE *f, const struct config *c, const struct mesh_dims *d,
                            const struct tensor_table *tt, const struct stage_estimate *e, int first_moe,
                            const int *node_of_rank, double unit)
{
    const int g0 = e->stage * d->S, g1 = g0 + d->S - 1;
    int n0 = node_of_rank[g0], n1 = n0;
    for (int g = g0; g <= g1; g++) {
        n0 = MT_MIN(n0, node_of_rank[g]);
        n1 = MT_MAX(n1, node_of_rank[g]);
    }
    char ranks[32], nodes[32], layers[32], eps[16], fs[16], experts[32], gu[48], dn[48];
    span(ranks, sizeof ranks, g0, g1);
    span(nodes, sizeof nodes, n0, n1);
    span(eps, sizeof eps, 0, d->ep - 1);
    span(fs, sizeof fs, 0, d->ep_fsdp - 1);
    snprintf(layers, sizeof layers, "[%d,%d)", e->layer0, e->layer1);
    if (c->model.num_experts > 0) snprintf(experts, sizeof experts, "%d each", c->model.num_experts / d->ep);
    else snprintf(experts, sizeof experts, "-");
    if (first_moe >= 0) {
        expert_shape(gu, sizeof gu, tt, d, TR_EXP_GATE_UP, first_moe, 0, 0);
        expert_shape(dn, sizeof dn, tt, d, TR_EXP_DOWN, first_moe, 0, 0);
    } else {
        snprintf(gu, sizeof gu, "-");
        snprintf(dn, sizeof dn, "-");
    }
    fprintf(f, "%11s %7s %5d %-10s %4s %5s %-11s %17s %17s %12" PRId64 " %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f\n",
            ranks, nodes, e->stage, layers, eps, fs, experts, gu, dn, e->dense_numel, e->param_bytes / unit,
            e->grad_bytes / unit, e->master_bytes / unit, e->adam_bytes / unit, e->act_bytes / unit,
            e->buffer_bytes / unit, e->total_bytes / unit);
}

void plan_print(FILE *f, const struct config *c, const struct mesh_dims *d, const int *node_of_rank)
{
    plan_print_opts(f, c, d, node_of_rank, false, PLAN_DEVICE_BYTES);
}

void plan_print_opts(FILE *f, const struct config *c_in, const struct mesh_dims *d, const int *node_of_rank,
                     bool fold, double device_bytes)
{
    /* the layout as it would run on GPUs of device_bytes (on the CPU backend: no device), the auto
     * FSDP settings resolved as train resolves them */
    struct config *c = mt_malloc(sizeof *c);
    *c = *c_in;
    const double device = c_in->parallel.backend == MT_BACKEND_CPU ? 0 : device_bytes;
    config_resolve_master_weights(c, device > 0);
    const bool keep = estimate_keep_copy(c, d, device);
    c->parallel.reduce_grads = estimate_reduce_grads(c, d, keep, device);
    c->parallel.reshard_after_forward = estimate_reshard(c, d, keep, device) ? MT_TRI_TRUE : MT_TRI_FALSE;
    /* kept as auto (counted as off) where train would refuse it: its error comes from train */
    if (c->parallel.expert_wgrad_pairs != MT_TRI_TRUE || estimate_expert_grads_kept(c, d))
        estimate_resolve_expert_wgrad_pairs(c, d, keep, device);
    struct tensor_table tt;
    tensor_table_build(&tt, &c->model);
    int n_nodes = 0;
    for (int g = 0; g < d->world; g++) n_nodes = MT_MAX(n_nodes, node_of_rank[g] + 1);

    struct stage_estimate *st = mt_calloc((size_t)d->pp, sizeof *st);
    int *first_moe = mt_malloc((size_t)d->pp * sizeof *first_moe);
    double max_total = 0;
    for (int s = 0; s < d->pp; s++) {
        estimate_stage(c, &tt, d, s, estimate_keep_copy(c, d, device), &st[s]);
        max_total = MT_MAX(max_total, st[s].total_bytes);
        first_moe[s] = -1;
        for (int l = st[s].layer0; l < st[s].layer1 && first_moe[s] < 0; l++)
            if (config_layer_is_moe(&c->model, l)) first_moe[s] = l;
    }
    const bool gib = max_total >= 1024.0 * 1024 * 1024;
    const double unit = gib ? 1024.0 * 1024 * 1024 : 1024.0 * 1024;

    print_header(f, c, d, &tt, n_nodes);
    char on[96] = "";
    if (device > 0)
        snprintf(on, sizeof on, ", auto settings as on GPUs of %.1f GiB", device / (1024.0 * 1024 * 1024));
    fprintf(f, "\nper-rank layout; memory per rank in %s (estimate%s; legend below)\n", gib ? "GiB" : "MiB", on);
    if (fold) {
        fprintf(f, "%11s %7s %5s %-10s %4s %5s %-11s %17s %17s %12s %8s %8s %8s %8s %8s %8s %8s\n", "ranks",
                "nodes", "stage", "layers", "ep", "fsdp", "experts", "gate_up shard", "down shard",
                "non-expert", "params", "grads", "master", "adam", "acts", "buffers", "total");
        for (int s = 0; s < d->pp; s++) print_stage_row(f, c, d, &tt, &st[s], first_moe[s], node_of_rank, unit);
    }
    else
        fprintf(f, "%6s %5s %5s %-10s %4s %5s %-11s %17s %17s %12s %8s %8s %8s %8s %8s %8s %8s\n", "rank",
                "node", "stage", "layers", "ep", "fsdp", "experts", "gate_up shard", "down shard",
                "non-expert", "params", "grads", "master", "adam", "acts", "buffers", "total");
    const bool elide = d->world > PLAN_FULL_TABLE_MAX;
    for (int g = 0; g < d->world && !fold; g++) {
        if (elide && g == PLAN_EDGE_ROWS) {
            fprintf(f, "%6s ... %d ranks not shown (the table is complete up to %d ranks) ...\n", "",
                    d->world - 2 * PLAN_EDGE_ROWS, PLAN_FULL_TABLE_MAX);
            g = d->world - PLAN_EDGE_ROWS;
        }
        print_row(f, c, d, &tt, st, first_moe, node_of_rank, g, unit);
    }
    const bool fp32 = c->model.precision == MT_PREC_FP32;
    fprintf(f, "legend: experts = experts held [a,b); gate_up/down shard = experts x dim-1 rows held x dim 2 "
            "(dim 1 split across ep_fsdp); non-expert = elements of the non-expert shard (each layer's "
            "non-expert tensors cut in equal chunks across the stage)\n");
    const char *work_g = c->parallel.reduce_grads == MT_REDUCE_STEP
                             ? "every unit's working gradient (parallel.reduce_grads: step)"
                         : c->parallel.prefetch ? "one unit's working gradient and one layer's for the overlapped reduce-scatter"
                                                : "one unit's working gradient";
    fprintf(f, "  params = %s working weights: %s, plus layer buffers where a unit is gathered (or cast) per "
            "use (%s); grads = the fp32 gradient of the shard plus %s where the group has several ranks; "
            "master = %s; adam = the two moments of the shard (%s)\n",
            fp32 ? "fp32" : "bf16",
            estimate_keep_copy(c, d, device) ? "the shard's kept compute copy (train.weight_copy)"
                                                        : "no kept copy (train.weight_copy: cast)",
            c->parallel.reshard_after_forward != MT_TRI_FALSE ? "one of the largest unit, one of the largest layer"
                                              : "every unit's, parallel.reshard_after_forward: false",
            work_g,
            c->train.master_weights == MT_MASTER_SPLIT
                ? "the low 16 bits of the shard's fp32 master weights (train.master_weights: split; the high half is the "
                  "kept bf16 copy)"
                : "fp32 master weights of the shard",
            c->train.optimizer_state_dtype == MT_STATE_BF16 ? "bf16" : "fp32");
    int stage_moe = 0; /* the most MoE layers of a stage */
    for (int s = 0; s < d->pp; s++) stage_moe = MT_MAX(stage_moe, st[s].n_moe_layers);
    const int paired = c->parallel.expert_wgrad_pairs == MT_TRI_TRUE ? MT_MIN(c->parallel.wgrad_pair_layers, stage_moe) : 0;
    const int grouped = c->parallel.wgrad_group > 2 ? MT_MIN(c->parallel.wgrad_group_layers, paired) : 0;
    char pairs[240] = "", groups[160] = "";
    const int big = MT_MIN(c->parallel.wgrad_big_layers, grouped);
    if (big > 0)
        snprintf(groups, sizeof groups, " (%d in the first %d, %d in the next %d: parallel.expert_wgrad_group %d and %d, "
                 "auto)", MT_WGRAD_AUTO_GROUP_MAX - 1, big, c->parallel.wgrad_group - 1, grouped - big,
                 MT_WGRAD_AUTO_GROUP_MAX, c->parallel.wgrad_group);
    else if (grouped > 0)
        snprintf(groups, sizeof groups, " (%d in the first %d: parallel.expert_wgrad_group %d)",
                 c->parallel.wgrad_group - 1, grouped, c->parallel.wgrad_group);
    if (paired >= stage_moe && paired > 0)
        snprintf(pairs, sizeof pairs, ", plus one micro-step's expert rows per MoE layer%s (parallel.expert_wgrad_pairs)",
                 groups);
    else if (paired > 0)
        snprintf(pairs, sizeof pairs, ", plus one micro-step's expert rows in the first %d MoE layers of each stage%s "
                 "(parallel.expert_wgrad_pairs: what fits)", paired, groups);
    double in_grads = 0;
    for (int s = 0; s < d->pp; s++) in_grads = MT_MAX(in_grads, st[s].stash_in_grads_bytes);
    char parked[200] = "";
    if (in_grads > 0)
        snprintf(parked, sizeof parked, "; of those, %.2f %s lie in lower layers' expert gradients, unused until the "
                 "step's last backward (MT_STASH_IN_GRADS), and are not counted here",
                 in_grads >= (1 << 30) ? in_grads / (1 << 30) : in_grads / (1 << 20), in_grads >= (1 << 30) ? "GiB" : "MiB");
    fprintf(f, "  acts = activations saved for backward by the stage's layers for the micro-batches in flight "
            "(%d x %d tokens each; 1F1B keeps min(pp - stage, micro-steps)), plus logits on the last stage%s%s\n",
            c->train.micro_batch_size, c->train.seq_len, pairs, parked);
    fprintf(f, "  buffers = expert all-gather / reduce-scatter staging, the backward's scratch (with it the "
            "attention backward's dS tiles where the logits cannot hold them, and with ep > 1 the held-back "
            "o/q_proj gradients), pipeline transfer buffers\n");
    if (c->model.num_experts > 0 && config_moe_fixed_exchange(c))
        fprintf(f, "  MoE exchange: fixed (parallel.moe_fixed_exchange): blocks of %d pairs a rank, no host waits; "
                "each MoE layer's expert rows counted at 1.25x the mean, and grown in every layer to 1.25x the "
                "largest need (the step run again) when the routing needs more, beyond this plan\n",
                c->train.micro_batch_size * c->train.seq_len);

    print_groups(f, d);
    print_ep_node_warning(f, d, node_of_rank);

    free(first_moe);
    free(st);
    free(c);
    tensor_table_free(&tt);
    if (fflush(f) != 0 || ferror(f)) mt_fatal("writing the layout table: %s", strerror(errno));
}

void plan_print_mesh(FILE *f, const struct config *c, const struct mesh *m)
{
    plan_print_mesh_opts(f, c, m, false, PLAN_DEVICE_BYTES);
}

void plan_print_mesh_opts(FILE *f, const struct config *c, const struct mesh *m, bool fold, double device_bytes)
{
    int size = 0, rank = 0;
    MT_CHECK_MPI(MPI_Comm_size(m->world_comm, &size));
    MT_CHECK_MPI(MPI_Comm_rank(m->world_comm, &rank));
    MT_CHECK(size == m->d.world, "mesh world communicator has %d ranks, mesh expects %d", size, m->d.world);
    int *nodes = rank == 0 ? mt_malloc((size_t)size * sizeof *nodes) : NULL;
    MT_CHECK_MPI(MPI_Gather(&m->node, 1, MPI_INT, nodes, 1, MPI_INT, 0, m->world_comm));
    if (rank == 0) plan_print_opts(f, c, &m->d, nodes, fold, device_bytes);
    free(nodes);
}

int cmd_plan(const struct cli *a)
{
    struct config c;
    config_load(&c, a->config_path, a->n_sets, a->sets);
    if (a->world > PLAN_MAX_WORLD)
        mt_user_error("plan --world %d is too large (at most %d ranks)", a->world, PLAN_MAX_WORLD);
    if (a->gpus_per_node <= 0) mt_user_error("plan --gpus-per-node must be positive, got %d", a->gpus_per_node);
    struct mesh_dims d;
    char err[512];
    if (!mesh_dims_of(&c, a->world, &d, err, sizeof err)) mt_user_error("%s: %s", a->config_path, err);
    int *node_of_rank = mt_malloc((size_t)d.world * sizeof *node_of_rank);
    /* a launcher fills nodes in rank order: rank g runs on node g / G */
    for (int g = 0; g < d.world; g++) node_of_rank[g] = g / a->gpus_per_node;
    plan_print(stdout, &c, &d, node_of_rank);
    free(node_of_rank);
    return 0;
}
