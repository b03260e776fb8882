/* Checkpoints (src/checkpoint.h): single-process save/load on the CPU backend (bit-exact restore,
 * the directory protocol, keep, every kind of damaged checkpoint with its one-line message, no
 * non-finite value saved). The multi-rank re-slicing under mpirun and whole training runs resumed
 * from a checkpoint: test_checkpoint_mpi.c. */
#define _GNU_SOURCE   /* memmem */
#include <criterion/criterion.h>
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../test_util.h"
#include "checkpoint.h"
#include "common.h"
#include "config.h"
#include "model.h"
#include "ops.h"
#include "params.h"

/* --- a small model on one process ---------------------------------------------------------- */

struct rig {
    struct config c;
    struct model m;
    struct params p;
    struct mesh mesh;
    float *bias;        /* [L, E] */
    char root[64];
};

static void small_config(struct config *c, int hidden, int experts)
{
    config_defaults(c);
    c->model.num_experts = experts;
    c->model.num_experts_per_tok = experts ? 2 : 1;   /* unused without experts */
    c->model.vocab_size = 80;
    c->model.hidden_size = hidden;
    c->model.num_hidden_layers = 3;
    c->model.head_dim = 8;
    c->model.moe_intermediate_size = 12;
    c->model.intermediate_size = 40;
    c->model.n_mlp_only_layers = 1;   /* layer 0 dense: both kinds of MLP tensors are saved */
    c->model.mlp_only_layers[0] = 0;
    c->train.seq_len = 8;
    char err[256];
    cr_assert(config_validate(c, err, sizeof err), "%s", err);
}

/* A distinct value for element j of buffer b of group k (so a misplaced value is never right). */
static float pattern(int b, int k, int64_t j, float salt)
{
    uint64_t z = (uint64_t)j * 0x9e3779b97f4a7c15ULL + (uint64_t)(b * 2 + k + 1) * 0xbf58476d1ce4e5b9ULL;
    z ^= z >> 31;
    z *= 0x94d049bb133111ebULL;
    z ^= z >> 29;
    return (float)((double)(z >> 40) * 0x1.0p-24 - 0.5) + salt;
}

static void rig_init_e(struct rig *r, int hidden, int experts, uint64_t seed, float salt)
{
    memset(r, 0, sizeof *r);
    small_config(&r->c, hidden, experts);
    model_init(&r->m, backend_cpu(), &r->c.model, 2, 8, NULL, false);
    params_init(&r->p, &r->m, NULL, NULL);
    params_init_random(&r->p, seed);
    /* moments that look used: distinct per element, per buffer */
    for (int k = 0; k < TG_COUNT; k++) {
        struct param_group_shard *g = &r->p.g[k];
        for (int64_t j = 0; j < g->numel; j++) {
            ((float *)g->m1)[j] = pattern(1, k, j, salt);
            ((float *)g->m2)[j] = pattern(2, k, j, salt) + 1.0f;
        }
    }
    r->p.step = 7;
    const int L = r->c.model.num_hidden_layers, E = r->c.model.num_experts;
    r->bias = calloc((size_t)L * E + 1, sizeof(float));
    for (int j = 0; j < L * E; j++) r->bias[j] = pattern(3, 0, j, salt);
    r->mesh.d = (struct mesh_dims){.world = 1, .pp = 1, .ep = 1, .ep_fsdp = 1, .S = 1};
    r->mesh.world_comm = MPI_COMM_NULL;
    snprintf(r->root, sizeof r->root, "/tmp/mt_ckpt_XXXXXX");
    cr_assert(mkdtemp(r->root), "mkdtemp");
}

static void rig_init(struct rig *r, int hidden, uint64_t seed, float salt)
{
    rig_init_e(r, hidden, 8, seed, salt);
}

static void rig_free(struct rig *r, bool remove_root)
{
    if (remove_root) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf %s", r->root);
        cr_expect_eq(system(cmd), 0);
    }
    params_free(&r->p);
    model_free(&r->m);
    free(r->bias);
}

static void expect_same_state(const struct params *a, const struct params *b)
{
    for (int k = 0; k < TG_COUNT; k++) {
        const struct param_group_shard *x = &a->g[k], *y = &b->g[k];
        cr_assert_eq(x->numel, y->numel);
        size_t n = (size_t)x->numel * sizeof(float);
        cr_expect(!memcmp(x->master, y->master, n), "group %d: master differs", k);
        cr_expect(!memcmp(x->m1, y->m1, n), "group %d: m1 differs", k);
        cr_expect(!memcmp(x->m2, y->m2, n), "group %d: m2 differs", k);
        /* the CPU backend computes in fp32: the working copy is the master itself */
        cr_expect(!memcmp(x->master, y->param_x, n), "group %d: param_x is not the loaded master", k);
    }
    cr_expect_eq(a->step, b->step);
}

static void path_in(char *out, size_t cap, const char *root, int step, const char *file)
{
    snprintf(out, cap, "%s/step_%08d%s%s", root, step, file ? "/" : "", file ? file : "");
}

/* Loads dir into a fresh model of the same shape; returns whether it worked, message in err. */
static bool try_load(struct rig *r, const char *dir, int hidden, char *err, int cap)
{
    struct rig fresh;
    rig_init(&fresh, hidden, 99, 0.25f);
    fresh.mesh = r->mesh;
    int step = -1;
    bool ok = ckpt_load_checked(dir, &fresh.p, &fresh.mesh, &fresh.c, fresh.bias, &step, false, err, cap);
    if (!ok) {
        /* a failed load leaves the state untouched */
        struct rig again;
        rig_init(&again, hidden, 99, 0.25f);
        expect_same_state(&fresh.p, &again.p);
        rig_free(&again, true);
        cr_expect(strchr(err, '\n') == NULL, "the message is not one line: %s", err);
    }
    rig_free(&fresh, true);
    return ok;
}

static void expect_load_error(struct rig *r, const char *dir, const char *want1, const char *want2)
{
    char err[1024] = "";
    cr_assert_not(try_load(r, dir, r->c.model.hidden_size, err, sizeof err), "loading %s worked", dir);
    cr_expect(strstr(err, want1) != NULL, "message '%s' lacks '%s'", err, want1);
    if (want2) cr_expect(strstr(err, want2) != NULL, "message '%s' lacks '%s'", err, want2);
}

Test(checkpoint, save_then_load_restores_everything_bit_exactly)
{
    struct rig a, b;
    rig_init(&a, 32, 1, 0.0f);
    ckpt_save(a.root, 3, &a.p, &a.mesh, &a.c, a.bias);
    char dir[256];
    cr_assert_eq(ckpt_latest(a.root, dir, sizeof dir), 3);
    char want[256];
    path_in(want, sizeof want, a.root, 3, NULL);
    cr_expect_str_eq(dir, want);

    rig_init(&b, 32, 2, 0.5f);   /* other weights, moments, step and bias */
    int step = -1;
    ckpt_load(dir, &b.p, &b.mesh, &b.c, b.bias, &step);
    cr_expect_eq(step, 3);
    expect_same_state(&a.p, &b.p);
    const size_t nb = (size_t)a.c.model.num_hidden_layers * a.c.model.num_experts * sizeof(float);
    cr_expect(!memcmp(a.bias, b.bias, nb), "bias differs");

    /* weights only (init_from a checkpoint): masters, no optimizer state */
    struct rig w;
    rig_init(&w, 32, 3, 0.75f);
    char err[1024];
    cr_assert(ckpt_load_checked(dir, &w.p, &w.mesh, &w.c, NULL, NULL, true, err, sizeof err), "%s", err);
    for (int k = 0; k < TG_COUNT; k++) {
        size_t n = (size_t)a.p.g[k].numel;
        cr_expect(!memcmp(a.p.g[k].master, w.p.g[k].master, n * sizeof(float)));
        for (size_t j = 0; j < n; j++)
            cr_assert(((float *)w.p.g[k].m1)[j] == 0 && ((float *)w.p.g[k].m2)[j] == 0);
    }
    cr_expect_eq(w.p.step, 0);
    rig_free(&w, true);
    rig_free(&b, true);
    rig_free(&a, true);
}

Test(checkpoint, dense_model_round_trips)
{
    struct rig a, b;
    rig_init_e(&a, 32, 0, 1, 0.0f);
    cr_assert_eq(a.p.g[TG_EXPERT].numel, 0);
    ckpt_save(a.root, 1, &a.p, &a.mesh, &a.c, NULL);
    char dir[256];
    cr_assert_eq(ckpt_latest(a.root, dir, sizeof dir), 1);
    rig_init_e(&b, 32, 0, 2, 0.5f);
    ckpt_load(dir, &b.p, &b.mesh, &b.c, NULL, NULL);
    expect_same_state(&a.p, &b.p);
    rig_free(&b, true);
    rig_free(&a, true);
}

Test(checkpoint, files_follow_the_documented_layout)
{
    struct rig a;
    rig_init(&a, 32, 1, 0.0f);
    ckpt_save(a.root, 12, &a.p, &a.mesh, &a.c, NULL);
    char p[512];
    path_in(p, sizeof p, a.root, 12, "COMPLETE");
    cr_expect(access(p, F_OK) == 0, "no COMPLETE marker");
    snprintf(p, sizeof p, "%s/step_%08d.tmp", a.root, 12);
    cr_expect(access(p, F_OK) != 0, "the .tmp directory is still there");
    cr_expect(ckpt_is_checkpoint(p) == false);
    path_in(p, sizeof p, a.root, 12, NULL);
    cr_expect(ckpt_is_checkpoint(p));

    /* read back with plain HDF5 calls: shapes from the config, not from the code under test */
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    path_in(p, sizeof p, a.root, 12, "rank_00000.h5");
    hid_t f = H5Fopen(p, H5F_ACC_RDONLY, H5P_DEFAULT);
    cr_assert(f >= 0, "cannot open %s", p);
    const int64_t V = 80, H = 32, E = 8, I = 12;
    struct { const char *name; int nd; hsize_t dims[3]; } want[] = {
        {"master/model.embed_tokens.weight", 1, {V * H}},
        {"adam_v/lm_head.weight", 1, {V * H}},
        {"adam_m/model.layers.1.mlp.experts.gate_up_proj", 3, {E, 2 * I, H}},
        {"master/model.layers.2.mlp.experts.down_proj", 3, {E, H, I}},
        {"master/model.layers.0.mlp.down_proj.weight", 1, {H * 40}},
    };
    for (size_t j = 0; j < sizeof want / sizeof want[0]; j++) {
        hid_t d = H5Dopen2(f, want[j].name, H5P_DEFAULT);
        cr_assert(d >= 0, "dataset %s missing", want[j].name);
        hid_t sp = H5Dget_space(d);
        hsize_t dims[3] = {0, 0, 0};
        cr_expect_eq(H5Sget_simple_extent_ndims(sp), want[j].nd, "%s", want[j].name);
        H5Sget_simple_extent_dims(sp, dims, NULL);
        for (int q = 0; q < want[j].nd; q++) cr_expect_eq(dims[q], want[j].dims[q], "%s dim %d", want[j].name, q);
        int64_t attr[2] = {-1, -1};
        hid_t at = H5Aopen(d, want[j].nd == 1 ? "range" : "experts", H5P_DEFAULT);
        cr_assert(at >= 0);
        H5Aread(at, H5T_NATIVE_INT64, attr);
        cr_expect(attr[0] == 0 && attr[1] == (int64_t)want[j].dims[0], "%s: slice [%lld, %lld)", want[j].name,
                  (long long)attr[0], (long long)attr[1]);
        H5Aclose(at);
        H5Sclose(sp);
        H5Dclose(d);
    }
    /* the master values are the shard's, element for element */
    int i = tensor_find(&a.m.tt, "model.layers.1.mlp.experts.gate_up_proj");
    cr_assert(i >= 0);
    const struct tensor_spec *s = &a.m.tt.t[i];
    float *buf = malloc((size_t)s->numel * sizeof(float));
    hid_t d = H5Dopen2(f, "master/model.layers.1.mlp.experts.gate_up_proj", H5P_DEFAULT);
    cr_assert(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0);
    const int64_t shard_at = a.p.g[TG_EXPERT].u_off[tensor_unit(s, a.m.L)] + a.p.exp_piece_off[i];
    cr_expect(!memcmp(buf, a.p.g[TG_EXPERT].master + shard_at, (size_t)s->numel * sizeof(float)));
    free(buf);
    H5Dclose(d);
    H5Fclose(f);

    path_in(p, sizeof p, a.root, 12, "manifest.h5");
    f = H5Fopen(p, H5F_ACC_RDONLY, H5P_DEFAULT);
    cr_assert(f >= 0);
    const char *ints[] = {"format_version", "step", "optimizer_step", "data_position", "world"};
    const int64_t vals[] = {CKPT_FORMAT_VERSION, 12, 7, 12, 1};
    for (int j = 0; j < 5; j++) {
        int64_t v = -1;
        hid_t at = H5Aopen(f, ints[j], H5P_DEFAULT);
        cr_assert(at >= 0, "manifest attribute %s missing", ints[j]);
        H5Aread(at, H5T_NATIVE_INT64, &v);
        H5Aclose(at);
        cr_expect_eq(v, vals[j], "manifest %s = %lld", ints[j], (long long)v);
    }
    cr_expect(H5Lexists(f, "config_yaml", H5P_DEFAULT) > 0);
    cr_expect(H5Lexists(f, "balance_bias", H5P_DEFAULT) == 0, "no bias was given");
    H5Fclose(f);
    rig_free(&a, true);
}

Test(checkpoint, latest_ignores_incomplete_and_tmp_directories)
{
    struct rig a;
    rig_init(&a, 32, 1, 0.0f);
    cr_expect_eq(ckpt_latest(a.root, NULL, 0), -1);
    cr_expect_eq(ckpt_latest("/nonexistent/mt_ckpt", NULL, 0), -1);
    a.c.checkpoint.keep = 0;
    ckpt_save(a.root, 2, &a.p, &a.mesh, &a.c, NULL);
    char cmd[1024];
    /* a save that died after its rename, before COMPLETE; and one that died while writing */
    snprintf(cmd, sizeof cmd, "cp -r %s/step_00000002 %s/step_00000005 && rm %s/step_00000005/COMPLETE && "
             "cp -r %s/step_00000005 %s/step_00000007.tmp && mkdir %s/step_00000009.tmp && "
             "mkdir %s/step_00000002.replaced.tmp && mkdir %s/notes",
             a.root, a.root, a.root, a.root, a.root, a.root, a.root, a.root);
    cr_assert_eq(system(cmd), 0);
    char dir[256];
    cr_expect_eq(ckpt_latest(a.root, dir, sizeof dir), 2);

    char p[512];
    path_in(p, sizeof p, a.root, 5, NULL);
    expect_load_error(&a, p, "is incomplete (no COMPLETE marker)", "step_00000005");
    snprintf(p, sizeof p, "%s/step_00000007.tmp", a.root);
    expect_load_error(&a, p, "is incomplete", NULL);
    /* the root itself is not a checkpoint, but the message points at the newest one */
    expect_load_error(&a, a.root, "is a checkpoint root", "step_00000002");

    /* the next save clears the debris */
    ckpt_save(a.root, 3, &a.p, &a.mesh, &a.c, NULL);
    path_in(p, sizeof p, a.root, 5, NULL);
    cr_expect(access(p, F_OK) != 0, "the unfinished step 5 is still there");
    snprintf(p, sizeof p, "%s/step_00000009.tmp", a.root);
    cr_expect(access(p, F_OK) != 0, "the stale .tmp is still there");
    snprintf(p, sizeof p, "%s/step_00000002.replaced.tmp", a.root);
    cr_expect(access(p, F_OK) != 0, "the stale .replaced.tmp is still there");
    snprintf(p, sizeof p, "%s/notes", a.root);
    cr_expect(access(p, F_OK) == 0, "a directory that is not a checkpoint was removed");
    cr_expect_eq(ckpt_latest(a.root, NULL, 0), 3);
    rig_free(&a, true);
}

Test(checkpoint, keep_deletes_older_checkpoints)
{
    struct rig a;
    rig_init(&a, 32, 1, 0.0f);
    a.c.checkpoint.keep = 2;
    for (int s = 1; s <= 4; s++) ckpt_save(a.root, s * 10, &a.p, &a.mesh, &a.c, NULL);
    char p[512];
    for (int s = 1; s <= 4; s++) {
        path_in(p, sizeof p, a.root, s * 10, NULL);
        cr_expect_eq(access(p, F_OK) == 0, s >= 3, "step %d: kept %d", s * 10, access(p, F_OK) == 0);
    }
    /* re-saving an existing step replaces it (a resumed run) and counts once */
    ckpt_save(a.root, 30, &a.p, &a.mesh, &a.c, NULL);
    path_in(p, sizeof p, a.root, 30, NULL);
    cr_expect_eq(access(p, F_OK), 0);
    path_in(p, sizeof p, a.root, 40, NULL);
    cr_expect_eq(access(p, F_OK), 0);
    /* the re-saved 30 is the newest save (a rewound run), so resume auto continues it, not 40 */
    cr_expect_eq(ckpt_latest(a.root, NULL, 0), 30);

    a.c.checkpoint.keep = 0;   /* keep all */
    for (int s = 5; s <= 7; s++) ckpt_save(a.root, s * 10, &a.p, &a.mesh, &a.c, NULL);
    for (int s = 3; s <= 7; s++) {
        path_in(p, sizeof p, a.root, s * 10, NULL);
        cr_expect_eq(access(p, F_OK), 0, "step %d was deleted with keep 0", s * 10);
    }
    rig_free(&a, true);
}

Test(checkpoint, ckpt_due_follows_interval_and_the_last_step)
{
    struct config c;
    config_defaults(&c);
    c.train.steps = 12;
    c.checkpoint.interval = 5;
    cr_expect_not(ckpt_due(&c, 5), "no checkpoint.dir");
    strcpy(c.checkpoint.dir, "/tmp/x");
    int due[13] = {0};
    for (int s = 1; s <= 12; s++) due[s] = ckpt_due(&c, s);
    for (int s = 1; s <= 12; s++) cr_expect_eq(due[s], s == 5 || s == 10 || s == 12, "step %d", s);
    c.checkpoint.interval = 0;
    for (int s = 1; s <= 12; s++) cr_expect_eq(ckpt_due(&c, s), s == 12, "interval 0, step %d", s);
}

Test(checkpoint, check_dir_creates_the_root)
{
    struct rig a;
    rig_init(&a, 32, 1, 0.0f);
    snprintf(a.c.checkpoint.dir, sizeof a.c.checkpoint.dir, "%s/deep/er", a.root);
    ckpt_check_dir(&a.c, &a.mesh, false);
    struct stat st;
    cr_expect(stat(a.c.checkpoint.dir, &st) == 0 && S_ISDIR(st.st_mode));
    rig_free(&a, true);
}

/* an unusable checkpoint.dir stops the run at start-up (mt_user_error: exit 1) */
Test(checkpoint, check_dir_rejects_an_unwritable_root, .exit_code = 1)
{
    struct rig a;
    rig_init(&a, 32, 1, 0.0f);
    rmdir(a.root);
    strcpy(a.c.checkpoint.dir, "/proc/mt_ckpt_cannot_be_here");
    ckpt_check_dir(&a.c, &a.mesh, false);
}

/* --- damaged checkpoints ------------------------------------------------------------------- */

static void saved(struct rig *a, char *dir, size_t cap)
{
    rig_init(a, 32, 1, 0.0f);
    ckpt_save(a->root, 4, &a->p, &a->mesh, &a->c, a->bias);
    path_in(dir, cap, a->root, 4, NULL);
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}

Test(checkpoint, truncated_rank_file_is_an_error)
{
    struct rig a;
    char dir[256], p[512];
    saved(&a, dir, sizeof dir);
    path_in(p, sizeof p, a.root, 4, "rank_00000.h5");
    struct stat st;
    cr_assert_eq(stat(p, &st), 0);
    cr_assert_eq(truncate(p, st.st_size / 2), 0);
    expect_load_error(&a, dir, "rank_00000.h5: cannot open the rank file (truncated", NULL);
    rig_free(&a, true);
}

Test(checkpoint, missing_rank_file_is_an_error)
{
    struct rig a;
    char dir[256], p[512];
    saved(&a, dir, sizeof dir);
    path_in(p, sizeof p, a.root, 4, "rank_00000.h5");
    cr_assert_eq(unlink(p), 0);
    expect_load_error(&a, dir, "rank file rank_00000.h5 is missing", "written by 1 ranks");
    rig_free(&a, true);
}

static void delete_dataset(const char *file, const char *name)
{
    hid_t f = H5Fopen(file, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0);
    cr_assert(H5Ldelete(f, name, H5P_DEFAULT) >= 0, "H5Ldelete %s", name);
    H5Fclose(f);
}

Test(checkpoint, missing_dataset_is_an_error)
{
    struct rig a;
    char dir[256], p[512];
    saved(&a, dir, sizeof dir);
    path_in(p, sizeof p, a.root, 4, "rank_00000.h5");
    delete_dataset(p, "adam_v/model.layers.2.self_attn.k_proj.weight");
    expect_load_error(&a, dir, "rank_00000.h5: dataset adam_v/model.layers.2.self_attn.k_proj.weight is missing", NULL);
    rig_free(&a, true);
}

Test(checkpoint, tensor_missing_from_every_group_is_an_error)
{
    struct rig a;
    char dir[256], p[512];
    saved(&a, dir, sizeof dir);
    path_in(p, sizeof p, a.root, 4, "rank_00000.h5");
    for (int b = 0; b < 3; b++) {
        const char *g[] = {"master", "adam_m", "adam_v"};
        char name[128];
        snprintf(name, sizeof name, "%s/model.layers.1.mlp.experts.down_proj", g[b]);
        delete_dataset(p, name);
    }
    expect_load_error(&a, dir, "of model.layers.1.mlp.experts.down_proj (a dataset is missing)", "rank files hold 0 of the");
    rig_free(&a, true);
}

static void set_int_attr(const char *file, const char *obj, const char *name, const int64_t *v)
{
    hid_t f = H5Fopen(file, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0);
    /* (H5Aopen_by_name then H5Awrite fails in HDF5 1.10: open the object first) */
    hid_t o = H5Oopen(f, obj, H5P_DEFAULT);
    cr_assert(o >= 0, "object %s", obj);
    hid_t a = H5Aopen(o, name, H5P_DEFAULT);
    cr_assert(a >= 0, "attribute %s of %s", name, obj);
    cr_assert(H5Awrite(a, H5T_NATIVE_INT64, v) >= 0);
    H5Aclose(a);
    H5Oclose(o);
    H5Fclose(f);
}

Test(checkpoint, manifest_with_another_hidden_size_is_an_error)
{
    struct rig a;
    char dir[256], p[512];
    saved(&a, dir, sizeof dir);
    path_in(p, sizeof p, a.root, 4, "manifest.h5");
    int64_t h = 48;
    set_int_attr(p, "model", "hidden_size", &h);
    expect_load_error(&a, dir, "saved with model.hidden_size = 48, the config has 32", "manifest.h5");
    rig_free(&a, true);
}

Test(checkpoint, config_with_another_model_shape_is_an_error)
{
    struct rig a;
    char dir[256], err[1024] = "";
    saved(&a, dir, sizeof dir);
    /* the same checkpoint, loaded into a model with hidden_size 48 */
    cr_assert_not(try_load(&a, dir, 48, err, sizeof err));
    cr_expect(strstr(err, "model.hidden_size = 32, the config has 48") != NULL, "%s", err);
    rig_free(&a, true);
}

Test(checkpoint, dataset_with_a_wrong_shape_is_an_error)
{
    struct rig a;
    char dir[256], p[512];
    saved(&a, dir, sizeof dir);
    path_in(p, sizeof p, a.root, 4, "rank_00000.h5");
    int64_t shape[2] = {80, 33};
    set_int_attr(p, "master/model.embed_tokens.weight", "global_shape", shape);
    expect_load_error(&a, dir, "dataset master/model.embed_tokens.weight has global shape [80, 33], the model has [80, 32]",
                      NULL);
    rig_free(&a, true);
}

Test(checkpoint, manifest_that_is_not_a_checkpoint_is_an_error)
{
    struct rig a;
    char dir[256], p[512];
    saved(&a, dir, sizeof dir);
    path_in(p, sizeof p, a.root, 4, "manifest.h5");
    FILE *f = fopen(p, "w");
    cr_assert(f);
    fputs("{\"this\": \"is json\"}\n", f);
    fclose(f);
    expect_load_error(&a, dir, "manifest.h5: cannot open the manifest", NULL);
    /* an HDF5 file, but not ours */
    hid_t h = H5Fcreate(p, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    cr_assert(h >= 0);
    H5Fclose(h);
    expect_load_error(&a, dir, "manifest.h5: not a moetrain checkpoint manifest", NULL);
    rig_free(&a, true);
}

Test(checkpoint, corrupted_data_is_caught_by_the_checksum)
{
    struct rig a;
    char dir[256], p[512];
    saved(&a, dir, sizeof dir);
    path_in(p, sizeof p, a.root, 4, "rank_00000.h5");
    /* the raw fp32 bytes of 16 master values of one tensor appear verbatim in the file (no
     * compression, little-endian): flip one bit in the middle of them */
    int i = tensor_find(&a.m.tt, "model.layers.1.self_attn.o_proj.weight");
    cr_assert(i >= 0);
    const float *vals = a.p.g[TG_DENSE].master + a.p.g[TG_DENSE].u_off[tensor_unit(&a.m.tt.t[i], a.m.L)] +
                        a.p.t_off[i] + 100;
    FILE *fp = fopen(p, "r+b");
    cr_assert(fp);
    cr_assert_eq(fseek(fp, 0, SEEK_END), 0);
    long size = ftell(fp);
    char *bytes = malloc((size_t)size);
    rewind(fp);
    cr_assert_eq(fread(bytes, 1, (size_t)size, fp), (size_t)size);
    const char *hit = memmem(bytes, (size_t)size, vals, 16 * sizeof(float));
    cr_assert(hit != NULL, "the values are not in the file");
    long at = (long)(hit - bytes) + 30;
    cr_assert_eq(fseek(fp, at, SEEK_SET), 0);
    fputc(bytes[at] ^ 0x10, fp);
    fclose(fp);
    free(bytes);
    expect_load_error(&a, dir, "rank_00000.h5: reading master/model.layers.1.self_attn.o_proj.weight failed", NULL);
    rig_free(&a, true);
}

/* --- a non-finite value is never checkpointed ----------------------------------------------- */

/* In a child (the refusal exits 1 on every rank): a good save of step 1, then a save of step 2
 * with one NaN in `buf` (0 master, 1 m1, 2 m2, 3 the bias). Step 2 must not exist, step 1 must. */
static void save_with_a_nan(int buf)
{
    struct rig a;
    rig_init(&a, 32, 1, 0.0f);
    a.c.checkpoint.keep = 1;
    ckpt_save(a.root, 1, &a.p, &a.mesh, &a.c, a.bias);
    fflush(NULL);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        struct param_group_shard *g = &a.p.g[0];
        float *x = buf == 0 ? g->master : buf == 1 ? g->m1 : buf == 2 ? g->m2 : a.bias;
        x[buf == 3 ? 5 : g->numel / 2] = buf == 1 ? INFINITY : NAN;
        ckpt_save(a.root, 2, &a.p, &a.mesh, &a.c, a.bias);
        _exit(0);
    }
    int st = 0;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 1, "buffer %d: the save of a non-finite value did not exit 1", buf);
    char p[512];
    path_in(p, sizeof p, a.root, 2, NULL);
    cr_expect_neq(access(p, F_OK), 0, "buffer %d: step 2 was written", buf);
    char tmp[520];
    snprintf(tmp, sizeof tmp, "%s.tmp", p);
    cr_expect_neq(access(tmp, F_OK), 0, "buffer %d: its .tmp was left behind", buf);
    cr_expect_eq(ckpt_latest(a.root, NULL, 0), 1, "buffer %d: the good checkpoint is gone", buf);
    rig_free(&a, true);
}

Test(checkpoint, a_nonfinite_value_is_never_checkpointed)
{
    for (int buf = 0; buf < 4; buf++) save_with_a_nan(buf);
}
