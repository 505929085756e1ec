/* Addresses, systemd notification, Prometheus metrics (the option parser has
 * its own suite, test_opts). */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "stria_common.h"

Test(service_utils, host_port)
{
    char host[64];
    uint16_t port;
    cr_assert_eq(stria_addr_parse("127.0.0.1:7400", host, sizeof(host), &port), STRIA_OK);
    cr_expect_str_eq(host, "127.0.0.1");
    cr_expect_eq(port, 7400);
    cr_assert_eq(stria_addr_parse("[::1]:0", host, sizeof(host), &port), STRIA_OK);
    cr_expect_str_eq(host, "::1");
    cr_expect_eq(port, 0);
    cr_expect_neq(stria_addr_parse("localhost", host, sizeof(host), &port), STRIA_OK);
    cr_expect_neq(stria_addr_parse("h:99999", host, sizeof(host), &port), STRIA_OK);
    cr_expect_neq(stria_addr_parse(":80", host, sizeof(host), &port), STRIA_OK);
    cr_expect_eq(stria_addr_parse("::1:80", host, sizeof(host), &port), STRIA_ERR_INVALID_ARG);
    cr_expect(strstr(stria_error_msg(), "in brackets") != NULL, "%s", stria_error_msg());
}

Test(service_utils, notify_sends_to_socket)
{
    char sock_path[108];
    snprintf(sock_path, sizeof(sock_path), "/tmp/stria_notify_%d.sock", (int)getpid());
    unlink(sock_path);
    int fd = socket(AF_UNIX, SOCK_DGRAM, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strcpy(addr.sun_path, sock_path);
    cr_assert_eq(bind(fd, (struct sockaddr *)&addr, sizeof(addr)), 0);
    setenv("NOTIFY_SOCKET", sock_path, 1);
    cr_assert_eq(stria_notify("READY=1\nSTATUS=serving"), STRIA_OK, "%s", stria_error_msg());
    char buf[128] = {0};
    ssize_t n = recv(fd, buf, sizeof(buf) - 1, 0);
    cr_expect_eq(n, (ssize_t)strlen("READY=1\nSTATUS=serving"));
    cr_expect_str_eq(buf, "READY=1\nSTATUS=serving");
    close(fd);
    unlink(sock_path);
    unsetenv("NOTIFY_SOCKET");
    cr_expect_eq(stria_notify("READY=1"), STRIA_OK); /* no manager: nothing to do */
    setenv("WATCHDOG_USEC", "2000000", 1);
    cr_expect_float_eq(stria_notify_watchdog_interval(), 2.0, 1e-9);
    unsetenv("WATCHDOG_USEC");
    cr_expect_eq(stria_notify_watchdog_interval(), 0.0);
}

Test(service_utils, metrics_render_parses_with_prometheus_client)
{
    stria_metrics_t *reg;
    static const double buckets[] = {0.001, 0.01, 0.1, 1.0};
    char esc[64];
    cr_assert_eq(stria_metrics_create(&reg), STRIA_OK);
    stria_metric_t *c = stria_metrics_get(reg, STRIA_METRIC_COUNTER, "stria_test_bytes_total",
                                          "Bytes sent.\nSecond line", "rank=\"1\"", NULL, 0);
    stria_metric_t *g = stria_metrics_get(reg, STRIA_METRIC_GAUGE, "stria_test_memory_bytes",
                                          "Memory in use.", NULL, NULL, 0);
    stria_metric_t *h = stria_metrics_get(reg, STRIA_METRIC_HISTOGRAM, "stria_test_step_seconds",
                                          "Step time.", "kind=\"compute\"", buckets, 4);
    stria_metrics_escape("a\"b\\c\nd", esc, sizeof(esc));
    cr_expect_str_eq(esc, "a\\\"b\\\\c\\nd");
    char labels[128];
    snprintf(labels, sizeof(labels), "job=\"%s\"", esc);
    stria_metric_t *weird = stria_metrics_get(reg, STRIA_METRIC_GAUGE, "stria_test_weird",
                                              "Odd label.", labels, NULL, 0);
    cr_assert(c && g && h && weird);
    cr_expect_null(
        stria_metrics_get(reg, STRIA_METRIC_GAUGE, "stria_test_bytes_total", "", NULL, NULL, 0));
    cr_expect_null(stria_metrics_get(reg, STRIA_METRIC_GAUGE, "9bad name", "", NULL, NULL, 0));
    stria_metric_add(c, 1024);
    stria_metric_add(c, 1024);
    stria_metric_set(g, 1.5e9);
    stria_metric_set(weird, NAN);
    stria_metric_observe(h, 0.005);
    stria_metric_observe(h, 0.05);
    stria_metric_observe(h, 5.0);

    char *text;
    size_t len;
    cr_assert_eq(stria_metrics_render(reg, &text, &len), STRIA_OK);
    cr_expect(strstr(text, "stria_test_bytes_total{rank=\"1\"} 2048\n") != NULL, "%s", text);
    /* Buckets are cumulative: every one counts the observations at or below
     * its bound (0.001: none, 0.01: 0.005, 0.1: also 0.05, 1: the same two). */
    static const char *const want[] = {"le=\"0.001\"} 0\n", "le=\"0.01\"} 1\n", "le=\"0.1\"} 2\n",
                                       "le=\"1\"} 2\n", "le=\"+Inf\"} 3\n"};
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        char line[160];
        snprintf(line, sizeof(line), "stria_test_step_seconds_bucket{kind=\"compute\",%s", want[i]);
        cr_expect(strstr(text, line) != NULL, "no line %s in:\n%s", line, text);
    }

    /* a real Prometheus text parser must accept it and read the same values */
    char file[128];
    snprintf(file, sizeof(file), "/tmp/stria_metrics_%d.txt", (int)getpid());
    FILE *f = fopen(file, "w");
    fwrite(text, 1, len, f);
    fclose(f);
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "%s -c \"import sys\nfrom prometheus_client.parser import "
             "text_string_to_metric_families as p\n"
             "fs={f.name: f for f in p(open('%s').read())}\n"
             "assert fs['stria_test_bytes'].samples[0].value == 2048, fs\n"
             "assert fs['stria_test_memory_bytes'].samples[0].value == 1.5e9\n"
             "h=fs['stria_test_step_seconds']; assert h.type == 'histogram'\n"
             "s={(x.name, x.labels.get('le')): x.value for x in h.samples}\n"
             "assert s[('stria_test_step_seconds_count', None)] == 3, s\n"
             "assert abs(s[('stria_test_step_seconds_sum', None)] - 5.055) < 1e-12\n"
             "want = 'a' + chr(34) + 'b' + chr(92) + 'c' + chr(10) + 'd'\n"
             "assert fs['stria_test_weird'].samples[0].labels['job'] == want\n"
             "print('parsed', len(fs), 'families')\"",
             STRIA_SYSTEM_PYTHON, file);
    int rc = system(cmd);
    cr_expect_eq(rc, 0, "prometheus_client rejected the exposition:\n%s", text);
    unlink(file);
    free(text);

    stria_metrics_forget(reg, "rank=\"1\"");
    cr_assert_eq(stria_metrics_render(reg, &text, &len), STRIA_OK);
    cr_expect(strstr(text, "stria_test_bytes_total") == NULL);
    free(text);
    stria_metrics_destroy(reg);
}
