/* Writing a trained model as a Hugging Face model directory that transformers (and `moetrain
 * verify` / model.init_from) can load, at any size (docs/export.md):
 *   config.json (transformers 4.x spelling, which 5.x also reads), generation_config.json,
 *   model.safetensors, or model-0000k-of-0000N.safetensors shards of at most max_shard_bytes of
 *   tensor data each plus model.safetensors.index.json (metadata.total_size, weight_map), and the
 *   tokenizer files of model.init_from when it has them.
 * Hub per-expert names; the aux-loss-free balancing bias, when there is one, as
 * model.layers.{l}.mlp.gate.e_score_correction_bias [E] (fp32, DeepSeek-V3's name).
 * Streaming: the writer asks for one tensor piece at a time (at most HF_EXPORT_CHUNK elements)
 * and writes it before asking for the next; nobody holds the whole model. Written as OUT.tmp and
 * renamed to OUT at the end, so a failed export leaves nothing that looks whole. */
#ifndef MT_HF_EXPORT_H
#define MT_HF_EXPORT_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "safetensors.h"
#include "tensors.h"

#define HF_EXPORT_CHUNK ((int64_t)1 << 24)              /* elements per fetched piece (64 MB fp32) */
#define HF_EXPORT_SHARD_BYTES ((uint64_t)5000000000)    /* the hub's 5 GB shard limit */

bool hf_write_config_json(const char *path, const struct model_config *m, enum st_dtype dtype, char *err,
                          int errcap);

/* One tensor of the output: hub tensor `name` is elements [gstart, gstart + numel) of table
 * tensor `tensor` (flattened global layout), or, for tensor == -1, row `layer` of the balancing
 * bias [L, E]. Stored at data bytes [begin, end) of shard `shard`. */
struct hf_plan_entry {
    char name[128];
    int tensor, layer;
    int ndim;
    int64_t shape[3];
    int64_t gstart, numel;
    enum st_dtype dtype;
    int shard;
    uint64_t begin, end;
};

struct hf_plan {
    int n;
    struct hf_plan_entry *e;    /* [n], in table order, the bias rows last */
    int n_shards;
    uint64_t *shard_bytes;      /* [n_shards] tensor data bytes of each shard */
    uint64_t total_size;        /* sum of shard_bytes (the index's metadata.total_size) */
};

/* Pure arithmetic on the tensor table (no weights): which hub tensor goes to which shard at which
 * byte offset. A shard is closed before a tensor that would take it past max_shard_bytes (a tensor
 * larger than the limit gets a shard of its own, as transformers does). bias_layers: the MoE
 * layers' bias rows are exported (load_balance: bias). */
void hf_plan_build(struct hf_plan *p, const struct tensor_table *tt, const struct model_config *mc,
                   bool bias_layers, enum st_dtype dtype, uint64_t max_shard_bytes);
void hf_plan_free(struct hf_plan *p);
/* "model.safetensors" for one shard, else "model-%05d-of-%05d.safetensors" (k from 0) */
void hf_plan_shard_name(char *out, size_t cap, int k, int n_shards);

/* Fills dst [n] with elements [gstart, gstart + n) of table tensor `tensor` (global flattened
 * layout). Called in the same order on every rank taking part (dst NULL on the ranks that do not
 * write), so an implementation may be collective; it is called on after a failure too. false +
 * message in err (when err is still empty) if the piece could not be read. */
typedef bool (*hf_fetch_fn)(void *ctx, int tensor, int64_t gstart, int64_t n, float *dst, char *err, int errcap);

struct hf_export_opts {
    enum st_dtype dtype;        /* ST_BF16 or ST_F32 */
    uint64_t max_shard_bytes;   /* 0 = HF_EXPORT_SHARD_BYTES */
    bool force;                 /* replace an existing output directory */
    const char *tokenizer_from; /* directory whose tokenizer files are copied ("" / NULL = none) */
};

/* "" when dir can be written as an export (it does not exist, or force; its parent is writable),
 * else a one-line reason in err and false. Creates and removes DIR.tmp to find out. */
bool hf_export_check_dir(const char *dir, bool force, char *err, int errcap);

/* Writes the whole directory. writer: this process writes (the others only call fetch in the same
 * order and return true). bias: [L, E] host, or NULL when there is none. False + one-line message
 * on the writer; DIR is then untouched and DIR.tmp removed. */
bool hf_export_stream(const char *dir, const struct model_config *mc, const struct tensor_table *tt,
                      const float *bias, const struct hf_export_opts *o, bool writer, hf_fetch_fn fetch,
                      void *ctx, char *err, int errcap);

/* The balancing bias rows of an HF directory exported with one (hf_export_stream's names) into
 * bias [L, E]; rows not present stay zero. *found: rows read. false + message on a bad tensor. */
bool hf_load_bias(const char *model_dir, const struct model_config *mc, float *bias, int *found, char *err,
                  int errcap);

struct params;
struct mesh;
/* Collective over the mesh's world: streams the fp32 master shards to rank 0, which writes dir
 * (export_stream.c). Returns the same verdict on every rank. */
bool export_params_hf(const struct params *p, const struct mesh *mesh, const struct config *c,
                      const float *bias, bool force, const char *dir, char *err, int errcap);

#endif
