#include "stria_transport.h"

stria_status_t stria_link_isend(stria_link_t *link, uint64_t tag, const void *buf, size_t len,
                                stria_link_req_t **req_out)
{
    if (link == NULL || req_out == NULL || (buf == NULL && len > 0))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_link_isend: NULL argument");
    return link->ops->isend(link, tag, buf, len, req_out);
}

stria_status_t stria_link_irecv(stria_link_t *link, uint64_t tag, void *buf, size_t len,
                                stria_link_req_t **req_out)
{
    if (link == NULL || req_out == NULL || (buf == NULL && len > 0))
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_link_irecv: NULL argument");
    return link->ops->irecv(link, tag, buf, len, req_out);
}

stria_status_t stria_link_wait(stria_link_t *link, stria_link_req_t *req, double timeout_s)
{
    if (link == NULL || req == NULL)
        return stria_error_set(STRIA_ERR_INVALID_ARG, "stria_link_wait: NULL argument");
    return link->ops->wait(link, req, timeout_s);
}

void stria_link_cancel(stria_link_t *link, stria_link_req_t *req)
{
    if (link != NULL && req != NULL)
        link->ops->cancel(link, req);
}

void stria_link_abort(stria_link_t *link, stria_status_t reason, const char *msg)
{
    if (link != NULL)
        link->ops->abort(link, reason, msg ? msg : "");
}

void stria_link_destroy(stria_link_t *link)
{
    if (link != NULL)
        link->ops->destroy(link);
}

stria_status_t stria_link_abort_status(stria_status_t reason)
{
    switch (reason) {
    case STRIA_OK:
        return STRIA_ERR_CANCELLED;
    case STRIA_ERR_PEER:
    case STRIA_ERR_TRANSPORT:
    case STRIA_ERR_TIMEOUT:
    case STRIA_ERR_PROTOCOL:
    case STRIA_ERR_CLOSED:
        return STRIA_ERR_PEER;
    default:
        return reason;
    }
}
