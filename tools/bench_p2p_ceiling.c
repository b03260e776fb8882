/* The copy engines' own ceiling between GPU 0 and GPU 1 of this host, in one process: what
 * all_to_all_inbox (cuda/comm_ipc.cu) could reach with no protocol around its copies. Four lines
 * per size: one direction; both directions at once; both at once while each GPU also copies as
 * many bytes to itself (the all-to-all's block to self); the copy to self alone. Each is the best
 * of `reps` runs, timed by events on the copy's own stream, in GB/s (1e9 bytes) per direction.
 *
 *   build/tools/bench_p2p_ceiling [MB [reps]]   (default: 35.7 and 140.5 MB, 10 reps)
 *
 * Without CUDA in the build, or with fewer than two GPUs that can map each other's memory, it says
 * so and exits 0. */
#include <stdio.h>
#include <stdlib.h>

#include "common.h"

#ifdef MT_HAVE_CUDA
#include <cuda_runtime_api.h>

#define CK(call)                                                                      \
    do {                                                                              \
        cudaError_t e_ = (call);                                                      \
        if (e_ != cudaSuccess) mt_fatal("%s: %s", #call, cudaGetErrorString(e_));     \
    } while (0)

enum mode { ONE_WAY, TWO_WAY, TWO_WAY_AND_SELF, SELF_ONLY, N_MODES };
static const char *const mode_name[N_MODES] = {"one direction", "both directions",
                                               "both + copy to self", "copy to self alone"};

struct gpu {
    void *src, *dst, *self;  /* src -> the other GPU's dst; src -> self */
    cudaStream_t peer_s, self_s;
    cudaEvent_t p0, p1, s0, s1;
};

/* best times (ms) of the peer copy of GPU 0 and 1 and of GPU 0's copy to itself */
static void run(struct gpu *g, enum mode m, size_t n, int reps, float best[3])
{
    best[0] = best[1] = best[2] = 1e30f;
    for (int r = 0; r < reps; r++) {
        for (int d = 0; d < 2; d++) {
            CK(cudaSetDevice(d));
            if (m == TWO_WAY_AND_SELF || m == SELF_ONLY) {
                CK(cudaEventRecord(g[d].s0, g[d].self_s));
                CK(cudaMemcpyAsync(g[d].self, g[d].src, n, cudaMemcpyDeviceToDevice, g[d].self_s));
                CK(cudaEventRecord(g[d].s1, g[d].self_s));
            }
            if (m == SELF_ONLY || (m == ONE_WAY && d == 1)) continue;
            CK(cudaEventRecord(g[d].p0, g[d].peer_s));
            CK(cudaMemcpyPeerAsync(g[1 - d].dst, 1 - d, g[d].src, d, n, g[d].peer_s));
            CK(cudaEventRecord(g[d].p1, g[d].peer_s));
        }
        for (int d = 0; d < 2; d++) {
            CK(cudaSetDevice(d));
            CK(cudaDeviceSynchronize());
            float ms;
            if (d == 0 && (m == TWO_WAY_AND_SELF || m == SELF_ONLY)) {
                CK(cudaEventElapsedTime(&ms, g[d].s0, g[d].s1));
                if (ms < best[2]) best[2] = ms;
            }
            if (m == SELF_ONLY || (m == ONE_WAY && d == 1)) continue;
            CK(cudaEventElapsedTime(&ms, g[d].p0, g[d].p1));
            if (ms < best[d]) best[d] = ms;
        }
    }
}

static double gbps(size_t n, float ms) { return (double)n / ((double)ms * 1e-3) / 1e9; }

int main(int argc, char **argv)
{
    const double mb_arg = argc > 1 ? atof(argv[1]) : 0;
    const int reps = argc > 2 ? atoi(argv[2]) : 10;
    if (argc > 1 && mb_arg <= 0) mt_user_error("usage: bench_p2p_ceiling [MB > 0 [reps > 0]]");
    if (reps <= 0) mt_user_error("usage: bench_p2p_ceiling [MB > 0 [reps > 0]]");
    int n_gpu = 0, can01 = 0, can10 = 0;
    if (cudaGetDeviceCount(&n_gpu) != cudaSuccess) {
        (void)cudaGetLastError();
        n_gpu = 0;
    }
    if (n_gpu >= 2) {
        CK(cudaDeviceCanAccessPeer(&can01, 0, 1));
        CK(cudaDeviceCanAccessPeer(&can10, 1, 0));
    }
    if (n_gpu < 2 || !can01 || !can10) {
        printf("bench_p2p_ceiling: skipped: needs two GPUs that can map each other's memory (%d GPU(s))\n", n_gpu);
        return 0;
    }
    const size_t sizes[2] = {(size_t)(mb_arg > 0 ? mb_arg * 1e6 : 35.7e6), (size_t)140.5e6};
    const int n_sizes = mb_arg > 0 ? 1 : 2;
    size_t most = 0;
    for (int k = 0; k < n_sizes; k++) most = sizes[k] > most ? sizes[k] : most;
    struct gpu g[2];
    for (int d = 0; d < 2; d++) {
        CK(cudaSetDevice(d));
        cudaError_t e = cudaDeviceEnablePeerAccess(1 - d, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
        else CK(e);
        CK(cudaMalloc(&g[d].src, most));
        CK(cudaMalloc(&g[d].dst, most));
        CK(cudaMalloc(&g[d].self, most));
        CK(cudaMemset(g[d].src, d + 1, most));
        CK(cudaStreamCreateWithFlags(&g[d].peer_s, cudaStreamNonBlocking));
        CK(cudaStreamCreateWithFlags(&g[d].self_s, cudaStreamNonBlocking));
        cudaEvent_t *ev[4] = {&g[d].p0, &g[d].p1, &g[d].s0, &g[d].s1};
        for (int i = 0; i < 4; i++) CK(cudaEventCreate(ev[i]));
    }
    for (int k = 0; k < n_sizes; k++) {
        const size_t n = sizes[k];
        for (int m = 0; m < N_MODES; m++) {
            float best[3];
            run(g, (enum mode)m, n, reps, best);
            printf("%-20s %7.1f MB:", mode_name[m], (double)n / 1e6);
            if (m != SELF_ONLY) printf(" 0->1 %.1f GB/s", gbps(n, best[0]));
            if (m == TWO_WAY || m == TWO_WAY_AND_SELF) printf(", 1->0 %.1f GB/s", gbps(n, best[1]));
            if (m == TWO_WAY_AND_SELF || m == SELF_ONLY) printf("%s to self %.0f GB/s", m == SELF_ONLY ? "" : ";",
                                                                gbps(n, best[2]));
            printf("\n");
        }
    }
    for (int d = 0; d < 2; d++) {
        CK(cudaSetDevice(d));
        CK(cudaFree(g[d].src));
        CK(cudaFree(g[d].dst));
        CK(cudaFree(g[d].self));
    }
    return 0;
}

#else

int main(void)
{
    printf("bench_p2p_ceiling: skipped: built without CUDA\n");
    return 0;
}

#endif
