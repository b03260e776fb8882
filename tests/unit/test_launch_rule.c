/* The launch rule of cuda/launch.cuh, checked in the sources: with programmatic dependent launch
 * (on by default on Hopper) a kernel's blocks may start before the writes of the kernel before it
 * are visible, so every kernel must call pdl_wait() before anything else, and every launch must go
 * through cuda_launch (a <<<...>>> launch would run without the attribute: harmless, but an
 * exception to a rule that is easier to keep whole). A kernel added without pdl_wait() would race
 * only on a Hopper GPU; this test names it on any machine. */
#include <criterion/criterion.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* the file's text with comments and string literals blanked (same length, newlines kept) */
static char *code_of(const char *path)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    cr_assert(s && fread(s, 1, (size_t)n, f) == (size_t)n, "cannot read %s", path);
    s[n] = '\0';
    fclose(f);
    for (long i = 0; i < n; i++) {
        if (s[i] == '/' && s[i + 1] == '*') {
            for (; i < n && !(s[i] == '*' && s[i + 1] == '/'); i++)
                if (s[i] != '\n') s[i] = ' ';
            if (i < n) s[i] = s[i + 1] = ' ', i++;
        } else if (s[i] == '/' && s[i + 1] == '/') {
            for (; i < n && s[i] != '\n'; i++) s[i] = ' ';
        } else if (s[i] == '"') {
            for (i++; i < n && s[i] != '"'; i++)
                if (s[i] == '\\') s[i++] = ' ', s[i] = ' ';
                else if (s[i] != '\n') s[i] = ' ';
        }
    }
    return s;
}

static int line_of(const char *s, const char *at)
{
    int line = 1;
    for (const char *p = s; p < at; p++) line += *p == '\n';
    return line;
}

/* the problems of one file, appended to msg: kernels whose body does not begin with pdl_wait(),
 * launches by <<<...>>>; returns the number of kernel bodies seen */
static int check_file(const char *path, char *msg, size_t cap)
{
    char *s = code_of(path);
    int kernels = 0;
    for (const char *p = strstr(s, "__global__"); p; p = strstr(p + 1, "__global__")) {
        /* the body: the first '{' after the parameter list's ')'; a ';' first is a declaration */
        const char *q = p;
        while (*q && *q != ';' && !(*q == ')' && q[strspn(q + 1, " \t\r\n") + 1] == '{')) q++;
        if (*q != ')') continue;
        const char *body = q + 1 + strspn(q + 1, " \t\r\n") + 1;
        body += strspn(body, " \t\r\n");
        kernels++;
        if (strncmp(body, "pdl_wait();", 11) != 0)
            snprintf(msg + strlen(msg), cap - strlen(msg), "%s:%d: a kernel that does not begin with pdl_wait()\n",
                     path, line_of(s, p));
    }
    for (const char *p = strstr(s, "<<<"); p; p = strstr(p + 3, "<<<"))
        snprintf(msg + strlen(msg), cap - strlen(msg), "%s:%d: a <<<...>>> launch (use cuda_launch)\n", path,
                 line_of(s, p));
    free(s);
    return kernels;
}

Test(launch_rule, every_kernel_begins_with_pdl_wait_and_every_launch_is_cuda_launch)
{
    glob_t g;
    cr_assert_eq(glob("cuda/*.cu", 0, NULL, &g), 0, "no cuda/*.cu here (run from the repository root)");
    cr_assert_eq(glob("cuda/*.cuh", GLOB_APPEND, NULL, &g), 0);
    static char msg[16384];
    msg[0] = '\0';
    int kernels = 0;
    for (size_t i = 0; i < g.gl_pathc; i++) kernels += check_file(g.gl_pathv[i], msg, sizeof msg);
    globfree(&g);
    cr_expect(kernels >= 60, "only %d kernel bodies found in cuda/: the scan is broken", kernels);
    cr_expect(msg[0] == '\0', "%s", msg);
}

/* the scan itself: it finds a kernel that starts otherwise and a <<<...>>> launch, and takes
 * neither a declaration nor a comment for one */
Test(launch_rule, the_scan_finds_what_breaks_the_rule)
{
    char path[] = "/tmp/mt_launch_rule_XXXXXX";
    const int fd = mkstemp(path);
    cr_assert(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs("__global__ void declared(int *x);\n"
          "/* __global__ void in_a_comment(int *x) { } and k<<<1, 1>>>(x) */\n"
          "__global__ void good(int *x)\n{\n    pdl_wait(); /* first */\n    x[0] = 1;\n}\n"
          "template <int N> __global__ void __launch_bounds__(128, 1) bad(int *x)\n{\n    x[0] = N;\n}\n"
          "void host(int *x) { bad<1><<<1, 32, 0, s>>>(x); }\n",
          f);
    fclose(f);
    static char msg[4096];
    msg[0] = '\0';
    cr_expect_eq(check_file(path, msg, sizeof msg), 2, "%s", msg);
    char want[256];
    snprintf(want, sizeof want, "%s:8: a kernel that does not begin with pdl_wait()", path);
    cr_expect(strstr(msg, want), "%s", msg);
    snprintf(want, sizeof want, "%s:12: a <<<...>>> launch (use cuda_launch)", path);
    cr_expect(strstr(msg, want), "%s", msg);
    cr_expect(!strstr(msg, ":1:") && !strstr(msg, ":2:") && !strstr(msg, ":3:"), "%s", msg);
    unlink(path);
}
