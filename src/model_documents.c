/* Per-token positions and document ids for packed sequences (data.document_masking): the data layer
 * computes them on the host, the model keeps device copies per micro-batch slot that RoPE and
 * attention read. */
#include <stdlib.h>

#include "common.h"
#include "model.h"

void model_set_documents(struct model *m, int slot, const int32_t *pos_host, const int32_t *seg_host)
{
    const struct backend *be = m->be;
    const size_t bytes = (size_t)m->T * sizeof(int32_t);
    MT_CHECK(slot >= 0 && slot < m->st.n_slots, "model_set_documents: slot %d of %d", slot,
             m->st.n_slots);
    MT_CHECK((pos_host == NULL) == (seg_host == NULL),
             "model_set_documents: positions and document ids come together");
    struct model_slot *sl = &m->slots[slot];
    if (!seg_host) {
        if (sl->seg) {   /* back to plain: positions t mod S, no document ids */
            int32_t *pos = mt_malloc(bytes);
            for (int t = 0; t < m->T; t++) pos[t] = t % m->S;
            be->upload(sl->pos, pos, bytes);
            free(pos);
            be->free(sl->seg);
            sl->seg = NULL;
        }
    } else {
        for (int t = 0; t < m->T; t++)
            MT_CHECK(pos_host[t] >= 0 && pos_host[t] <= t % m->S,
                     "model_set_documents: position %d of token %d is outside [0, %d]", pos_host[t],
                     t, t % m->S);
        if (!sl->seg) sl->seg = be->alloc(bytes);
        be->upload(sl->pos, pos_host, bytes);
        be->upload(sl->seg, seg_host, bytes);
    }
    if (m->slot == slot) m->seg = sl->seg;   /* the current slot's pointers stay its own */
}
