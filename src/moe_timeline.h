/* A timeline of the chunked MoE exchange (MT_MOE_TIMELINE=1, docs/scaling.md): for the first MoE
 * layer of the run's last forward and backward, when each chunk's expert GEMMs ran on the compute
 * stream and each chunk's all-to-all on the comm stream, printed at the end of `moetrain train`
 * so one can see chunk c+1's transfer run under chunk c's GEMMs. On a device the points are events
 * recorded on the streams themselves (the GEMM edges on the compute stream, the transfer edges on
 * the comm's side stream); on the CPU they are wall-clock times on the host, a transfer's span
 * running from its start call to the return of its wait. Recording costs a few events per
 * chunk and no synchronisation until the print. */
#ifndef MT_MOE_TIMELINE_H
#define MT_MOE_TIMELINE_H

#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

struct model;

/* How a backend timestamps a point on a stream (NULL = its compute stream): a device backend
 * installs its own (events); the default is the host's clock. ms waits for both points. */
struct moe_timeline_clock {
    int device;                              /* 1: points are recorded on the device's streams */
    void *(*record)(void *stream);
    double (*ms)(void *from, void *to);      /* milliseconds from `from` to `to` */
    void (*release)(void *point);
};
void moe_timeline_set_clock(const struct moe_timeline_clock *c);

/* Whether MT_MOE_TIMELINE=1 (read once; any value but unset, empty, 0 or 1 is a user error, which
 * model_init reports at start-up) */
int moe_timeline_enabled(void);

/* moe_exchange.c: a pass (forward or backward) of layer l starts / ends; edges of chunk spans */
void moe_timeline_begin(const struct model *m, int l, const char *pass);
void moe_timeline_end(const struct model *m);
void moe_timeline_mark(const char *what, int64_t chunk, int end);   /* a compute-stream span */
void moe_timeline_comm(const char *what, int64_t chunk);   /* names the next transfer (host: starts it) */
void moe_timeline_comm_done(const char *what, int64_t chunk);   /* after its wait (host: ends it) */
/* The comm implementations' edges of the named transfer on their own stream (device clocks). */
void moe_timeline_comm_mark(void *stream, int end);

/* Prints the recorded passes and frees them; when the timeline is enabled but nothing was recorded
 * (parallel.moe_chunks = 1), one line saying so; nothing when it is off. */
void moe_timeline_print(FILE *f);

#ifdef __cplusplus
}
#endif

#endif
