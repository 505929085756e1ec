/* stria-bench subcommands. Each returns a process exit code. */
#ifndef STRIA_BENCH_H
#define STRIA_BENCH_H

int stria_bench_kernels(int argc, char **argv);
int stria_bench_ring(int argc, char **argv);
int stria_bench_transport(int argc, char **argv);
int stria_bench_service(int argc, char **argv);
int stria_bench_simulate(int argc, char **argv);
int stria_bench_datapath(int argc, char **argv);
int stria_bench_auth(int argc, char **argv);
int stria_bench_soak(int argc, char **argv);
int stria_bench_calls(int argc, char **argv);
int stria_bench_docplan(int argc, char **argv);
int stria_bench_slowlink(int argc, char **argv);

#endif
