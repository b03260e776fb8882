/* `moetrain train`: the training loop. One optimizer step = n_micro micro-steps on every rank;
 * the global batch is n_micro × (data-parallel ranks) × micro_batch_size sequences.
 *
 * Loss of a step (design.md "Gradient semantics"):
 *   loss = Σ token CE over the global batch / (labelled tokens in it) + coef · mean_m aux_m
 * where aux_m is transformers' load-balancing statistic pooled over every MoE layer and over the
 * global micro-batch m (all data-parallel ranks). Every gradient is the gradient of that number. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend_select.h"
#include "aux_scope.h"
#include "checkpoint.h"
#include "cli.h"
#include "comm.h"
#ifdef MT_HAVE_NCCL
#include "comm_nccl.h"
#endif
#include "common.h"
#include "config.h"
#include "data.h"
#include "env_flag.h"
#include "expert_watch.h"
#include "flops.h"
#include "fsdp.h"
#include "hf_export.h"
#include "hf_load.h"
#include "mem_report.h"
#include "memory_estimate.h"
#include "mesh.h"
#include "metrics.h"
#include "model_step.h"
#include "moe_timeline.h"
#include "moe_wgrad_jobs.h"
#include "params.h"
#include "plan.h"
#include "preempt.h"
#include "profile.h"
#include "route_replay.h"
#include "router_opts.h"
#include "run_notes.h"
#include "stash_place.h"
#include "step_guard.h"
#include "step_batch.h"
#include "step_maths.h"
#include "step_stats.h"
#include "train_startup.h"
#include "train_check.h"
#include "train_pipeline.h"
#include "validation.h"
#include "watchdog.h"

/* One micro-step's router statistics [L, 2, E] into the step's aux-loss sum and expert loads
 * (layer_counts [L, E]); cnt [E] gets the micro-step's expert counts over the layers. */
static void add_router_stats(const float *stats, const struct model_config *mc, int64_t tokens, double *aux_sum,
                             double *cnt, double *layer_counts)
{
    const int L = mc->num_hidden_layers, E = mc->num_experts;
    double aux_m;
    aux_from_stats(stats, L, mc, tokens, &aux_m, cnt);
    *aux_sum += aux_m;
    for (int l = 0; l < L; l++)
        for (int e = 0; e < E; e++) layer_counts[(size_t)l * E + e] += stats[(size_t)l * 2 * E + E + e];
}

/* Expert-load summary per MoE layer from the global per-layer counts of a step. */
static void load_summary(const struct model *m, const double *counts /*[L, E]*/, double *mn,
                         double *mx, double *cv, double *ep_max /*NULL with ep 1*/, double *tok /*[n_moe, E]*/)
{
    const int E = m->E;
    int k = 0;
    for (int l = 0; l < m->L; l++) {
        if (!config_layer_is_moe(&m->cfg, l)) continue;
        const double *c = counts + (size_t)l * E;
        double sum = 0, sq = 0, lo = INFINITY, hi = 0;
        for (int e = 0; e < E; e++) {
            sum += c[e];
            tok[(size_t)k * E + e] = c[e];
        }
        double mean = sum / E;
        for (int e = 0; e < E; e++) {
            double r = mean > 0 ? c[e] / mean : 0;
            lo = fmin(lo, r);
            hi = fmax(hi, r);
            sq += (r - 1) * (r - 1);
        }
        mn[k] = lo;
        mx[k] = hi;
        cv[k] = sqrt(sq / E);
        if (ep_max) ep_max[k] = expert_watch_rank_load_max(c, E, m->ep);
        k++;
    }
}

/* checkpoint.export_hf is written after the last step: find out now, not hours later, that it
 * cannot be. Rank 0 looks; every rank learns the verdict. */
static void check_export_dir(const struct config *c, const struct mesh *mesh, bool force)
{
    const char *dir = c->checkpoint.export_hf;
    if (!*dir) return;
    char err[MT_PATH_MAX + 128] = "";
    if (mesh->rank == 0) hf_export_check_dir(dir, force, err, sizeof err);
    MT_CHECK_MPI(MPI_Bcast(err, (int)sizeof err, MPI_CHAR, 0, mesh->world_comm));
    if (*err) mt_user_error("%s (checkpoint.export_hf)", err);
}

/* A check some ranks may fail alone (each reads different parts of a file): every rank learns the
 * lowest failing rank's one-line message and exits with it, so none is left waiting. */
static void agree_or_exit(const struct mesh *mesh, bool ok, const char *err)
{
    int mine = ok ? INT_MAX : mesh->rank, first = INT_MAX;
    MT_CHECK_MPI(MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, mesh->world_comm));
    if (first == INT_MAX) return;
    char msg[1024];
    if (mesh->rank == first) mt_strlcpy(msg, err, sizeof msg);
    MT_CHECK_MPI(MPI_Bcast(msg, (int)sizeof msg, MPI_CHAR, first, mesh->world_comm));
    mt_user_error("%s", msg);
}

/* train.weight_copy: keep the shard's compute copy unless told not to, or (auto) unless the plan
 * with it does not fit the device's memory (known on the GPU only; with fp32 compute the copy is the
 * master itself and costs nothing). */
static bool train_keep_weight_copy(const struct config *c, const struct mesh_dims *d, const struct backend *be)
{
    if (be->x_size == sizeof(float) && c->train.weight_copy == MT_COPY_AUTO) return true;
    return estimate_keep_copy(c, d, be->mem_bytes);
}

/* The comm that moves tensors living in `be`'s memory. */
static struct comm *comm_for_backend(const struct backend *be, MPI_Comm c)
{
#ifdef MT_HAVE_NCCL
    if (!strcmp(be->name, "cuda")) return comm_nccl_create(c);
#endif
    (void)be;
    return comm_mpi_create(c);
}

/* The auto memory-for-speed settings (parallel.reduce_grads, reshard_after_forward,
 * expert_wgrad_pairs) as this job runs them: on the smallest device of the job (0: the CPU
 * backend), so that every rank takes the same collectives. */
static double resolve_fsdp_auto(struct config *c, const struct mesh *mesh, bool keep_copy, double device_bytes)
{
    MT_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &device_bytes, 1, MPI_DOUBLE, MPI_MIN, mesh->world_comm));
    c->parallel.reduce_grads = estimate_reduce_grads(c, &mesh->d, keep_copy, device_bytes);
    c->parallel.reshard_after_forward =
        estimate_reshard(c, &mesh->d, keep_copy, device_bytes) ? MT_TRI_TRUE : MT_TRI_FALSE;
    estimate_resolve_expert_wgrad_pairs(c, &mesh->d, keep_copy, device_bytes);
    if (c->parallel.expert_wgrad_pairs == MT_TRI_TRUE && !estimate_expert_grads_kept(c, &mesh->d))
        mt_user_error("%s: parallel.expert_wgrad_pairs: true needs the expert gradients kept over the "
                      "step; with ep_fsdp %d they are reduce-scattered every micro-step: set "
                      "parallel.reduce_grads: step", c->path, mesh->d.ep_fsdp);
    return device_bytes;
}

/* What the dry run decides the auto settings on, returned: the GPU the training would use here,
 * or none (0: the CPU backend); with parallel.backend: cuda and no GPU here (a login node
 * previewing a GPU job) the GPU `plan` assumes. */
static double resolve_fsdp_auto_dry(struct config *c, const struct mesh *mesh)
{
    double device_bytes = 0;
    if (c->parallel.backend != MT_BACKEND_CPU) {
        const struct backend *cuda = backend_cuda(c->model.precision == MT_PREC_FP32, mesh->local_rank);
        device_bytes = cuda ? cuda->mem_bytes : c->parallel.backend == MT_BACKEND_CUDA ? PLAN_DEVICE_BYTES : 0;
    }
    config_resolve_master_weights(c, device_bytes > 0);
    const bool keep_copy = device_bytes <= 0 && c->train.weight_copy == MT_COPY_AUTO
                               ? true : estimate_keep_copy(c, &mesh->d, device_bytes);
    return resolve_fsdp_auto(c, mesh, keep_copy, device_bytes);
}

/* MT_STASH_IN_GRADS: the grouping layers' parked rows into the expert gradients that the step's
 * last backward writes first (stash_place.h); the bytes placed */
static int64_t place_expert_stash(struct model *m, struct params *p, int n_micro)
{
    const int L = m->L;
    struct stash_host *hosts = mt_calloc((size_t)MT_MAX(L, 1), sizeof *hosts);
    void **host_mem = mt_calloc((size_t)MT_MAX(L, 1), sizeof *host_mem);
    const int n_hosts = params_expert_grad_hosts(p, n_micro, hosts, host_mem);
    const int64_t placed = model_place_expert_stash(m, n_micro, hosts, host_mem, n_hosts);
    free(hosts);
    free(host_mem);
    return placed;
}

int cmd_train(const struct cli *a)
{
    MT_CHECK_MPI(MPI_Init(NULL, NULL));
    struct config c;
    config_load(&c, a->config_path, a->n_sets, a->sets);
    c.parallel.backend = backend_choice_from_cli(a->backend, c.parallel.backend);
    struct mesh mesh;
    mesh_build(&mesh, &c, MPI_COMM_WORLD);
    const int n_micro = train_check_or_exit(&c, &mesh.d);
    if (a->dry_run) {   /* the layout the training would print: the same backend decides the autos */
        plan_print_mesh_opts(stdout, &c, &mesh, false, resolve_fsdp_auto_dry(&c, &mesh));
        run_note_dry_run(&c);
        fflush(stdout);
        mesh_free(&mesh);
        MT_CHECK_MPI(MPI_Finalize());
        return 0;
    }
    ckpt_check_dir(&c, &mesh, a->force);
    check_export_dir(&c, &mesh, a->force);
    char resume_dir[2 * MT_PATH_MAX];
    const bool resuming = ckpt_resume_dir(a->resume, &c, &mesh, resume_dir, sizeof resume_dir);

    const struct train_config *tc = &c.train;
    const int dp = mesh.d.S, mb = tc->micro_batch_size;

    char err[1024];
    struct data_source *data = data_open(&c.data, tc, c.model.vocab_size, err, sizeof err);
    if (!data) mt_user_error("%s", err);
    const struct backend *be = backend_select(c.parallel.backend, c.model.precision, mesh.local_rank);
    if (c.log.profile) be = profile_wrap(be);

    /* host scalars (losses, router statistics, norms) always travel over MPI; tensors in the
     * backend's memory over the backend's comm (NCCL for cuda) */
    struct comm *world = comm_mpi_create(MPI_COMM_WORLD);
    struct comm *stage_h = comm_mpi_create(mesh.stage_comm);
    struct comm *stage = comm_for_backend(be, mesh.stage_comm);
    struct comm *ep = comm_for_backend(be, mesh.ep_comm);
    struct comm *fsdp = comm_for_backend(be, mesh.fsdp_comm);
    struct model m;
    const bool piped = mesh.d.pp > 1;
    struct comm *pp = piped ? comm_for_backend(be, mesh.pp_comm) : NULL;
    struct comm *ends = piped && mesh.ends_comm != MPI_COMM_NULL ? comm_for_backend(be, mesh.ends_comm) : NULL;
    struct comm *pp_h = piped ? comm_mpi_create(mesh.pp_comm) : NULL;
    if (piped) {
        const struct model_stage st = pipe_model_stage(&mesh, n_micro);
        model_init_stage(&m, be, &c.model, mb, tc->seq_len, ep, tc->activation_checkpointing, &st);
    } else {
        model_init(&m, be, &c.model, mb, tc->seq_len, ep, tc->activation_checkpointing);
    }
    no_decay_apply(&m.tt, tc->no_decay_modules);
    m.moe_chunks = c.parallel.moe_chunks;
    m.combine_self_last = c.parallel.moe_combine_self_last;
    /* the MoE exchange without host waits: its steps may have to run again (below) */
    const bool fixed_exchange = config_moe_fixed_exchange(&c) && m.pairs && m.moe_chunks == 1 && !piped;
    if (fixed_exchange) model_enable_fixed_exchange(&m, mt_env_positive("MT_MOE_ROW_CAPACITY", 0));
    const int E = m.E, L = m.L;
    int64_t *rows_need = mt_calloc((size_t)MT_MAX(L, 1), sizeof(int64_t)); /* host [L] */
    if (tc->load_balance == MT_LB_BIAS && E > 0) {
        m.bias = be->alloc((size_t)L * E * sizeof(float));
        be->zero(m.bias, (size_t)L * E * sizeof(float));
    }
    float *bias_h = mt_calloc((size_t)L * MT_MAX(E, 1), sizeof(float));
    struct params p;
    config_resolve_master_weights(&c, be->x_size == 2);
    const bool keep_copy = train_keep_weight_copy(&c, &mesh.d, be);
    const double job_device_bytes = resolve_fsdp_auto(&c, &mesh, keep_copy, be->mem_bytes);
    if (tc->master_weights == MT_MASTER_SPLIT && be->x_size != 2) /* every rank runs the same backend */
        mt_user_error("train.master_weights: split needs a bf16 compute copy, and the %s backend computes in fp32 "
                      "(set train.master_weights: fp32, or parallel.backend: cuda)", be->name);
    params_init_opts(&p, &m, stage, fsdp, keep_copy, tc->optimizer_state_dtype == MT_STATE_BF16,
                     tc->master_weights == MT_MASTER_SPLIT);
    int start_step = 0;
    if (resuming) {
        ckpt_load(resume_dir, &p, &mesh, &c, bias_h, &start_step);
        if (m.bias) be->upload(m.bias, bias_h, (size_t)L * E * sizeof(float));
    } else if (*c.model.init_from && ckpt_is_checkpoint(c.model.init_from)) {
        /* weights (and balancing bias) of a checkpoint, fresh optimizer state, step 0 */
        if (!ckpt_load_checked(c.model.init_from, &p, &mesh, &c, bias_h, NULL, true, err, sizeof err))
            mt_user_error("%s", err);
        if (m.bias) be->upload(m.bias, bias_h, (size_t)L * E * sizeof(float));
    } else if (*c.model.init_from) {
        err[0] = 0;
        agree_or_exit(&mesh, params_load_hf(&p, c.model.init_from, err, sizeof err), err);
        if (m.bias) {
            int rows = 0;
            agree_or_exit(&mesh, hf_load_bias(c.model.init_from, &c.model, bias_h, &rows, err, sizeof err), err);
            be->upload(m.bias, bias_h, (size_t)L * E * sizeof(float));
        }
    } else {
        params_init_random(&p, tc->seed);
    }
    struct fsdp sharding;
    fsdp_init(&sharding, &p, c.parallel.reshard_after_forward != MT_TRI_FALSE, c.parallel.prefetch,
              c.parallel.reduce_grads == MT_REDUCE_STEP);
    /* the exchanges exist with pairs; the layer's activations and gradient must outlive its backward */
    if (m.pairs && E > 0 && !m.recompute && fsdp_dense_grads_persist(&sharding) &&
        !mt_env_flag("MT_NO_DEFERRED_WGRAD"))
        model_enable_deferred_wgrads(&m);
    if (c.parallel.expert_wgrad_pairs == MT_TRI_TRUE && E > 0)
        model_enable_expert_wgrad_groups(&m, c.parallel.wgrad_pair_layers, c.parallel.wgrad_group_layers,
                                         c.parallel.wgrad_group, c.parallel.wgrad_big_layers, MT_WGRAD_AUTO_GROUP_MAX);
    const bool stash_placed = m.wstash && c.parallel.stash_in_grads;
    const int64_t stash_in_grads = stash_placed ? place_expert_stash(&m, &p, n_micro) : 0;
    if (m.wstash && m.pairs && c.parallel.expert_wgrad_jobs) model_enable_wgrad_jobs(&m);
    else if (c.parallel.expert_wgrad_jobs)
        mt_warn0("parallel.expert_wgrad_jobs: no effect: parallel.expert_wgrad_pairs is off here (auto: no room "
                 "for the parked micro-steps, gradients reduced every micro-step, or one micro-step a step)\n");
    if (*c.data.routing_replay &&
        !route_replay_open(&m, c.data.routing_replay, (int64_t)tc->steps * tc->global_batch_size, err, sizeof err))
        mt_user_error("data.routing_replay: %s", err);
    plan_print_mesh_opts(stdout, &c, &mesh, mesh.d.world > 16, job_device_bytes);
    char init[3 * MT_PATH_MAX];
    if (resuming) snprintf(init, sizeof init, "resumed from %s (step %d)", resume_dir, start_step);
    else if (*c.model.init_from) snprintf(init, sizeof init, "weights from %s", c.model.init_from);
    else snprintf(init, sizeof init, "random (seed %llu)", (unsigned long long)tc->seed);
    train_print_startup(&c, &mesh, be, data, n_micro, &m, init, keep_copy);
    if (c.parallel.stash_in_grads && mesh.rank == 0)
        printf("  parked rows %.2f %s of the expert rows parked for grouped weight gradients lie in lower layers' "
               "expert gradients, unused until the step's last backward (MT_STASH_IN_GRADS)\n",
               stash_in_grads >= (1 << 30) ? (double)stash_in_grads / (1 << 30) : (double)stash_in_grads / (1 << 20),
               stash_in_grads >= (1 << 30) ? "GiB" : "MiB");
    struct validation *val = validation_open(&c, n_micro, mesh.me.local, dp);
    if (val) mt_log0("  validation  %s\n", validation_describe(val));
    metrics_print_config(&c, c.log.metrics);
    preempt_install();
    watchdog_start(&c, mesh.world_comm);
    if (resuming) run_note_resume(resume_dir, &c, start_step);

    struct metrics_log ml;
    metrics_open(&ml, c.log.metrics, resuming);
    const int64_t tokens_micro_global = (int64_t)dp * mb * tc->seq_len;
    const double coef = c.model.router_aux_loss_coef;
    const bool use_aux = tc->load_balance == MT_LB_AUX && E > 0;
    const size_t nstat = (size_t)L * 2 * MT_MAX(E, 1);
    struct step_batch sb;
    step_batch_init(&sb, &c.data, n_micro, mb, tc->seq_len, mesh.me.local, dp);
    float *aux_dp = mt_calloc((size_t)MT_MAX(E, 1), sizeof(float));
    double *cnt = mt_calloc((size_t)MT_MAX(E, 1), sizeof(double));
    double *layer_counts = mt_calloc((size_t)L * MT_MAX(E, 1), sizeof(double));
    double *lmin = mt_calloc((size_t)L + 1, sizeof(double)), *lmax = mt_calloc((size_t)L + 1, sizeof(double));
    double *lcv = mt_calloc((size_t)L + 1, sizeof(double));
    double *ep_lmax = m.ep > 1 ? mt_calloc((size_t)L + 1, sizeof(double)) : NULL;
    double *tok = mt_calloc((size_t)L * MT_MAX(E, 1), sizeof(double));
    const double flops_tok = flops_train_per_token(&c.model, tc->seq_len);
    const bool aux_global = use_aux && tc->aux_loss_scope == MT_AUX_GLOBAL_BATCH;
    const struct aux_prepass prepass = {&sb, stage_h, tokens_micro_global, pp, pp_h};
    struct expert_watch watch;
    expert_watch_init(&watch, &c.model, &c.log);
    double t_start = mt_now(), first_step_s = 0;
    struct pipe_train pt;
    if (piped) pipe_train_init(&pt, &c, &mesh, &m, stage_h, pp, n_micro);
    if (piped) pt.aux_fixed = aux_global ? aux_dp : NULL;
    struct step_guard guard;
    step_guard_init(&guard, tc);
    /* The expert gradients' share of the norm where their step's only weight-gradient pass
     * overwrote them (groups of all the step's micro-steps): summed from the kernel's
     * accumulators, not read again (model.h model_grad_sumsq_taken). Where they are not reduced
     * after it; on the GPU by default (on the CPU it saves nothing and sums in another order than
     * the one pass). MT_GRAD_NORM_FOLD=0 turns it off, =1 on any backend (tests). */
    static const char *const fold_vals[] = {"0", "1", "auto"};
    const int fold_mode = mt_env_choice("MT_GRAD_NORM_FOLD", fold_vals, 3, 2);
    const bool fold_norm = !piped && p.g[TG_EXPERT].aliased && !fsdp_group_reduces(&sharding, TG_EXPERT) &&
                           (fold_mode == 1 || (fold_mode == 2 && !strcmp(be->name, "cuda")));
    double *known_ss = fold_norm ? mt_calloc((size_t)m.tt.n, sizeof(double)) : NULL;
    if (fold_norm) model_enable_grad_sumsq(&m);
    /* no pipeline: no host wait per micro-step for the statistics (src/step_stats.h) */
    const bool deferred = step_stats_applies(mesh.d.pp);
    struct step_stats ss = {0};
    if (deferred) step_stats_init(&ss, &m, n_micro);

    for (int step = start_step + 1; step <= tc->steps; step++) {
        double t0 = mt_now();
        double split[PROF_COUNT];
        watchdog_phase(step, "data");
        step_batch_load(&sb, data, step - 1, stage_h);
        int reruns = 0;
    run_step: /* again, on the same batch, when an MoE layer outgrew its rows (fixed_exchange) */
        profile_reset();
        params_zero_grad(&p);
        model_grad_sumsq_reset(&m);
        double ce_local = 0, aux_sum = 0;
        int64_t valid_local = 0;
        memset(layer_counts, 0, (size_t)L * MT_MAX(E, 1) * sizeof(double));
        const int64_t n_valid_global = sb.n_valid_global;
        /* global_batch scope: one aux over the whole step, its gradient fixed before any backward */
        const double aux_step = aux_global ? aux_global_prepass(&m, &prepass, step, coef, aux_dp) : 0;
        if (piped) {
            watchdog_phase(step, "pipeline");
            pipe_train_step(&pt, step, &sb);
            pipe_train_results(&pt, &ce_local, &valid_local, &aux_sum, layer_counts);
        }
        m.rows_by_capacity = fixed_exchange;
        for (int micro = 0; micro < n_micro && !piped; micro++) {
            watchdog_phase(step, "forward");
            route_replay_load(&m, 0, data_first_seq(step - 1, micro, n_micro, mesh.me.local, dp, mb));
            struct model_step_out o;
            if (deferred) step_stats_arm(&ss, &m, micro);
            model_arm_loss_gradient(&m, (float)(1.0 / n_valid_global));
            step_batch_forward(&sb, micro, &m, &o);
            model_disarm_loss_gradient(&m);
            valid_local += o.n_valid;
            const float *aux_host = use_aux ? aux_dp : NULL;
            if (deferred) {
                /* the stage's sums of this micro-step's statistics and the aux gradient from them,
                 * on the device (the backend's comm: queued, no host wait) */
                step_stats_disarm(&m);
                float *st = step_stats_router_device(&ss, micro);
                if (st && stage->size > 1) comm_all_reduce_sum(stage, st, nstat, COMM_F32);
                if (use_aux && !aux_global) {
                    be->aux_grad_from_stats(m.aux_dp, st, L, E, coef / n_micro,
                                            (double)m.n_moe_layers * (double)tokens_micro_global);
                    m.aux_dp_ready = true;
                    aux_host = NULL;
                }
            } else {
                ce_local += o.ce_sum;
                if (E > 0) {
                    comm_all_reduce_sum(stage_h, m.stats_h, nstat, COMM_F32);
                    add_router_stats(m.stats_h, &c.model, tokens_micro_global, &aux_sum, cnt, layer_counts);
                    if (!aux_global)
                        aux_grad_from_counts(cnt, E, m.n_moe_layers, tokens_micro_global, coef / n_micro, aux_dp);
                }
            }
            watchdog_phase(step, "backward");
            m.more_backwards = micro + 1 < n_micro;
            model_backward(&m, (float)(1.0 / n_valid_global), aux_host);
        }
        if (deferred) { /* the micro-steps' losses and statistics, summed as the path above does */
            watchdog_phase(step, "step statistics");
            step_stats_fetch(&ss, n_micro);
            for (int micro = 0; micro < n_micro; micro++) {
                ce_local += step_stats_ce_sum(&ss, micro);
                if (E > 0)
                    add_router_stats(step_stats_router(&ss, micro), &c.model, tokens_micro_global, &aux_sum, cnt,
                                     layer_counts);
            }
        }
        m.rows_by_capacity = false;
        if (fixed_exchange) {
            /* every rank runs the step again, or none: each layer's largest need over the job */
            model_fixed_exchange_overflow(&m, rows_need);
            MT_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, rows_need, L, MPI_INT64_T, MPI_MAX, mesh.world_comm));
            int n_cut = 0, worst = 0;
            for (int l = 0; l < L; l++) {
                n_cut += rows_need[l] > 0;
                if (rows_need[l] > rows_need[worst]) worst = l;
            }
            if (n_cut > 0) {
                fsdp_flush(&sharding);
                MT_CHECK(++reruns <= 8, "step %d: MoE layers still need more expert rows after %d runs", step,
                         reruns - 1);
                mt_warn0("step %d: %d MoE layer(s) needed more expert rows than their buffers hold (layer %d: %lld, "
                         "held %lld); running the step again with room for them in every layer\n", step, n_cut, worst,
                         (long long)rows_need[worst], (long long)m.rows_cap[worst]);
                model_fixed_exchange_grow(&m, rows_need);
                if (stash_placed) { /* the parked rows' buffers at the new capacity */
                    model_unplace_expert_stash(&m);
                    place_expert_stash(&m, &p, n_micro);
                }
                goto run_step;
            }
        }
        watchdog_phase(step, "gradient norm");
        /* a group that no reduction touches is final already: its sum runs while the others'
         * reduce-scatters finish (at EP the experts' ~2 ms under the embedding's) */
        double group_ss[TG_COUNT];
        for (int g = 0; g < TG_COUNT; g++) {
            const enum tensor_group tg = (enum tensor_group)g;
            group_ss[g] = NAN;
            if (piped || fsdp_group_reduces(&sharding, tg)) continue;
            const int known = fold_norm && tg == TG_EXPERT ? model_grad_sumsq_taken(&m, known_ss) : 0;
            group_ss[g] = params_group_grad_sumsq_known(&p, tg, known ? known_ss : NULL);
            if (fold_norm && tg == TG_EXPERT && step == start_step + 1 && mesh.rank == 0)
                printf("  grad norm   %d of the stage's expert weight tensors summed by the weight-gradient pass "
                       "that wrote them, not read again (MT_GRAD_NORM_FOLD)\n", known);
        }
        fsdp_flush(&sharding);
        double gsq = piped ? pipe_grad_sumsq(&p, &mesh, ends, world) : params_grad_sumsq_with(&p, group_ss, world);
        double gnorm = sqrt(gsq);
        double scale = tc->grad_clip > 0 && gnorm > tc->grad_clip ? tc->grad_clip / gnorm : 1.0;
        double lr = train_lr_at(tc, step);
        double sums[2] = {ce_local, (double)valid_local};
        watchdog_phase(step, "loss all-reduce");
        comm_all_reduce_sum(world, sums, 2, COMM_F64);
        MT_CHECK((int64_t)sums[1] == n_valid_global, "step %d counted %.0f labelled tokens, expected %lld",
                 step, sums[1], (long long)n_valid_global);
        const double loss = sums[0] / n_valid_global + (use_aux ? coef * aux_sum / n_micro : 0);
        enum step_verdict verdict = step_guard_decide(&guard, step, loss, gnorm, mesh.world_comm);
        if (verdict == STEP_APPLY) {
            watchdog_phase(step, "optimizer step");
            params_adamw_step(&p, tc, (float)lr, (float)scale);
            fsdp_invalidate(&sharding);
        }
        if (verdict == STEP_APPLY && tc->load_balance == MT_LB_BIAS && E > 0) {
            balance_bias_update(bias_h, layer_counts, &c.model, tc->bias_update_rate);
            be->upload(m.bias, bias_h, (size_t)L * E * sizeof(float));
        }
        mem_report_sample(be);
        int peak_rank = 0;
        double peak_bytes = mem_report_step_peak(&mesh, &peak_rank);
        double step_s = mt_now() - t0;
        if (step == start_step + 1) first_step_s = step_s;
        double ce = sums[0] / n_valid_global, aux = aux_global ? aux_step : aux_sum / n_micro;
        int n_moe = 0;
        if (E > 0) {
            load_summary(&m, layer_counts, lmin, lmax, lcv, ep_lmax, tok);
            n_moe = m.n_moe_layers;
        }
        double elapsed = mt_now() - t_start;
        double avg = step > start_step + 1 ? (elapsed - first_step_s) / (step - start_step - 1) : step_s;
        double tps = (double)tc->global_batch_size * tc->seq_len / step_s;
        struct step_metrics sm = {
            .step = step, .steps = tc->steps, .loss = ce + (use_aux ? coef * aux : 0), .ce_loss = ce,
            .aux_loss = aux, .grad_norm = gnorm, .lr = lr, .tokens_per_s = tps,
            .mfu = be->peak_flops > 0 ? tps * flops_tok / (be->peak_flops * mesh.d.world) : -1,
            .step_ms = 1e3 * step_s, .eta_s = avg * (tc->steps - step), .n_layers = n_moe,
            .load_min = lmin, .load_max = lmax, .load_cv = lcv, .ep_load_max = ep_lmax, .n_experts = E, .expert_tokens = tok,
            .time_split = c.log.profile ? split : NULL, .wall_time = metrics_wall_clock(),
            .tokens_seen = (int64_t)step * tc->global_batch_size * tc->seq_len, .val_loss = NAN,
            .warning = E > 0 ? expert_watch_step(&watch, tok) : NULL,
            .peak_mem_bytes = peak_bytes, .peak_mem_rank = peak_rank,
            .skipped = verdict != STEP_APPLY, .skipped_steps = guard.total_skipped, .reruns = reruns,
        };
        profile_read(split);
        if (validation_due(val, step)) sm.val_loss = validation_run(val, &m, stage_h, world, pp);
        bool print = step == 1 || step == tc->steps || step % MT_MAX(c.log.interval, 1) == 0 ||
                     isfinite(sm.val_loss);
        metrics_step(&ml, &sm, print);
        if (verdict == STEP_STOP) {
            metrics_close(&ml);
            step_guard_stop_message(&guard, err, sizeof err);
            mt_user_error("%s", err);
        }
        if (verdict == STEP_SKIP) mt_warn0("skipped the optimizer step: %s\n", guard.why);
        if (c.log.profile && step == tc->steps && mesh.rank == 0) {
            profile_print_ops(stdout, step_s);
            fflush(stdout);
        }
        watchdog_phase(step, "checkpoint save");
        if (ckpt_due(&c, step)) ckpt_save(c.checkpoint.dir, step, &p, &mesh, &c, m.bias ? bias_h : NULL);
        watchdog_phase(step, "preemption check");
        if (preempt_requested(mesh.world_comm)) {
            watchdog_phase(step, "checkpoint save (preempted)");
            if (*c.checkpoint.dir && !ckpt_due(&c, step))
                ckpt_save(c.checkpoint.dir, step, &p, &mesh, &c, m.bias ? bias_h : NULL);
            preempt_exit(&c, step);
        }
    }
    run_note_done(&c, start_step, mt_now() - t_start);
    struct mem_peak peak;
    mem_report_collect(&mesh, &peak);
    mem_report_print(&c, &mesh, &peak, keep_copy, be->x_size);
    if (mt_rank() == 0) moe_timeline_print(stdout);
    if (piped) pipe_train_report_idle(&pt, c.log.profile || !strcmp(be->name, "cpu"));
    if (sharding.n_gathers > 0)   /* every rank gathers the same units: rank 0's count speaks for all */
        mt_log0("fsdp: %lld unit gathers per rank, %lld (%.0f%%) prefetched while the unit before them computed\n",
                (long long)sharding.n_gathers, (long long)sharding.n_prefetched,
                100.0 * (double)sharding.n_prefetched / (double)sharding.n_gathers);
    if (sharding.n_reduces > 0)
        mt_log0("fsdp: %lld gradient reduce-scatters per rank, %lld (%.0f%%) left running behind the next unit's backward\n",
                (long long)sharding.n_reduces, (long long)sharding.n_reduces_overlapped,
                100.0 * (double)sharding.n_reduces_overlapped / (double)sharding.n_reduces);
    if (*c.checkpoint.export_hf) {
        watchdog_phase(tc->steps, "export");
        if (!export_params_hf(&p, &mesh, &c, m.bias ? bias_h : NULL, a->force, c.checkpoint.export_hf, err,
                              sizeof err))
            mt_user_error("%s", err);
        mt_log0("exported the final weights to %s (Hugging Face layout)\n", c.checkpoint.export_hf);
    }
    watchdog_stop();
    metrics_close(&ml);
    step_batch_free(&sb); validation_close(val);
    free(aux_dp); free(cnt); free(layer_counts); free(lmin); free(lmax); free(lcv); free(ep_lmax);
    free(tok); free(bias_h); free(rows_need); free(known_ss);
    if (piped) pipe_train_free(&pt);
    comm_free(pp); comm_free(ends); comm_free(pp_h);
    fsdp_free(&sharding);
    expert_watch_free(&watch);
    params_free(&p);
    if (deferred) step_stats_free(&ss);
    model_free(&m);
    comm_free(world); comm_free(stage_h); comm_free(stage); comm_free(ep); comm_free(fsdp);
    data_close(data);
    mesh_free(&mesh);
    MT_CHECK_MPI(MPI_Finalize());
    return 0;
}
