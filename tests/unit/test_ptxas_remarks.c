/* ptxas's advisories about wgmma, checked in what the build printed. A line such as
 *   ptxas info : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized ...
 *   ptxas info : (C7519) warpgroup.arrive is injected in around line N by compiler ...
 * means a Hopper kernel's MMAs run one after another, or behind extra fences: the forty-eighth
 * session's grouped GEMM change that drew them slowed every tile 12-18% (docs/benchmarks.md).
 * None of our kernels draws one. The Makefile keeps nvcc's messages for each CUDA object beside
 * it ($(BUILD)/cuda/X.nvcc.log); this test names the file and the message, on any machine that
 * builds the CUDA code, GPU or not. */
#include <criterion/criterion.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* the wgmma advisories (ptxas's C75xx remarks) in one nvcc log, appended to msg as "what: line";
 * returns their count, or -1 where the log cannot be opened */
static int remarks_in(const char *log, const char *what, char *msg, size_t cap)
{
    FILE *f = fopen(log, "r");
    if (!f) return -1;
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof line, f))
        if (strstr(line, "ptxas") && strstr(line, "(C75")) {
            n++;
            snprintf(msg + strlen(msg), cap - strlen(msg), "%s: %s", what, line);
        }
    fclose(f);
    return n;
}

Test(build, no_cuda_object_draws_a_ptxas_wgmma_advisory)
{
#ifndef MT_HAVE_CUDA
    cr_skip_test("built without CUDA: no ptxas messages to read");
#else
    const char *build = getenv("MT_BUILD") ? getenv("MT_BUILD") : "build";
    glob_t g;
    cr_assert_eq(glob("cuda/*.cu", 0, NULL, &g), 0, "no cuda/*.cu here (run from the repository root)");
    static char msg[65536];
    msg[0] = '\0';
    int found = 0;
    for (size_t i = 0; i < g.gl_pathc; i++) {
        const char *src = g.gl_pathv[i];
        char log[4096];
        snprintf(log, sizeof log, "%s/%.*s.nvcc.log", build, (int)(strlen(src) - 3), src);
        const int n = remarks_in(log, src, msg, sizeof msg);
        cr_expect(n >= 0, "%s: no %s; an object built before the Makefile kept nvcc's messages "
                  "(rebuild the CUDA objects: rm -rf %s/cuda)", src, log, build);
        if (n > 0) found += n;
    }
    globfree(&g);
    cr_expect(found == 0, "ptxas's wgmma advisories (the kernel's MMAs serialised or fenced):\n%s", msg);
#endif
}

/* the scan itself: it finds both kinds of advisory and passes over the rest of ptxas's output */
Test(build, the_scan_finds_a_wgmma_advisory)
{
    char path[] = "/tmp/mt_nvcc_log_XXXXXX";
    const int fd = mkstemp(path);
    cr_assert(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
          "ptxas info    : Used 168 registers, used 2 barriers, 1344 bytes smem\n"
          "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are "
          "serialized due to program dependence on compiler-inserted WG.AR in divergent path in "
          "the function 'k'\n"
          "cuda/x.cu(12): warning #177-D: variable \"C75\" was declared but never referenced\n"
          "ptxas info    : (C7519) warpgroup.arrive is injected in around line 669 by compiler to "
          "allow use of registers in GMMA in function 'k'\n",
          f);
    fclose(f);
    static char msg[4096];
    msg[0] = '\0';
    cr_expect_eq(remarks_in(path, "cuda/x.cu", msg, sizeof msg), 2, "%s", msg);
    cr_expect(strstr(msg, "cuda/x.cu: ptxas info    : (C7520)"), "%s", msg);
    cr_expect(strstr(msg, "cuda/x.cu: ptxas info    : (C7519)"), "%s", msg);
    cr_expect(!strstr(msg, "Used 168"), "%s", msg);
    unlink(path);
    msg[0] = '\0';
    cr_expect_eq(remarks_in(path, "cuda/x.cu", msg, sizeof msg), -1, "a missing log reads as missing");
}
