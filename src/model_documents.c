/* Per-token positions and document ids for packed sequences (data.document_masking): the data layer
 * computes them on the host, the model keeps device copies that RoPE and attention read. */
#include <stdlib.h>

#include "common.h"
#include "model.h"

void model_set_documents(struct model *m, const int32_t *pos_host, const int32_t *seg_host)
{
    const struct backend *be = m->be;
    const size_t bytes = (size_t)m->T * sizeof(int32_t);
    MT_CHECK((pos_host == NULL) == (seg_host == NULL),
             "model_set_documents: positions and document ids come together");
    if (!seg_host) {
        if (!m->seg) return;   /* already plain: positions are still t mod S */
        int32_t *pos = mt_malloc(bytes);
        for (int t = 0; t < m->T; t++) pos[t] = t % m->S;
        be->upload(m->pos, pos, bytes);
        free(pos);
        be->free(m->seg);
        m->seg = NULL;
        return;
    }
    for (int t = 0; t < m->T; t++)
        MT_CHECK(pos_host[t] >= 0 && pos_host[t] <= t % m->S,
                 "model_set_documents: position %d of token %d is outside [0, %d]", pos_host[t], t,
                 t % m->S);
    if (!m->seg) m->seg = be->alloc(bytes);
    be->upload(m->pos, pos_host, bytes);
    be->upload(m->seg, seg_host, bytes);
}
