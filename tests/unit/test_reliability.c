/* The reliability suite (docs/reliability.md): whole `moetrain train` runs on the CPU backend fed
 * bad configs, corrupt files, non-finite training, kill -9 during saves, a rewind, foreign
 * directories and a full disk. Each case must end in a correct result or one clear error line with
 * exit code 1 -- never a crash, a hang, lost checkpoints or invalid metrics. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <hdf5.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "safetensors.h"
#include "../test_util.h"

/* a run of a few milliseconds per step */
#define SMALL "--backend cpu --set train.global_batch_size=4 --set train.micro_batch_size=2 " \
              "--set train.seq_len=16 --set log.interval=1 "

static char dir[128];

static void mk_dir(void)
{
    snprintf(dir, sizeof dir, "/tmp/mt_rel_XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
}

static void rm_dir(void)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    tu_run(cmd, NULL);
}

TestSuite(reliability, .init = mk_dir, .fini = rm_dir, .timeout = 300);

static int count_substr(const char *s, const char *what)
{
    int n = 0;
    for (const char *p = s; (p = strstr(p, what)) != NULL; p++) n++;
    return n;
}

/* `moetrain train ARGS` (in dir, from the repository root's config paths) */
static int train(const char *args, char **out)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "cd '%s' && timeout 200 %s/%s/moetrain train %s/configs/tiny.yaml " SMALL "%s",
             dir, getenv("PWD"), tu_build(), getenv("PWD"), args);
    return tu_run(cmd, out);
}

/* exit code 1 and exactly one error line that says `what` */
static void expect_one_error(int rc, const char *out, const char *what, const char *args)
{
    cr_assert_not_null(out, "%s: no output captured", args);
    cr_assert_eq(rc, 1, "%s: exit %d, expected 1:\n%s", args, rc, out);
    cr_assert_eq(count_substr(out, "moetrain: error: "), 1, "%s: not exactly one error line:\n%s", args, out);
    const char *e = strstr(out, "moetrain: error: ");
    const char *nl = strchr(e, '\n');
    char line[4096];
    snprintf(line, sizeof line, "%.*s", nl ? (int)(nl - e) : (int)strlen(e), e);
    cr_assert(strstr(line, what), "%s: the error line does not say '%s': %s", args, what, line);
}

static void path_in(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", dir, name);
}

static void write_file(const char *name, const void *data, size_t len)
{
    char p[512];
    path_in(p, sizeof p, name);
    FILE *f = fopen(p, "wb");
    cr_assert_not_null(f, "%s", p);
    cr_assert_eq(fwrite(data, 1, len, f), len);
    cr_assert_eq(fclose(f), 0);
}

/* Every line of the metrics file parses as JSON; returns the lines' objects count and the last
 * object's skipped_steps (or -1). */
static int check_jsonl(const char *name, int *last_skipped, int *n_null_loss)
{
    char p[512];
    path_in(p, sizeof p, name);
    FILE *f = fopen(p, "r");
    cr_assert_not_null(f, "%s", p);
    static char line[1 << 20];
    int n = 0;
    *last_skipped = -1;
    *n_null_loss = 0;
    while (fgets(line, sizeof line, f)) {
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        cr_assert_not_null(o, "%s line %d is not JSON (%s): %s", name, n + 1, je.text, line);
        json_t *sk = json_object_get(o, "skipped_steps");
        cr_assert(json_is_integer(sk), "line %d has no skipped_steps", n + 1);
        *last_skipped = (int)json_integer_value(sk);
        if (json_is_null(json_object_get(o, "loss"))) ++*n_null_loss;
        json_decref(o);
        n++;
    }
    fclose(f);
    return n;
}

/* Exports checkpoint `ckpt` (relative to dir) and checks that every weight in it is finite. */
static void expect_finite_checkpoint(const char *ckpt)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "cd '%s' && %s/%s/moetrain export %s hf_%s", dir, getenv("PWD"), tu_build(),
             ckpt, strrchr(ckpt, '/') ? strrchr(ckpt, '/') + 1 : ckpt);
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    free(out);
    char p[512], err[1024];
    snprintf(p, sizeof p, "%s/hf_%s/model.safetensors", dir, strrchr(ckpt, '/') ? strrchr(ckpt, '/') + 1 : ckpt);
    struct st_file *st = st_open(p, err, sizeof err);
    cr_assert_not_null(st, "%s", err);
    for (int i = 0; i < st->n; i++) {
        float *v = malloc((size_t)st->t[i].numel * sizeof(float));
        cr_assert(st_read_f32(st, &st->t[i], v, st->t[i].numel, err, sizeof err), "%s", err);
        for (int64_t j = 0; j < st->t[i].numel; j++)
            cr_assert(isfinite(v[j]), "%s: %s[%lld] = %g", ckpt, st->t[i].name, (long long)j, v[j]);
        free(v);
    }
    st_close(st);
}

/* --- non-finite training ------------------------------------------------------------------- */

/* train.lr 1e6 diverges within a few steps: the bad steps are skipped and counted, the run stops
 * after max_skipped_steps in a row with exit 1, no checkpoint holds a NaN and the JSONL stays JSON */
Test(reliability, nan_injection_skips_then_stops)
{
    char *out = NULL;
    const char *args = "--set train.steps=30 --set train.lr=1e6 --set train.min_lr=0 --set train.warmup_steps=0 "
                       "--set checkpoint.dir=ck --set checkpoint.interval=1 --set checkpoint.keep=2 "
                       "--set log.metrics=m.jsonl";
    int rc = train(args, &out);
    expect_one_error(rc, out, "5 steps in a row skipped", args);
    cr_assert(strstr(out, "SKIPPED (5 skipped)"), "%s", out);
    free(out);
    int skipped, null_loss;
    int n = check_jsonl("m.jsonl", &skipped, &null_loss);
    cr_assert(n >= 5 && n < 30, "%d lines", n);
    cr_assert_eq(skipped, 5);
    cr_assert(null_loss >= 1, "a non-finite loss is written as null");
    /* the checkpoints kept are finite: resume auto finds one */
    char latest[64];
    rc = tu_run("true", NULL);
    (void)rc;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "ls -d %s/ck/step_* | tail -1", dir);
    char *ls = NULL;
    tu_run(cmd, &ls);
    cr_assert(strstr(ls, "/ck/step_"), "no checkpoint left: %s", ls);
    snprintf(latest, sizeof latest, "ck/%.13s", strstr(ls, "/ck/step_") + 4);
    free(ls);
    expect_finite_checkpoint(latest);
}

Test(reliability, nonfinite_stop_stops_at_the_first_bad_step)
{
    char *out = NULL;
    const char *args = "--set train.steps=30 --set train.lr=1e6 --set train.min_lr=0 --set train.warmup_steps=0 "
                       "--set train.nonfinite=stop --set log.metrics=m.jsonl";
    int rc = train(args, &out);
    expect_one_error(rc, out, "train.nonfinite: stop", args);
    free(out);
    int skipped, null_loss;
    check_jsonl("m.jsonl", &skipped, &null_loss);
    cr_assert_eq(skipped, 0);
}

/* --- bad configs --------------------------------------------------------------------------- */

Test(reliability, bad_configs_are_one_line_errors)
{
    write_file("empty.yaml", "", 0);
    write_file("comments.yaml", "# train:\n", 9);
    struct { const char *args, *what; } cases[] = {
        {"--set train.seq_len=1", "must be >= 2"},
        {"--set train.seq_len=2000000000 --set train.global_batch_size=2 --set train.micro_batch_size=2",
         "32-bit indexing"},
        {"--set train.steps=0", "train.steps"},
        {"--set train.lr=nan", "train.lr"},
        {"--set train.nonfinite=maybe", "train.nonfinite"},
        {"--set train.spike_factor=1", "spike_factor"},
        {"--set train.typo=1", "unknown key"},
        {"--set data.kind=tokens --set data.path=absent.tokens", "absent.tokens"},
        {"--set model.init_from=absent_dir", "absent_dir"},
        {"--resume no_such_checkpoint", "no_such_checkpoint"},
        {"--resume auto", "checkpoint.dir"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL;
        int rc = train(cases[i].args, &out);
        expect_one_error(rc, out, cases[i].what, cases[i].args);
        free(out);
    }
    const char *files[] = {"empty.yaml", "comments.yaml", "missing.yaml"};
    for (size_t i = 0; i < 3; i++) {
        char cmd[1024], *out = NULL;
        snprintf(cmd, sizeof cmd, "cd '%s' && %s/%s/moetrain train %s", dir, getenv("PWD"), tu_build(), files[i]);
        int rc = tu_run(cmd, &out);
        expect_one_error(rc, out, files[i], cmd);
        free(out);
    }
}

/* --- corrupt files ------------------------------------------------------------------------- */

static void put_u32(unsigned char *b, uint32_t v) { for (int i = 0; i < 4; i++) b[i] = (unsigned char)(v >> (8 * i)); }
static void put_u64(unsigned char *b, uint64_t v) { for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i)); }

/* A token file: header fields as given, `n` u16 tokens (id i % 500) after it. */
static size_t token_file(unsigned char *buf, const char *magic, uint32_t version, uint32_t width,
                         uint64_t declared, size_t n, uint16_t bad_id_at_3)
{
    memcpy(buf, magic, 8);
    put_u32(buf + 8, version);
    put_u32(buf + 12, width);
    put_u64(buf + 16, declared);
    for (size_t i = 0; i < n; i++) {
        uint16_t t = (uint16_t)(i % 500);
        if (i == 3 && bad_id_at_3) t = bad_id_at_3;
        buf[24 + 2 * i] = (unsigned char)t;
        buf[25 + 2 * i] = (unsigned char)(t >> 8);
    }
    return 24 + 2 * n;
}

Test(reliability, corrupt_token_files_are_one_line_errors)
{
    static unsigned char buf[24 + 2 * 4096];
    struct { const char *name; size_t len; const char *what; } cases[6];
    int n = 0;
    size_t len;
    len = token_file(buf, "MTTOKENS", 1, 2, 4096, 4096, 0);
    write_file("good.tokens", buf, len);
    write_file("truncated.tokens", buf, len - 7);
    cases[n++] = (typeof(cases[0])){"truncated.tokens", 0, "truncated.tokens"};
    len = token_file(buf, "MTTOKENX", 1, 2, 4096, 4096, 0);
    write_file("magic.tokens", buf, len);
    cases[n++] = (typeof(cases[0])){"magic.tokens", 0, "magic.tokens"};
    len = token_file(buf, "MTTOKENS", 7, 2, 4096, 4096, 0);
    write_file("version.tokens", buf, len);
    cases[n++] = (typeof(cases[0])){"version.tokens", 0, "version.tokens"};
    len = token_file(buf, "MTTOKENS", 1, 2, UINT64_MAX / 2, 4096, 0);
    write_file("huge.tokens", buf, len);
    cases[n++] = (typeof(cases[0])){"huge.tokens", 0, "huge.tokens"};
    len = token_file(buf, "MTTOKENS", 1, 2, 4096, 4096, 60000);
    write_file("badid.tokens", buf, len);
    cases[n++] = (typeof(cases[0])){"badid.tokens", 0, "badid.tokens"};
    len = token_file(buf, "MTTOKENS", 1, 2, 8, 8, 0);
    write_file("short.tokens", buf, len);
    cases[n++] = (typeof(cases[0])){"short.tokens", 0, "short.tokens"};
    for (int i = 0; i < n; i++) {
        char args[256], *out = NULL;
        snprintf(args, sizeof args, "--set train.steps=2 --set data.kind=tokens --set data.path=%s", cases[i].name);
        int rc = train(args, &out);
        expect_one_error(rc, out, cases[i].what, args);
        free(out);
    }
    char *out = NULL;
    cr_assert_eq(train("--set train.steps=2 --set data.kind=tokens --set data.path=good.tokens", &out), 0, "%s", out);
    free(out);
}

Test(reliability, corrupt_safetensors_init_from_is_one_line_error)
{
    /* a copy of the fixture model with the header length, a header byte and the data cut */
    const char *fx = "tests/fixtures/qwen3moe-tiny";
    char cmd[1024], *out = NULL;
    const char *kinds[] = {"truncate", "hlen", "flip"};
    for (int k = 0; k < 3; k++) {
        snprintf(cmd, sizeof cmd, "rm -rf %s/m && mkdir %s/m && cp %s/%s/config.json %s/%s/model.safetensors %s/m/",
                 dir, dir, getenv("PWD"), fx, getenv("PWD"), fx, dir);
        cr_assert_eq(tu_run(cmd, NULL), 0);
        char p[512];
        snprintf(p, sizeof p, "%s/m/model.safetensors", dir);
        int fd = open(p, O_RDWR);
        cr_assert(fd >= 0);
        struct stat st;
        fstat(fd, &st);
        if (k == 0) cr_assert_eq(ftruncate(fd, st.st_size / 2), 0);
        if (k == 1) cr_assert_eq(pwrite(fd, "\xff\xff\xff\xff\xff\xff\xff\x7f", 8, 0), 8);
        if (k == 2) cr_assert_eq(pwrite(fd, "\x01", 1, 9), 1);  /* the header's first key quote */
        close(fd);
        snprintf(cmd, sizeof cmd, "--set train.steps=1 --set model.hf_config=m/config.json --set model.init_from=m");
        int rc = train(cmd, &out);
        expect_one_error(rc, out, "model.safetensors", kinds[k]);
        free(out);
    }
}

/* --- checkpoints --------------------------------------------------------------------------- */

static void flip_byte(const char *rel, long at_from_end_or_mid)
{
    char p[512];
    path_in(p, sizeof p, rel);
    int fd = open(p, O_RDWR);
    cr_assert(fd >= 0, "%s", p);
    struct stat st;
    fstat(fd, &st);
    off_t at = at_from_end_or_mid < 0 ? st.st_size / 2 : at_from_end_or_mid;
    unsigned char b;
    cr_assert_eq(pread(fd, &b, 1, at), 1);
    b ^= 0x10;
    cr_assert_eq(pwrite(fd, &b, 1, at), 1);
    close(fd);
}

Test(reliability, corrupt_checkpoints_are_one_line_errors)
{
    char *out = NULL;
    cr_assert_eq(train("--set train.steps=2 --set checkpoint.dir=ck --set train.load_balance=bias", &out), 0, "%s", out);
    free(out);
    tu_run("true", NULL);
    char cmd[1024];
    /* a byte flipped in the middle of the weights: Fletcher-32 */
    snprintf(cmd, sizeof cmd, "cp -r %s/ck %s/ck_flip", dir, dir);
    tu_run(cmd, NULL);
    flip_byte("ck_flip/step_00000002/rank_00000.h5", -1);
    int rc = train("--set train.steps=3 --set train.load_balance=bias --resume ck_flip/step_00000002", &out);
    expect_one_error(rc, out, "rank_00000.h5", "flipped rank file");
    free(out);
    /* truncated rank file */
    snprintf(cmd, sizeof cmd, "cp -r %s/ck %s/ck_cut && truncate -s 100000 %s/ck_cut/step_00000002/rank_00000.h5", dir, dir, dir);
    tu_run(cmd, NULL);
    rc = train("--set train.steps=3 --set train.load_balance=bias --resume ck_cut/step_00000002", &out);
    expect_one_error(rc, out, "rank_00000.h5", "truncated rank file");
    free(out);
    /* the balancing bias is checksummed too: flip a byte of its chunk */
    snprintf(cmd, sizeof cmd, "cp -r %s/ck %s/ck_bias", dir, dir);
    tu_run(cmd, NULL);
    char man[512];
    path_in(man, sizeof man, "ck_bias/step_00000002/manifest.h5");
    hid_t f = H5Fopen(man, H5F_ACC_RDONLY, H5P_DEFAULT);
    cr_assert(f >= 0);
    hid_t d = H5Dopen2(f, "balance_bias", H5P_DEFAULT);
    cr_assert(d >= 0, "the manifest has no balance_bias");
    hsize_t off[2] = {0, 0};
    haddr_t addr = 0;
    hsize_t size = 0;
    unsigned mask = 0;
    cr_assert(H5Dget_chunk_info_by_coord(d, off, &mask, &addr, &size) >= 0, "balance_bias is not chunked");
    H5Dclose(d);
    H5Fclose(f);
    flip_byte("ck_bias/step_00000002/manifest.h5", (long)addr + 2);
    rc = train("--set train.steps=3 --set train.load_balance=bias --resume ck_bias/step_00000002", &out);
    expect_one_error(rc, out, "balance_bias", "flipped bias");
    free(out);
    /* another model shape */
    rc = train("--set train.steps=3 --set train.load_balance=bias --set model.hidden_size=32 --resume ck/step_00000002", &out);
    expect_one_error(rc, out, "hidden_size", "wrong shape");
    free(out);
    /* no COMPLETE marker */
    snprintf(cmd, sizeof cmd, "rm %s/ck_cut/step_00000002/COMPLETE", dir);
    tu_run(cmd, NULL);
    rc = train("--set train.steps=3 --set train.load_balance=bias --resume ck_cut/step_00000002", &out);
    expect_one_error(rc, out, "incomplete", "no COMPLETE");
    free(out);
    /* the good one still resumes */
    rc = train("--set train.steps=3 --set train.load_balance=bias --resume ck/step_00000002", &out);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
}

/* kill -9 at random moments of runs that save every step: each restart with --resume auto finds
 * a complete checkpoint (or none yet) and the last one resumes cleanly. Each kill waits for the
 * run's first save (a slow machine may take seconds to start) and then up to 0.9 s more. */
Test(reliability, kill_9_during_saves_loses_nothing, .timeout = 400)
{
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "cd '%s' && for i in 1 2 3 4 5 6; do "
             "(exec %s/%s/moetrain train %s/configs/tiny.yaml " SMALL " --set train.steps=100000 "
             "--set checkpoint.dir=ck --set checkpoint.interval=1 --set checkpoint.keep=2 "
             "--set model.hidden_size=128 --set model.vocab_size=4096 --resume auto > run_$i.log 2>&1) & pid=$!; "
             "for t in $(seq 600); do grep -q 'saved to' run_$i.log && break; kill -0 $pid 2>/dev/null || break; sleep 0.1; done; "
             "sleep 0.$(( RANDOM %% 10 )); kill -9 $pid; wait $pid; done; "
             "grep -l 'moetrain: error' run_*.log; ls ck",
             dir, getenv("PWD"), tu_build(), getenv("PWD"));
    tu_run(cmd, &out);
    cr_assert_null(strstr(out, "run_"), "a restarted run failed: %s", out);
    free(out);
    /* resume once more, to a step just past the newest checkpoint */
    snprintf(cmd, sizeof cmd, "cd '%s' && ls -d ck/step_???????? | sort | tail -1", dir);
    char *ls = NULL;
    tu_run(cmd, &ls);
    int newest = -1;
    const char *s = strstr(ls, "step_");
    if (s) newest = atoi(s + 5);
    free(ls);
    char args[512];
    snprintf(args, sizeof args, "--set checkpoint.dir=ck --set model.hidden_size=128 --set model.vocab_size=4096 "
             "--resume auto --set train.steps=%d --set checkpoint.interval=0", newest + 1);
    int rc = train(args, &out);
    cr_assert_eq(rc, 0, "%s", out);
    cr_assert(newest > 0, "no run lived long enough to save: the kills proved nothing");
    cr_assert(strstr(out, "resumed from ck/step_"), "%s", out);
    free(out);
}

/* After a rewind (resuming an older checkpoint and training on) --resume auto continues the
 * current run, not the stale higher step of the run before the rewind. */
Test(reliability, resume_auto_after_a_rewind_takes_the_current_run)
{
    char *out = NULL;
    const char *ck = "--set checkpoint.dir=ck --set checkpoint.interval=2 --set checkpoint.keep=0 ";
    char args[512];
    snprintf(args, sizeof args, "%s --set train.steps=6", ck);
    cr_assert_eq(train(args, &out), 0, "%s", out);
    free(out);
    snprintf(args, sizeof args, "%s --set train.steps=5 --resume ck/step_00000002", ck);
    cr_assert_eq(train(args, &out), 0, "%s", out);
    free(out);
    /* ck now holds 2 (old), 4 (rewound run), 5 (rewound run), 6 (stale) */
    snprintf(args, sizeof args, "%s --set train.steps=7 --resume auto", ck);
    cr_assert_eq(train(args, &out), 0, "%s", out);
    cr_assert(strstr(out, "resumed from ck/step_00000005 (step 5)"), "%s", out);
    cr_assert(strstr(out, "learning-rate schedule changed"), "%s", out);
    free(out);
    /* keep-N keeps the newest saves, not the highest steps: the stale step 6 goes first */
    snprintf(args, sizeof args, "--set checkpoint.dir=ck --set checkpoint.interval=0 --set checkpoint.keep=2 "
             "--set train.steps=8 --resume auto");
    cr_assert_eq(train(args, &out), 0, "%s", out);
    free(out);
    char cmd[512], *ls = NULL;
    snprintf(cmd, sizeof cmd, "ls %s/ck", dir);
    tu_run(cmd, &ls);
    cr_assert(strstr(ls, "step_00000008") && strstr(ls, "step_00000007"), "%s", ls);
    cr_assert(!strstr(ls, "step_00000006") && !strstr(ls, "step_00000005"), "%s", ls);
    free(ls);
}

Test(reliability, resuming_past_steps_says_so_in_one_line)
{
    char *out = NULL;
    cr_assert_eq(train("--set train.steps=3 --set checkpoint.dir=ck", &out), 0, "%s", out);
    free(out);
    cr_assert_eq(train("--set train.steps=2 --set checkpoint.dir=ck --resume auto", &out), 0, "%s", out);
    cr_assert(strstr(out, "nothing left to train"), "%s", out);
    cr_assert(strstr(out, "done: no step trained"), "%s", out);
    cr_assert_null(strstr(out, "done: -"), "%s", out);
    free(out);
}

/* --- directories moetrain did not write ------------------------------------------------------ */

Test(reliability, foreign_directories_are_left_alone)
{
    char cmd[1024], *out = NULL;
    /* a checkpoint.dir with someone's files: refused, then accepted with --force */
    snprintf(cmd, sizeof cmd, "mkdir -p %s/ck/step_00000099 %s/ck/step_00000007.tmp && echo mine > %s/ck/notes.txt && "
             "echo mine > %s/ck/step_00000099/data && echo mine > %s/ck/step_00000007.tmp/data", dir, dir, dir, dir, dir);
    cr_assert_eq(tu_run(cmd, NULL), 0);
    const char *args = "--set train.steps=3 --set checkpoint.dir=ck --set checkpoint.interval=1 --set checkpoint.keep=1";
    int rc = train(args, &out);
    expect_one_error(rc, out, "--force", args);
    free(out);
    char forced[512];
    snprintf(forced, sizeof forced, "%s --force", args);
    cr_assert_eq(train(forced, &out), 0, "%s", out);
    free(out);
    /* keep 1 removed moetrain's older checkpoints but none of the foreign entries */
    snprintf(cmd, sizeof cmd, "ls -a %s/ck", dir);
    char *ls = NULL;
    tu_run(cmd, &ls);
    cr_assert(strstr(ls, "step_00000099") && strstr(ls, "step_00000007.tmp") && strstr(ls, "notes.txt") &&
              strstr(ls, "step_00000003"), "%s", ls);
    cr_assert(!strstr(ls, "step_00000002") && !strstr(ls, "step_00000001\n"), "%s", ls);
    free(ls);
    /* the marker lets the next run in without --force, and resume auto ignores the foreign step 99 */
    cr_assert_eq(train("--set train.steps=4 --set checkpoint.dir=ck --resume auto", &out), 0, "%s", out);
    cr_assert(strstr(out, "resumed from ck/step_00000003"), "%s", out);
    free(out);
}

Test(reliability, output_directories_are_created)
{
    char *out = NULL;
    cr_assert_eq(train("--set train.steps=1 --set log.metrics=a/b/m.jsonl --set checkpoint.dir=c/d "
                       "--set checkpoint.export_hf=e/f/hf", &out), 0, "%s", out);
    free(out);
    char p[512];
    struct stat st;
    path_in(p, sizeof p, "a/b/m.jsonl");
    cr_assert_eq(stat(p, &st), 0, "%s", p);
    path_in(p, sizeof p, "c/d/step_00000001/COMPLETE");
    cr_assert_eq(stat(p, &st), 0, "%s", p);
    path_in(p, sizeof p, "e/f/hf/model.safetensors");
    cr_assert_eq(stat(p, &st), 0, "%s", p);
}

/* A save that runs out of space (RLIMIT_FSIZE stands in for a full disk) stops with one error
 * and exit 1; the checkpoint before it is kept and still resumes. */
Test(reliability, a_full_disk_keeps_the_last_good_checkpoint)
{
    const char *big = "--set model.hidden_size=256 --set model.vocab_size=8192 --set checkpoint.dir=ck "
                      "--set checkpoint.interval=2 --set checkpoint.keep=1 ";
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, "%s --set train.steps=2", big);
    cr_assert_eq(train(args, &out), 0, "%s", out);
    free(out);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "cd '%s' && bash -c \"trap '' XFSZ; ulimit -f 16384; exec %s/%s/moetrain train "
             "%s/configs/tiny.yaml " SMALL " %s --set train.steps=4 --resume auto\"",
             dir, getenv("PWD"), tu_build(), getenv("PWD"), big);
    int rc = tu_run(cmd, &out);
    cr_assert_eq(rc, 1, "%s", out);
    cr_assert(strstr(out, "out of disk space or quota"), "%s", out);
    cr_assert_eq(count_substr(out, "moetrain: rank 0:"), 1, "%s", out);
    free(out);
    snprintf(args, sizeof args, "%s --set train.steps=3 --resume auto", big);
    cr_assert_eq(train(args, &out), 0, "%s", out);
    cr_assert(strstr(out, "resumed from ck/step_00000002"), "%s", out);
    free(out);
}

/* init_from on ep 2: every expert is read by some rank, so no "not used" warning */
Test(reliability, init_from_with_ep2_reports_no_unused_tensors)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "cd '%s' && timeout 200 %s -np 2 %s/%s/moetrain train %s/configs/tiny.yaml " SMALL
             "--set train.steps=1 --set parallel.expert_parallel_size=2 "
             "--set model.hf_config=%s/tests/fixtures/qwen3moe-tiny/config.json "
             "--set model.init_from=%s/tests/fixtures/qwen3moe-tiny",
             dir, tu_mpirun(), getenv("PWD"), tu_build(), getenv("PWD"), getenv("PWD"), getenv("PWD"));
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_assert_null(strstr(out, "not used"), "%s", out);
    cr_assert(strstr(out, "computes in fp32") || strstr(out, "fp32 (CPU backend"), "%s", out);
    free(out);
}

/* the MPI collectives split above INT_MAX elements: the split path on small buffers */
Test(reliability, mpi_collectives_split_large_counts)
{
    char cmd[1024], *out = NULL;
    for (int np = 2; np <= 3; np++) {
        snprintf(cmd, sizeof cmd, "MT_MPI_MAX_COUNT=7 timeout 100 %s -np %d -x MT_MPI_MAX_COUNT %s/tests/mpi/comm_split_check 20",
                 tu_mpirun(), np, tu_build());
        cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
        cr_assert(strstr(out, "0 problems"), "%s", out);
        free(out);
    }
}

/* the shipped 30B config on the world it is laid out for: --dry-run passes on a fresh checkout */
Test(reliability, shipped_30b_config_passes_dry_run)
{
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "timeout 120 %s -np 8 %s/moetrain train configs/qwen3-30b-a3b.yaml --dry-run",
             tu_mpirun(), tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_assert(strstr(out, "moetrain layout"), "%s", out);
    if (access("data/train.tokens", F_OK) != 0)
        cr_assert(strstr(out, "note: data.path data/train.tokens does not exist yet"), "%s", out);
    free(out);
}

/* two ranks with experts split between them: they agree on every verdict and stop together */
Test(reliability, nan_injection_on_two_ranks_stops_every_rank)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "cd '%s' && timeout 200 %s -np 2 %s/%s/moetrain train %s/configs/tiny.yaml " SMALL
             "--set train.steps=30 --set train.lr=1e6 --set train.min_lr=0 --set train.warmup_steps=0 "
             "--set parallel.expert_parallel_size=2 --set log.metrics=m.jsonl",
             dir, tu_mpirun(), getenv("PWD"), tu_build(), getenv("PWD"));
    int rc = tu_run(cmd, &out);
    expect_one_error(rc, out, "5 steps in a row skipped", cmd);
    free(out);
    int skipped, null_loss;
    check_jsonl("m.jsonl", &skipped, &null_loss);
    cr_assert_eq(skipped, 5);
}

/* Sets integer attribute `name` of the manifest of checkpoint `rel` to v. */
static void set_manifest_attr(const char *rel, const char *name, int64_t v)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s/manifest.h5", dir, rel);
    hid_t f = H5Fopen(p, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert(f >= 0, "%s", p);
    hid_t a = H5Aopen(f, name, H5P_DEFAULT);
    cr_assert(a >= 0, "%s: no attribute %s", p, name);
    cr_assert(H5Awrite(a, H5T_NATIVE_INT64, &v) >= 0);
    H5Aclose(a);
    H5Fclose(f);
}

/* absurd sizes declared in a manifest: refused in one line, not allocated or looped over */
Test(reliability, huge_sizes_in_a_checkpoint_manifest_are_refused)
{
    char *out = NULL, cmd[512];
    cr_assert_eq(train("--set train.steps=2 --set checkpoint.dir=ck", &out), 0, "%s", out);
    free(out);
    struct { const char *attr; int64_t v; } cases[] = {
        {"world", INT64_C(1) << 40}, {"world", -3}, {"step", -5}, {"step", INT64_C(1) << 40},
        {"stage_size", INT64_C(1) << 33}, {"ep", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(cmd, sizeof cmd, "rm -rf %s/bad && cp -r %s/ck %s/bad", dir, dir, dir);
        cr_assert_eq(tu_run(cmd, NULL), 0);
        set_manifest_attr("bad/step_00000002", cases[i].attr, cases[i].v);
        int rc = train("--set train.steps=3 --resume bad/step_00000002", &out);
        expect_one_error(rc, out, "manifest.h5", cases[i].attr);
        free(out);
    }
}
