/* Writing a trained model as a Hugging Face model directory that transformers (and `moetrain
 * verify` / model.init_from) can load: config.json in the transformers 4.x spelling (which 5.x also
 * reads) plus model.safetensors with hub per-expert names. */
#ifndef MT_HF_EXPORT_H
#define MT_HF_EXPORT_H

#include <stdbool.h>

#include "config.h"
#include "tensors.h"

bool hf_write_config_json(const char *path, const struct model_config *m, char *err, int errcap);
/* dir is created if missing; global: fp32 host buffers in the tensor table's global layout */
bool hf_export_model(const char *dir, const struct model_config *m, const struct tensor_table *tt,
                     const float *const global[TG_COUNT], char *err, int errcap);

struct params;
struct mesh;
/* Collective over the mesh's world: rank 0 assembles buffer `buf` (0 master, 1 Adam m, 2 Adam v) of
 * the whole model in the global layout of `full` (the whole model's table) from every rank's runs
 * of its own stage's tensors (mesh_stage_owns), one rank at a time; the others' `global` is
 * unused. Any mesh, pipeline stages included. */
void export_gather_global(const struct params *p, const struct mesh *mesh, int buf,
                          const struct tensor_table *full, float *const global[TG_COUNT]);

/* Collective over the mesh's world: gathers the fp32 master shards of every rank and rank 0 writes
 * them to dir with hf_export_model (the others return true). */
bool export_params_hf(const struct params *p, const struct mesh *mesh, const struct model_config *m,
                      const char *dir, char *err, int errcap);

#endif
