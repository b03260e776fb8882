/* The manifest of a checkpoint (manifest.h5, format in docs/checkpoints.md): written by rank 0 at
 * the end of a save, read and validated by rank 0 as phase 1 of a load (COMPLETE marker, format,
 * version, mesh, model shape, balancing bias), and read for its config by --resume. Separate from
 * checkpoint.c and checkpoint_load.c so that the writer and the reader of the model section share
 * one description of it (model_fields) that nothing else sees. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint_manifest.h"
#include "checkpoint_fs.h"
#include "checkpoint_h5.h"
#include "common.h"

/* The fields of the model section that decide tensor shapes. `relevant` is false for those that
 * shape nothing in this model (intermediate_size without dense layers, expert sizes without MoE
 * layers), which are then not compared. */
struct model_field {
    const char *name;
    int64_t value;
    bool relevant;
};
#define MAX_MODEL_FIELDS 16

static bool any_layer(const struct model_config *m, bool moe)
{
    for (int l = 0; l < m->num_hidden_layers; l++)
        if (config_layer_is_moe(m, l) == moe) return true;
    return false;
}

static int model_fields(const struct model_config *m, struct model_field *f)
{
    const bool dense = any_layer(m, false), moe = any_layer(m, true);
    int n = 0;
#define FIELD(key, v, rel) f[n++] = (struct model_field){key, (int64_t)(v), rel}
    FIELD("num_hidden_layers", m->num_hidden_layers, true);
    FIELD("vocab_size", m->vocab_size, true);
    FIELD("hidden_size", m->hidden_size, true);
    FIELD("num_attention_heads", m->num_attention_heads, true);
    FIELD("num_key_value_heads", m->num_key_value_heads, true);
    FIELD("head_dim", config_head_dim(m), true);
    FIELD("tie_word_embeddings", m->tie_word_embeddings, true);
    FIELD("intermediate_size", m->intermediate_size, dense);
    FIELD("num_experts", m->num_experts, moe);
    FIELD("moe_intermediate_size", m->moe_intermediate_size, moe);
#undef FIELD
    return n;
}

/* --- writing (rank 0, at the end of a save) ------------------------------------------------ */

/* Names this process's saves in their manifests: which launch of the job wrote a checkpoint. */
static const char *run_id(void)
{
    static char id[32];
    if (!id[0]) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        snprintf(id, sizeof id, "%08lx-%05x", (unsigned long)ts.tv_sec, (unsigned)(getpid() & 0xfffff));
    }
    return id;
}

void ck_write_manifest(const char *path, int step, const struct params *p, const struct mesh *mesh,
                       const struct config *c, const float *bias, int64_t save_seq)
{
    ck_h5_context(path);
    hid_t fapl = ck_fapl();
    hid_t f = CK_H5(H5Fcreate(path, H5F_ACC_EXCL, H5P_DEFAULT, fapl));
    ck_write_attr_str(f, "format", CK_FORMAT_MANIFEST);
    const struct mesh_dims *d = &mesh->d;
    int64_t meta[] = {CKPT_FORMAT_VERSION, step, p->step, step, d->world, d->pp, d->ep, d->ep_fsdp,
                      d->ep_outside, d->S};
    const char *meta_names[] = {"format_version", "step", "optimizer_step", "data_position", "world",
                                "pp", "ep", "ep_fsdp", "ep_outside", "stage_size"};
    for (size_t j = 0; j < sizeof meta / sizeof meta[0]; j++) ck_write_attr_i64(f, meta_names[j], &meta[j], 1);
    ck_write_attr_i64(f, "save_seq", &save_seq, 1);
    ck_write_attr_str(f, "run_id", run_id());

    const struct model_config *mc = &c->model;
    hid_t g = CK_H5(H5Gcreate2(f, "model", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    struct model_field fields[MAX_MODEL_FIELDS];
    int nf = model_fields(mc, fields);
    for (int j = 0; j < nf; j++) ck_write_attr_i64(g, fields[j].name, &fields[j].value, 1);
    const int L = mc->num_hidden_layers;
    int64_t *moe = mt_malloc((size_t)L * sizeof(int64_t));
    for (int l = 0; l < L; l++) moe[l] = config_layer_is_moe(mc, l);
    ck_write_attr_i64(g, "moe_layers", moe, L);
    free(moe);
    CK_H5(H5Gclose(g));

    int len = config_to_yaml(c, NULL, 0);
    char *yaml = mt_malloc((size_t)len + 1);
    config_to_yaml(c, yaml, len + 1);
    ck_write_string_dataset(f, "config_yaml", yaml, (size_t)len);
    free(yaml);

    if (bias) {
        hsize_t dims[2] = {(hsize_t)L, (hsize_t)mc->num_experts};
        hid_t sp = CK_H5(H5Screate_simple(2, dims, NULL));
        /* checksummed like the weights: a flipped byte is a read error, not a silently wrong bias */
        hid_t dcpl = CK_H5(H5Pcreate(H5P_DATASET_CREATE));
        CK_H5(H5Pset_chunk(dcpl, 2, dims));
        CK_H5(H5Pset_fletcher32(dcpl));
        hid_t ds = CK_H5(H5Dcreate2(f, "balance_bias", H5T_IEEE_F32LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT));
        CK_H5(H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, bias));
        CK_H5(H5Dclose(ds));
        CK_H5(H5Pclose(dcpl));
        CK_H5(H5Sclose(sp));
    }
    CK_H5(H5Fflush(f, H5F_SCOPE_GLOBAL));
    CK_H5(H5Fclose(f));
    CK_H5(H5Pclose(fapl));
    ck_h5_context(NULL);
    if (!ck_fsync_path(path)) mt_fatal("fsync(%s): %s", path, strerror(errno));
}

/* --- reading (phase 1 of a load, rank 0) --------------------------------------------------- */

static bool check_model(hid_t f, const char *path, const struct config *c, char *err, int cap)
{
    if (!ck_link_exists(f, "model")) return ck_errf(err, cap, "%s: group 'model' is missing", path);
    hid_t g = CK_H5(H5Gopen2(f, "model", H5P_DEFAULT));
    char what[MT_PATH_MAX * 2 + 16];
    snprintf(what, sizeof what, "%s: model", path);
    struct model_field fields[MAX_MODEL_FIELDS];
    int nf = model_fields(&c->model, fields);
    bool ok = true;
    for (int j = 0; j < nf && ok; j++) {
        if (!fields[j].relevant) continue;
        int64_t v = 0;
        ok = ck_read_attr_i64(g, fields[j].name, &v, 1, NULL, what, err, cap);
        if (ok && v != fields[j].value)
            ok = ck_errf(err, cap, "%s: the checkpoint was saved with model.%s = %lld, the config has %lld "
                       "(the model shape must match; the mesh may differ)", path, fields[j].name,
                       (long long)v, (long long)fields[j].value);
    }
    const int L = c->model.num_hidden_layers;
    int64_t *moe = mt_malloc((size_t)L * sizeof(int64_t));
    if (ok) ok = ck_read_attr_i64(g, "moe_layers", moe, L, NULL, what, err, cap);
    for (int l = 0; l < L && ok; l++)
        if ((moe[l] != 0) != config_layer_is_moe(&c->model, l))
            ok = ck_errf(err, cap, "%s: layer %d is %s in the checkpoint and %s in the config "
                       "(model.decoder_sparse_step / mlp_only_layers must match)", path, l,
                       moe[l] ? "MoE" : "dense", moe[l] ? "dense" : "MoE");
    free(moe);
    CK_H5(H5Gclose(g));
    return ok;
}

static bool read_bias(hid_t f, const char *path, struct ck_manifest *man, float **bias, char *err, int cap)
{
    if (!ck_link_exists(f, "balance_bias")) return true;
    hid_t d = H5Dopen2(f, "balance_bias", H5P_DEFAULT);
    if (d < 0) return ck_errf(err, cap, "%s: cannot open dataset balance_bias", path);
    hid_t sp = CK_H5(H5Dget_space(d));
    hsize_t dims[2] = {0, 0};
    bool ok = H5Sget_simple_extent_ndims(sp) == 2;
    if (ok) CK_H5(H5Sget_simple_extent_dims(sp, dims, NULL));
    ok = ok && dims[0] > 0 && dims[1] > 0 && dims[0] * dims[1] < ((hsize_t)1 << 31);
    if (!ok) ck_errf(err, cap, "%s: dataset balance_bias is not an [L, E] matrix", path);
    if (ok) {
        *bias = mt_malloc((size_t)(dims[0] * dims[1]) * sizeof(float));
        if (H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, *bias) < 0) {
            char m[512];
            ck_h5_message(m, sizeof m);
            ok = ck_errf(err, cap, "%s: cannot read balance_bias: %s", path, m);
        }
        man->has_bias = 1;
        man->bias_L = (int64_t)dims[0];
        man->bias_E = (int64_t)dims[1];
    }
    CK_H5(H5Sclose(sp));
    CK_H5(H5Dclose(d));
    return ok;
}

bool ck_read_manifest(const char *dir, const struct config *c, struct ck_manifest *man, float **bias,
                     char *err, int cap)
{
    memset(man, 0, sizeof *man);
    char path[MT_PATH_MAX * 2];
    struct stat st;
    if (stat(dir, &st) != 0) return ck_errf(err, cap, "checkpoint %s: %s", dir, strerror(errno));
    if (!S_ISDIR(st.st_mode)) return ck_errf(err, cap, "checkpoint %s: not a directory", dir);
    ck_path(path, sizeof path, "%s/%s", dir, CK_MANIFEST);
    if (!ck_file_exists(path)) {
        char newest[MT_PATH_MAX * 2];
        if (ckpt_latest(dir, newest, (int)sizeof newest) >= 0)
            return ck_errf(err, cap, "%s is a checkpoint root, not a checkpoint (no %s); its newest "
                         "checkpoint is %s (--resume auto picks it)", dir, CK_MANIFEST, newest);
        return ck_errf(err, cap, "%s is not a checkpoint directory (no %s)", dir, CK_MANIFEST);
    }
    char marker[MT_PATH_MAX * 2];
    ck_path(marker, sizeof marker, "%s/%s", dir, CK_COMPLETE);
    if (!ck_file_exists(marker))
        return ck_errf(err, cap, "checkpoint %s is incomplete (no %s marker): its save did not finish", dir, CK_COMPLETE);

    hid_t f = ck_open_ro(path, "the manifest", err, cap);
    if (f < 0) return false;
    char fmt[64] = "";
    char ignored[CK_ERR_CAP] = "";
    bool ok = ck_read_attr_str(f, "format", fmt, sizeof fmt, path, ignored, (int)sizeof ignored) &&
              !strcmp(fmt, CK_FORMAT_MANIFEST);
    if (!ok) ck_errf(err, cap, "%s: not a moetrain checkpoint manifest (its 'format' attribute is missing or wrong)", path);
    if (ok) ok = ck_read_attr_i64(f, "format_version", &man->version, 1, NULL, path, err, cap);
    if (ok && man->version != CKPT_FORMAT_VERSION)
        ok = ck_errf(err, cap, "%s: checkpoint format version %lld, this moetrain reads version %d", path,
                   (long long)man->version, CKPT_FORMAT_VERSION);
    const char *names[] = {"step", "optimizer_step", "data_position", "world", "pp", "ep", "ep_fsdp",
                           "ep_outside", "stage_size"};
    int64_t *dst[] = {&man->step, &man->opt_step, &man->data_pos, &man->world, &man->pp, &man->ep,
                      &man->ep_fsdp, &man->ep_outside, &man->S};
    for (size_t j = 0; j < sizeof names / sizeof names[0] && ok; j++)
        ok = ck_read_attr_i64(f, names[j], dst[j], 1, NULL, path, err, cap);
    if (ok && (man->world < 1 || man->world > (1 << 24) || man->step < 0 || man->step > INT32_MAX ||
               man->opt_step < 0 || man->opt_step > INT32_MAX))
        ok = ck_errf(err, cap, "%s: impossible values (world %lld, step %lld, optimizer_step %lld)", path,
                   (long long)man->world, (long long)man->step, (long long)man->opt_step);
    /* the mesh is only reported, but a manifest that contradicts itself is a damaged one */
    if (ok && (man->pp < 1 || man->ep < 1 || man->ep_fsdp < 1 || man->S < 1 || man->pp > man->world ||
               man->S > man->world || man->pp * man->S != man->world || man->ep * man->ep_fsdp != man->S))
        ok = ck_errf(err, cap, "%s: inconsistent mesh (world %lld, pp %lld, stage_size %lld, ep %lld, ep_fsdp "
                     "%lld)", path, (long long)man->world, (long long)man->pp, (long long)man->S,
                     (long long)man->ep, (long long)man->ep_fsdp);
    if (ok) ok = check_model(f, path, c, err, cap);
    if (ok) ok = read_bias(f, path, man, bias, err, cap);
    CK_H5(H5Fclose(f));
    return ok;
}

bool ckpt_read_config(const char *dir, int n_sets, char **sets, struct config *c, char *err, int cap)
{
    char path[MT_PATH_MAX * 2], marker[MT_PATH_MAX * 2];
    ck_path(path, sizeof path, "%s/%s", dir, CK_MANIFEST);
    ck_path(marker, sizeof marker, "%s/%s", dir, CK_COMPLETE);
    if (!ck_file_exists(path) || !ck_file_exists(marker))
        return ck_errf(err, cap, "%s is not a complete checkpoint (no %s or %s)", dir, CK_MANIFEST, CK_COMPLETE);
    hid_t f = ck_open_ro(path, "the manifest", err, cap);
    if (f < 0) return false;
    bool ok = false;
    if (!ck_link_exists(f, "config_yaml")) {
        ck_errf(err, cap, "%s: no 'config_yaml' dataset", path);
    } else {
        hid_t d = CK_H5(H5Dopen2(f, "config_yaml", H5P_DEFAULT));
        hid_t t = CK_H5(H5Dget_type(d));
        size_t len = H5Tget_size(t);
        char *yaml = mt_calloc(len + 1, 1);
        CK_H5(H5Dread(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, yaml));
        ok = config_load_string_checked(c, path, yaml, strlen(yaml), n_sets, sets, err, cap);
        free(yaml);
        CK_H5(H5Tclose(t));
        CK_H5(H5Dclose(d));
    }
    CK_H5(H5Fclose(f));
    return ok;
}
