/* The systemd units as configured by the build (the files `cmake --install`
 * installs): systemd-analyze verify accepts them, they say Type=notify and
 * keep what a GPU/RDMA daemon needs; the sysusers entry creates the user; the
 * install puts programs, library, headers, units and example configurations
 * in place, and a program builds against the installed library. */
#include <criterion/criterion.h>

#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "deploy_util.h"

#define SUITE_TIMEOUT 120

static const char *const units[] = {"stria-coordinator.service", "stria-worker@.service",
                                    "stria.target"};

static char *unit_text(const char *name)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", STRIA_UNIT_DIR, name);
    char *text = dc_read(path);
    cr_assert(text[0] != '\0', "%s is missing or empty (configured by deploy/CMakeLists.txt)",
              path);
    return text;
}

/* Value of the last `key=` line (systemd: a later assignment wins), or NULL;
 * malloc'ed. */
static char *unit_get(const char *text, const char *key)
{
    char *found = NULL;
    size_t kl = strlen(key);
    for (const char *p = text; *p;) {
        size_t ll = strcspn(p, "\n");
        if (ll > kl && memcmp(p, key, kl) == 0 && p[kl] == '=') {
            free(found);
            found = strndup(p + kl + 1, ll - kl - 1);
        }
        p += ll;
        if (*p == '\n')
            p++;
    }
    return found;
}

static void expect_value(const char *unit, const char *text, const char *key, const char *want)
{
    char *v = unit_get(text, key);
    cr_expect(v != NULL && strcmp(v, want) == 0, "%s: %s=%s, expected %s", unit, key,
              v ? v : "(unset)", want);
    free(v);
}

static void expect_not_yes(const char *unit, const char *text, const char *key)
{
    char *v = unit_get(text, key);
    cr_expect(v == NULL || strcmp(v, "no") == 0 || strcmp(v, "false") == 0,
              "%s sets %s=%s, which takes GPU/RDMA access away", unit, key, v);
    free(v);
}

/* Replaces every `from` with `to`; malloc'ed. */
static char *replace_all(const char *text, const char *from, const char *to)
{
    size_t fl = strlen(from), tl = strlen(to), n = 0;
    for (const char *p = strstr(text, from); p; p = strstr(p + fl, from))
        n++;
    char *out = malloc(strlen(text) + n * (tl > fl ? tl - fl : 0) + 1), *o = out;
    cr_assert_not_null(out);
    for (const char *p = text;;) {
        const char *hit = strstr(p, from);
        if (hit == NULL) {
            strcpy(o, p);
            break;
        }
        memcpy(o, p, (size_t)(hit - p));
        o += hit - p;
        memcpy(o, to, tl);
        o += tl;
        p = hit + fl;
    }
    return out;
}

/* Copies of the configured units into dir, with ExecStart pointing at the
 * programs of this build (systemd-analyze checks that they exist). */
static void write_units_for_build(const char *dir, const char *broken_key)
{
    char bindir[512];
    snprintf(bindir, sizeof(bindir), "%s", STRIA_WORKER_BIN);
    char *bd = dirname(bindir);
    char from[600], to[600];
    snprintf(from, sizeof(from), "%s/stria-", STRIA_INSTALL_BINDIR);
    snprintf(to, sizeof(to), "%s/stria-", bd);
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
        char *text = unit_text(units[i]), path[512];
        char *fixed = replace_all(text, from, to);
        if (broken_key != NULL && strstr(units[i], "worker")) {
            char *b = replace_all(fixed, "[Service]\n", broken_key);
            free(fixed);
            fixed = b;
        }
        snprintf(path, sizeof(path), "%s/%s", dir, units[i]);
        dc_write(path, fixed);
        free(fixed);
        free(text);
    }
}

static int analyze_verify(const char *dir, char **output)
{
    char a[512], b[512], t[512];
    snprintf(a, sizeof(a), "%s/stria-coordinator.service", dir);
    snprintf(b, sizeof(b), "%s/stria-worker@0.service", dir); /* an instance of the template */
    snprintf(t, sizeof(t), "%s/stria.target", dir);
    char *argv[] = {STRIA_SYSTEMD_ANALYZE, "verify", "--man=no", a, b, t, NULL};
    char *out = NULL, *err = NULL;
    int rc = dc_run(argv, NULL, 60, &out, &err);
    size_t n = strlen(out) + strlen(err) + 2;
    *output = malloc(n);
    snprintf(*output, n, "%s%s", out, err);
    free(out);
    free(err);
    return rc;
}

/* Lines of systemd-analyze's output about our units (it may also talk about
 * units of the host it pulls in, which are not ours to judge). */
static bool mentions_stria(const char *output)
{
    return strstr(output, "stria") != NULL;
}

Test(units, systemd_analyze_verify_accepts_the_units, .timeout = SUITE_TIMEOUT)
{
    if (STRIA_SYSTEMD_ANALYZE[0] == '\0')
        cr_skip_test("systemd-analyze is not installed: the unit files were not verified");
    dcluster_t c;
    dc_init(&c);
    write_units_for_build(c.dir, NULL);
    char *output = NULL;
    int rc = analyze_verify(c.dir, &output);
    cr_expect_eq(rc, 0, "systemd-analyze verify failed:\n%s", output);
    cr_expect(!mentions_stria(output), "systemd-analyze verify complains:\n%s", output);
    free(output);

    /* the check can fail: a misspelt setting is reported */
    write_units_for_build(c.dir, "[Service]\nPrivateDevicez=yes\nType=notifyy\n");
    rc = analyze_verify(c.dir, &output);
    cr_expect(strstr(output, "PrivateDevicez") != NULL || strstr(output, "notifyy") != NULL,
              "systemd-analyze did not notice a broken unit (rc %d):\n%s", rc, output);
    free(output);
    dc_stop(&c);
}

Test(units, notify_watchdog_and_gpu_rdma_access, .timeout = SUITE_TIMEOUT)
{
    char *co = unit_text("stria-coordinator.service");
    char *wk = unit_text("stria-worker@.service");
    char *tg = unit_text("stria.target");
    char want[600];

    for (int i = 0; i < 2; i++) {
        const char *u = units[i], *t = i == 0 ? co : wk;
        expect_value(u, t, "Type", "notify");
        expect_value(u, t, "NotifyAccess", "main");
        expect_value(u, t, "User", "stria");
        expect_value(u, t, "PartOf", "stria.target");
        expect_value(u, t, "WantedBy", "stria.target");
        char *wd = unit_get(t, "WatchdogSec");
        cr_expect(wd != NULL && atoi(wd) > 0, "%s: no WatchdogSec", u);
        free(wd);
    }
    snprintf(want, sizeof(want), "%s/stria-coordinator --config %s/coordinator.conf",
             STRIA_INSTALL_BINDIR, STRIA_CONFDIR);
    expect_value(units[0], co, "ExecStart", want);
    snprintf(want, sizeof(want), "%s/stria-worker --config %s/worker.conf --instance %%i",
             STRIA_INSTALL_BINDIR, STRIA_CONFDIR);
    expect_value(units[1], wk, "ExecStart", want);

    /* the worker keeps GPU and RDMA access */
    expect_value(units[1], wk, "LimitMEMLOCK", "infinity");
    expect_not_yes(units[1], wk, "PrivateDevices");
    expect_not_yes(units[1], wk, "MemoryDenyWriteExecute");
    expect_not_yes(units[1], wk, "DynamicUser");
    char *dp = unit_get(wk, "DevicePolicy");
    cr_expect(dp == NULL || strcmp(dp, "auto") == 0, "worker unit: DevicePolicy=%s", dp);
    free(dp);
    char *af = unit_get(wk, "RestrictAddressFamilies");
    cr_expect(af == NULL ||
                  (strstr(af, "AF_INET6") && strstr(af, "AF_NETLINK") && strstr(af, "AF_UNIX")),
              "worker unit: RestrictAddressFamilies=%s (RDMA needs netlink)", af);
    free(af);
    /* a running pass gets a step deadline (60 s by default), and an aborted
     * one a ring link set-up (30 s) and 25 s more, before a kill */
    char *stop = unit_get(wk, "TimeoutStopSec");
    cr_expect(stop != NULL && atoi(stop) > 60 + 30 + 25, "worker unit: TimeoutStopSec=%s", stop);
    free(stop);
    /* co-located clients reach the worker's socket in its runtime directory
     * (the worker reads $RUNTIME_DIRECTORY), which clients can traverse */
    expect_value(units[1], wk, "RuntimeDirectory", "stria/worker%i");
    expect_value(units[1], wk, "RuntimeDirectoryMode", "0755");
    /* a worker may wait for its coordinator as long as it takes */
    expect_value(units[1], wk, "TimeoutStartSec", "infinity");

    expect_value(units[2], tg, "WantedBy", "multi-user.target");
    free(co);
    free(wk);
    free(tg);
}

Test(units, sysusers_entry_creates_the_user, .timeout = SUITE_TIMEOUT)
{
    if (STRIA_SYSTEMD_SYSUSERS[0] == '\0')
        cr_skip_test("systemd-sysusers is not installed: the sysusers entry was not checked");
    dcluster_t c;
    dc_init(&c);
    char root[256], etc[300], root_opt[300];
    snprintf(root, sizeof(root), "%s/root", c.dir);
    snprintf(etc, sizeof(etc), "%s/etc", root);
    mkdir(root, 0755);
    mkdir(etc, 0755);
    snprintf(root_opt, sizeof(root_opt), "--root=%s", root);
    char *argv[] = {STRIA_SYSTEMD_SYSUSERS, "--dry-run", root_opt,
                    STRIA_SOURCE_DIR "/deploy/systemd/stria.sysusers.conf", NULL};
    char *out = NULL, *err = NULL;
    int rc = dc_run(argv, NULL, 30, &out, &err);
    cr_expect_eq(rc, 0, "systemd-sysusers: %s%s", out, err);
    cr_expect(strstr(err, "Creating user 'stria'") != NULL ||
                  strstr(out, "Creating user 'stria'") != NULL,
              "the sysusers entry does not create the user stria:\n%s%s", out, err);
    free(out);
    free(err);
    dc_stop(&c);
}

static void expect_file(const char *root, const char *dir, const char *name)
{
    char path[1024];
    struct stat st;
    snprintf(path, sizeof(path), "%s%s/%s", root, dir, name);
    cr_expect(stat(path, &st) == 0 && st.st_size > 0, "not installed: %s", path);
}

/* A staged install stays staged: every file of the install manifest (which
 * CMake writes without the DESTDIR) lies under the install prefix and exists
 * under `root` (the DESTDIR, or "" for a --prefix install), and every path
 * the installed units name (the program of ExecStart, the folder of its
 * --config file) exists there too or is the documented configuration
 * folder, which the operator writes. */
static void expect_staged(const char *root, const char *prefix, const char *unitdir)
{
    char path[1200];
    snprintf(path, sizeof(path), "%s/install_manifest.txt", STRIA_BUILD_DIR);
    char *manifest = dc_read(path);
    size_t pl = strlen(prefix), files = 0;
    for (char *line = strtok(manifest, "\n"); line != NULL; line = strtok(NULL, "\n"), files++) {
        struct stat st;
        snprintf(path, sizeof(path), "%s%s", root, line);
        cr_expect(strncmp(line, prefix, pl) == 0 && line[pl] == '/' && lstat(path, &st) == 0,
                  "the install recorded %s, which is not at %s under the prefix %s", line, path,
                  prefix);
    }
    cr_expect_gt(files, 10, "install manifest with %zu files", files);
    free(manifest);
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof(path), "%s%s/%s", root, unitdir, units[i]);
        char *text = dc_read(path);
        char *exec = unit_get(text, "ExecStart");
        cr_assert_not_null(exec, "%s: no ExecStart", path);
        char prog[600], conf[600];
        cr_assert_eq(sscanf(exec, "%599s --config %599s", prog, conf), 2, "%s: ExecStart=%s", path,
                     exec);
        char staged[1300];
        struct stat st;
        snprintf(staged, sizeof(staged), "%s%s", root, prog);
        cr_expect(stat(staged, &st) == 0 && (st.st_mode & S_IXUSR),
                  "%s: ExecStart names %s, which the install did not put at %s", units[i], prog,
                  staged);
        cr_expect_str_eq(dirname(conf), STRIA_CONFDIR, "%s: --config outside %s", units[i],
                         STRIA_CONFDIR);
        free(exec);
        free(text);
    }
}

/* `cmake --install --prefix DIR` stays in DIR, units included: they are
 * written at install time for the prefix installed to. Runs after the
 * DESTDIR install of the same test (the two share the build's install
 * manifest). */
static void expect_prefix_install_stays(dcluster_t *c)
{
    char prefix[300], unitdir[400];
    snprintf(prefix, sizeof(prefix), "%s/prefix", c->dir);
    char *argv[] = {STRIA_CMAKE, "--install", STRIA_BUILD_DIR, "--prefix", prefix, NULL};
    char *out = NULL, *err = NULL;
    int rc = dc_run(argv, NULL, 100, &out, &err);
    cr_assert_eq(rc, 0, "cmake --install --prefix failed:\n%s%s", out, err);
    free(out);
    free(err);
    snprintf(unitdir, sizeof(unitdir), "%s/lib/systemd/system", prefix);
    expect_file("", unitdir, "stria.target");
    char sysusers[400];
    snprintf(sysusers, sizeof(sysusers), "%s/lib/sysusers.d", prefix);
    expect_file("", sysusers, "stria.conf");
    expect_staged("", prefix, unitdir);
}

Test(units, cmake_install_and_a_program_built_against_libstria, .timeout = SUITE_TIMEOUT)
{
    dcluster_t c;
    dc_init(&c);
    char destdir[300], env_destdir[320];
    snprintf(destdir, sizeof(destdir), "%s/dest", c.dir);
    snprintf(env_destdir, sizeof(env_destdir), "DESTDIR=%s", destdir);
    char *argv[] = {STRIA_CMAKE, "--install", STRIA_BUILD_DIR, NULL};
    char *env[] = {env_destdir, NULL};
    char *out = NULL, *err = NULL;
    int rc = dc_run(argv, env, 100, &out, &err);
    cr_assert_eq(rc, 0, "cmake --install failed:\n%s%s", out, err);
    free(out);
    free(err);

    const char *programs[] = {"stria-coordinator", "stria-worker", "striactl", "stria-run",
                              "stria-bench"};
    for (size_t i = 0; i < sizeof(programs) / sizeof(programs[0]); i++)
        expect_file(destdir, STRIA_INSTALL_BINDIR, programs[i]);
    char prefix[512];
    snprintf(prefix, sizeof(prefix), "%s", STRIA_INSTALL_BINDIR);
    char *pf = dirname(prefix); /* the install prefix */
    char libdir[600], incdir[600], unitdir[600], sysusersdir[600], exdir[600], docdir[600];
    snprintf(libdir, sizeof(libdir), "%s/%s", pf, STRIA_INSTALL_LIBDIR);
    snprintf(incdir, sizeof(incdir), "%s/include/stria", pf);
    snprintf(unitdir, sizeof(unitdir), "%s/lib/systemd/system", pf);
    snprintf(sysusersdir, sizeof(sysusersdir), "%s/lib/sysusers.d", pf);
    snprintf(exdir, sizeof(exdir), "%s/share/stria/examples", pf);
    snprintf(docdir, sizeof(docdir), "%s/share/doc/stria", pf);
    expect_file(destdir, libdir, "libstria.so");
    expect_file(destdir, libdir, "libstria.so.1");
    expect_file(destdir, incdir, "stria_client.h");
    expect_file(destdir, incdir, "stria_types.h");
    /* The client API only: the internals' header is not part of the ABI. */
    char internal[1200];
    snprintf(internal, sizeof(internal), "%s%s/stria_common.h", destdir, incdir);
    cr_expect_neq(access(internal, F_OK), 0, "%s is installed", internal);
    char pcdir[700];
    snprintf(pcdir, sizeof(pcdir), "%s/pkgconfig", libdir);
    expect_file(destdir, pcdir, "stria.pc");
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++)
        expect_file(destdir, unitdir, units[i]);
    expect_file(destdir, sysusersdir, "stria.conf");
    expect_file(destdir, exdir, "coordinator.conf");
    expect_file(destdir, exdir, "worker.conf");
    expect_file(destdir, docdir, "DEPLOY.md");
    expect_file(destdir, docdir, "README.md");
    expect_staged(destdir, pf, unitdir);
    expect_prefix_install_stays(&c);

    /* A trainer's program builds with `cc $(pkg-config --cflags --libs
     * stria)` against the staged install (pkg-config pointed into it), sees
     * the ABI version of its header in the library, is told clearly when it
     * forgets struct_size, and gets a clear error from an address nobody
     * listens on. */
    char src[400], exe[400];
    snprintf(src, sizeof(src), "%s/trainer.c", c.dir);
    snprintf(exe, sizeof(exe), "%s/trainer", c.dir);
    dc_write(src, "#include <stdio.h>\n#include <stria_client.h>\n"
                  "int main(int argc, char **argv) {\n"
                  "  stria_client_params_t p = STRIA_CLIENT_PARAMS_INIT, z = {0};\n"
                  "  stria_client_t *c = NULL;\n"
                  "  if (stria_client_abi_version() != STRIA_CLIENT_ABI_VERSION) return 2;\n"
                  "  z.coordinator = argv[1];\n"
                  "  stria_status_t st = stria_client_connect(&z, &c);\n"
                  "  printf(\"zero %s: %s\\n\", stria_status_name(st), stria_error_msg());\n"
                  "  z.struct_size = (size_t)argv[1]; /* an old header's first field */\n"
                  "  st = stria_client_connect(&z, &c);\n"
                  "  printf(\"pointer %s: %s\\n\", stria_status_name(st), stria_error_msg());\n"
                  "  p.coordinator = argv[1]; p.connect_timeout_s = 5;\n"
                  "  st = stria_client_connect(&p, &c);\n"
                  "  printf(\"%s: %s\\n\", stria_status_name(st), stria_error_msg());\n"
                  "  (void)argc; return st == STRIA_OK;\n}\n");
    char cmd[4000];
    snprintf(cmd, sizeof(cmd),
             "export PKG_CONFIG_SYSROOT_DIR='%s' PKG_CONFIG_PATH='%s%s/pkgconfig' && "
             "flags=$(pkg-config --cflags --libs stria) && "
             "%s -std=c11 -Wall -Werror '%s' -o '%s' $flags -Wl,-rpath,'%s%s' %s",
             destdir, destdir, libdir, STRIA_CC, src, exe, destdir, libdir, STRIA_SANITIZE_FLAGS);
    char *cc[] = {"/bin/sh", "-c", cmd, NULL};
    rc = dc_run(cc, NULL, 60, &out, &err);
    cr_assert_eq(rc, 0, "cannot build against the installed libstria with pkg-config:\n%s\n%s%s",
                 cmd, out, err);
    free(out);
    free(err);
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", dc_free_port());
    char *run[] = {exe, addr, NULL};
    rc = dc_run(run, NULL, 30, &out, &err);
    cr_expect_eq(rc, 0, "%s%s", out, err);
    cr_expect(strstr(out, "zero STRIA_ERR_INVALID_ARG") != NULL &&
                  strstr(out, "STRIA_CLIENT_PARAMS_INIT") != NULL,
              "no clear error for a struct without struct_size: %s", out);
    cr_expect(strstr(out, "pointer STRIA_ERR_INVALID_ARG") != NULL &&
                  strstr(out, "must be rebuilt") != NULL,
              "no clear error for a struct of a header older than struct_size: %s", out);
    cr_expect(strstr(out, "\nSTRIA_ERR_IO") != NULL && strstr(out, addr) != NULL,
              "unclear error from the installed library: %s", out);
    free(out);
    free(err);
    dc_stop(&c);
}
