/*
 * libstria: the client, its connection to the coordinator, and its close
 * (see stria_client.h; the library's rooms are listed in client_int.h).
 */
#include <stdlib.h>
#include <string.h>

#include "client_int.h"

#define PARAMS_V1_SIZE STRIA__V1_END(stria_client_params_t, client_name)

stria_status_t stria_client_connect(const stria_client_params_t *params,
                                    stria_client_t **client_out)
{
    stria_client_t *c;
    stria_rpc_client_params_t rp;
    stria_rpc_reply_t reply;
    stria_client_params_t p;
    stria_status_t st;

    if (params == NULL || client_out == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_client_connect: NULL argument");
    st = stria__labi_read(&p, sizeof(p), PARAMS_V1_SIZE, params, "stria_client_params_t",
                          "STRIA_CLIENT_PARAMS_INIT");
    if (st != STRIA_OK)
        return st;
    params = &p;
    if (params->coordinator == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_connect: the coordinator address is required");
    if (params->token != NULL && params->token_file != NULL)
        return stria_error_set(
            STRIA_ERR_INVALID_ARG,
            "stria_client_connect: token and token_file are both set (give one)");
    if (params->forward_retries > 16)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_connect: forward_retries %d is more than 16",
                               params->forward_retries);
    if ((unsigned)params->data_path > STRIA_DATA_PATH_SHM)
        return stria_error_set(STRIA_ERR_INVALID_ARG,
                               "stria_client_connect: data_path %d is none of auto (0), tcp (1), "
                               "shm (2)",
                               (int)params->data_path);
    c = calloc(1, sizeof(*c));
    if (c == NULL)
        return stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate client");
    c->params = *params;
    pthread_mutex_init(&c->keep_lock, NULL);
    c->coordinator = strdup(params->coordinator);
    c->token = params->token ? strdup(params->token) : NULL;
    c->client_name = strdup(params->client_name ? params->client_name : "libstria");
    if (c->coordinator == NULL || c->client_name == NULL || (params->token && c->token == NULL)) {
        st = stria_error_set(STRIA_ERR_NO_MEMORY, "cannot allocate client");
        goto err;
    }
    if (params->token_file != NULL &&
        (st = stria_rpc_token_read(params->token_file, &c->token)) != STRIA_OK)
        goto err;
    if (c->params.connect_timeout_s <= 0)
        c->params.connect_timeout_s = 10.0;
    if (c->params.rpc_timeout_s <= 0)
        c->params.rpc_timeout_s = 120.0;

    memset(&rp, 0, sizeof(rp));
    rp.address = c->coordinator;
    rp.service = &stria__v1__coordinator__descriptor;
    rp.token = c->token;
    rp.client_name = c->client_name;
    rp.connect_timeout_s = c->params.connect_timeout_s;
    st = stria_rpc_client_connect(&rp, &c->coord);
    if (st != STRIA_OK) {
        stria_error_wrap(st, "coordinator %s", c->coordinator);
        goto err;
    }
    Stria__V1__GetStatusRequest req = STRIA__V1__GET_STATUS_REQUEST__INIT;
    st = stria__lcoord_call(c, STRIA_RPC_COORDINATOR_GET_STATUS, &req.base, NULL, 0, &reply, true);
    stria_rpc_reply_free(&reply);
    if (st != STRIA_OK)
        goto err;
    *client_out = c;
    return STRIA_OK;
err:
    stria_rpc_client_close(c->coord);
    pthread_mutex_destroy(&c->keep_lock);
    free(c->coordinator);
    stria_auth_free_secret(c->token);
    free(c->client_name);
    free(c);
    return st;
}

void stria_client_close(stria_client_t *client)
{
    if (client == NULL)
        return;
    while (client->sessions != NULL)
        stria_session_close(client->sessions);
    while (client->jobs != NULL)
        stria_client_release(client->jobs);
    stria__lrank_forget_kept(client);
    pthread_mutex_destroy(&client->keep_lock);
    stria_rpc_client_close(client->coord);
    free(client->coordinator);
    stria_auth_free_secret(client->token);
    free(client->client_name);
    free(client);
}
