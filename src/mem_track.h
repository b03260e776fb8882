/* moetrain's own account of the memory it allocates through a backend (the measured side of
 * `plan`): every backend allocation is recorded under the category current at the time, and the
 * peak of the total is kept with the breakdown at that moment. The categories are plan's columns. */
#ifndef MT_MEM_TRACK_H
#define MT_MEM_TRACK_H

#include <stddef.h>

enum mem_cat { MEM_WEIGHTS, MEM_GRADS, MEM_MASTER, MEM_ADAM, MEM_ACTS, MEM_BUFFERS, MEM_N };

/* The category of the allocations that follow; returns the previous one (to restore). */
enum mem_cat mem_track_set(enum mem_cat c);
/* Called by the backends' alloc / free (thread-safe). */
void mem_track_alloc(const void *p, size_t bytes);
void mem_track_free(const void *p);
size_t mem_track_current(void);
/* Peak of the total so far, and (by_cat != NULL) each category's bytes at that moment. */
size_t mem_track_peak(double by_cat[MEM_N]);
const char *mem_cat_name(enum mem_cat c);

#endif
