/* A kernel timeline without a profiler: preloaded into any CUDA program, CUPTI's activity API
 * records when every kernel, copy and memset ran on the GPU (start and end in ns, stream), which
 * is written to $MT_TRACE_OUT (default kernel_trace.csv; a "%r" in it becomes the process's MPI
 * rank, from OMPI_COMM_WORLD_RANK, PMIX_RANK or SLURM_PROCID, so that each rank of an mpirun or
 * srun job writes its own file) when the program exits:
 *
 *   LD_PRELOAD=build/tools/libmt_trace.so MT_TRACE_OUT=trace.csv build/moetrain train ...
 *   python3 tools/trace_gaps.py trace.csv
 *
 * Unlike log.profile (which synchronises around every op, so short ops look longer than they
 * are) the program runs as it always does: the records come from the GPU's own timestamps, and the
 * gaps between kernels are the device's idle time. Built only where CUPTI is installed
 * (`make build/tools/libmt_trace.so`). CSV rows: kind,start_ns,end_ns,stream,name; kind K (kernel),
 * C (copy: "memcpy kind K B bytes", kind 2 device to host), S (memset), and Y for the host's
 * synchronisations (cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize: a host
 * thread waiting for the GPU, over [start, end) on the same clock) and the streams' event waits
 * (cudaStreamWaitEvent, which only orders the GPU), named by type. */
#include <cupti.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static FILE *out;
static bool tracing; /* every activity kind enabled */

/* false, having said why in one line, when CUPTI cannot record here (no GPU driver, or another
 * profiler holds it); the program then runs untraced and the file keeps only its header */
static bool ok(CUptiResult r, const char *what)
{
    if (r == CUPTI_SUCCESS) return true;
    const char *s = "?";
    cuptiGetResultString(r, &s);
    fprintf(stderr, "kernel_trace: %s failed (%s): nothing is traced\n", what, s);
    return false;
}

static void CUPTIAPI buffer_requested(uint8_t **buf, size_t *size, size_t *max_records)
{
    *size = 16u << 20;
    *buf = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                      size_t valid)
{
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *rec = NULL;
    while (out && cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
        switch (rec->kind) {
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
        case CUPTI_ACTIVITY_KIND_KERNEL: {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
            fprintf(out, "K,%llu,%llu,%u,%s\n", (unsigned long long)k->start,
                    (unsigned long long)k->end, k->streamId, k->name ? k->name : "?");
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)rec;
            fprintf(out, "C,%llu,%llu,%u,memcpy kind %u %llu B\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, m->streamId, (unsigned)m->copyKind,
                    (unsigned long long)m->bytes);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY2: { /* between devices: the all-to-all's copies to a peer */
            const CUpti_ActivityMemcpyPtoP4 *m = (const CUpti_ActivityMemcpyPtoP4 *)rec;
            fprintf(out, "C,%llu,%llu,%u,memcpy kind %u %llu B to device %u\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, m->streamId, (unsigned)m->copyKind, (unsigned long long)m->bytes,
                    m->dstDeviceId);
            break;
        }
        case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: {
            const CUpti_ActivitySynchronization2 *y = (const CUpti_ActivitySynchronization2 *)rec;
            static const char *types[] = {"unknown sync", "event synchronize", "stream wait event",
                                          "stream synchronize", "context synchronize"};
            const unsigned t = (unsigned)y->type < 5 ? (unsigned)y->type : 0;
            fprintf(out, "Y,%llu,%llu,%u,%s\n", (unsigned long long)y->start, (unsigned long long)y->end,
                    y->streamId, types[t]);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)rec;
            fprintf(out, "S,%llu,%llu,%u,memset %llu B\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes);
            break;
        }
        default: break;
        }
    }
    free(buf);
}

/* the MPI rank the launcher gave this process, "0" without one */
static const char *launcher_rank(void)
{
    static const char *vars[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return v;
    }
    return "0";
}

/* $MT_TRACE_OUT with each "%r" replaced by the rank */
static void trace_path(char *buf, size_t cap)
{
    const char *spec = getenv("MT_TRACE_OUT");
    if (!spec || !*spec) spec = "kernel_trace.csv";
    size_t n = 0;
    for (const char *c = spec; *c && n + 1 < cap; c++) {
        if (c[0] == '%' && c[1] == 'r') {
            n += (size_t)snprintf(buf + n, cap - n, "%s", launcher_rank());
            c++;
        } else {
            buf[n++] = *c;
        }
        if (n >= cap) n = cap - 1;
    }
    buf[n] = '\0';
}

__attribute__((constructor)) static void trace_start(void)
{
    char path[4096];
    trace_path(path, sizeof path);
    out = fopen(path, "w");
    if (!out) {
        fprintf(stderr, "kernel_trace: cannot write %s: nothing is traced\n", path);
        return;
    }
    fprintf(out, "kind,start_ns,end_ns,stream,name\n");
    fflush(out);
    if (!ok(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks") ||
        !ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enabling kernel records") ||
        !ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enabling copy records") ||
        !ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enabling memset records"))
        return;
    tracing = true;
    /* copies to another GPU are records of their own kind (without them an EP step's exchanges
     * look like idle time on both ranks) */
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY2) != CUPTI_SUCCESS)
        fprintf(stderr, "kernel_trace: no peer-to-peer copy records here: copies to other GPUs are not traced\n");
    /* the host waits (Y rows) are extra: a CUPTI without them still gives the timeline */
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_SYNCHRONIZATION) != CUPTI_SUCCESS)
        fprintf(stderr, "kernel_trace: no synchronisation records here: host waits are not traced\n");
}

__attribute__((destructor)) static void trace_stop(void)
{
    if (!out) return;
    if (tracing) ok(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "flushing the records");
    fclose(out);
    out = NULL;
}
