/* Hugging Face weights <-> the tensor table's flat fp32 buffers.
 *
 * A model directory holds model.safetensors, or model.safetensors.index.json plus the shards its
 * "weight_map" names (each opened once). Tensors are looked up by their hub names (tensor_spec.hf_name:
 * per-expert gate_proj/up_proj/down_proj, dense gate_proj/up_proj) and fused into the table's layout;
 * when the hub names are absent, the fused transformers-5 in-memory name (tensor_spec.name, e.g.
 * "model.layers.0.mlp.experts.gate_up_proj" [E, 2I, H]) is accepted instead. Every hub tensor's
 * shape is checked exactly; F32, BF16, F16 (and F64) are converted to float. */
#ifndef MT_HF_LOAD_H
#define MT_HF_LOAD_H

#include <stdbool.h>
#include <stdint.h>

#include "safetensors.h"
#include "tensors.h"

/* An opened set of weight files. model_path: a model directory, or one .safetensors file. */
struct hf_source;
struct hf_source *hf_open(const char *model_path, char *err, int errcap);
void hf_close(struct hf_source *src);
/* The file named in "not found" messages: the single .safetensors file or the index. */
const char *hf_source_path(const struct hf_source *src);
/* Tensors present in the files that no hf_read_tensor call has used so far. */
int hf_count_unused(const struct hf_source *src);

/* Reads tensor s into dst in the table's layout. For TK_EXPERT only experts [e0, e0 + ne) are read
 * (dst [ne, shape[1], shape[2]]), so a rank can load just the experts it holds; for the other kinds
 * pass e0 = 0, ne = 1 (dst [numel]). */
bool hf_read_tensor(struct hf_source *src, const struct tensor_spec *s, int64_t e0, int64_t ne,
                    float *dst, char *err, int errcap);

/* Fills the full (unsharded) fp32 buffers: tensor i at group_buf[tensor_group_of(&tt->t[i])] +
 * tt->t[i].offset. Tensors in the files that the model does not use are ignored; hf_load_weights
 * warns once (rank 0) with their count, the _counted form returns the count instead. */
bool hf_load_weights(const char *model_dir, const struct tensor_table *tt, float *const group_buf[TG_COUNT],
                     char *err, int errcap);
bool hf_load_weights_counted(const char *model_dir, const struct tensor_table *tt,
                             float *const group_buf[TG_COUNT], int *n_unused, char *err, int errcap);

/* Writes the weights under their hub names (experts split per expert, fused gate_up split into gate and
 * up) in dtype "F32" or "BF16" (round to nearest even). model_dir_or_file: a path ending in
 * ".safetensors" is written as that file; anything else is a directory (created if missing) that gets
 * model.safetensors. */
/* A 1-D tensor `name` of n elements that a model may lack: *present false (and dst untouched)
 * when absent; a present one of another shape is an error. */
bool hf_read_optional(struct hf_source *src, const char *name, int64_t n, float *dst, bool *present, char *err,
                      int errcap);

/* Hub tensor `part` (< n_hf) of expert `expert` (0 for the other kinds) of s: its name, and its
 * shape (returns ndim). Each is one contiguous range of s's flattened global layout, starting at
 * expert * (numel / shape[0]) + part * (that / n_hf) for experts, part * (numel / n_hf) otherwise. */
void hf_hub_name(char *out, size_t cap, const struct tensor_spec *s, int part, int64_t expert);
int hf_hub_shape(const struct tensor_spec *s, int64_t shape[3]);

bool hf_save_weights(const char *model_dir_or_file, const struct tensor_table *tt,
                     const float *const group_buf[TG_COUNT], const char *dtype, char *err, int errcap);

#endif
