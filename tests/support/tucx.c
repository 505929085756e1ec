#include "tucx.h"

#include <getopt.h>
#include <stdlib.h>

bool tucx_parse(int argc, char **argv, const tucx_opt_t *opts)
{
    int n = 0;
    while (opts[n].name != NULL)
        n++;
    struct option *lo = calloc((size_t)n + 1, sizeof(*lo));
    if (lo == NULL)
        return false;
    for (int i = 0; i < n; i++)
        lo[i] = (struct option){opts[i].name,
                                opts[i].kind == TUCX_FLAG ? no_argument : required_argument, NULL,
                                256 + i};
    bool ok = true;
    int c;
    while (ok && (c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        if (c < 256 || c >= 256 + n) {
            ok = false;
            break;
        }
        const tucx_opt_t *o = &opts[c - 256];
        switch (o->kind) {
        case TUCX_INT:
            *(int *)o->dst = atoi(optarg);
            break;
        case TUCX_U64:
            *(uint64_t *)o->dst = strtoull(optarg, NULL, 0);
            break;
        case TUCX_SIZE:
            *(size_t *)o->dst = strtoull(optarg, NULL, 0);
            break;
        case TUCX_DOUBLE:
            *(double *)o->dst = atof(optarg);
            break;
        case TUCX_STR:
            *(const char **)o->dst = optarg;
            break;
        case TUCX_FLAG:
            *(bool *)o->dst = true;
            break;
        }
    }
    free(lo);
    return ok;
}

void tucx_key_of_seed(int seed, uint8_t key[STRIA_AUTH_KEY_BYTES])
{
    for (int i = 0; i < STRIA_AUTH_KEY_BYTES; i++)
        key[i] = (uint8_t)(seed * 31 + i * 7 + 1);
}
