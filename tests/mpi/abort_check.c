/* mpirun -np 2 abort_check DIR
 * Every rank registers a before-abort hook (common.h mt_set_before_abort) that writes
 * DIR/before_abort_<rank>; then rank 1 calls mt_fatal while rank 0 waits in a barrier. The job
 * must end non-zero with rank 1's one-line error, and rank 1's hook must have run before
 * MPI_Abort (which runs no atexit handler): the way the watchdog removes its heartbeat file. */
#include <mpi.h>
#include <stdio.h>

#include "common.h"

static const char *g_dir;

static void write_marker(void)
{
    char path[MT_PATH_MAX];
    snprintf(path, sizeof path, "%s/before_abort_%d", g_dir, mt_rank());
    FILE *f = fopen(path, "w");
    if (f) fclose(f);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    if (argc != 2) mt_user_error("usage: abort_check DIR");
    g_dir = argv[1];
    mt_set_before_abort(write_marker);
    if (mt_rank() == 1) mt_fatal("abort_check: the fatal error of rank %d", mt_rank());
    MPI_Barrier(MPI_COMM_WORLD); /* rank 0 waits here until the abort ends it */
    MPI_Finalize();
    return 0;
}
