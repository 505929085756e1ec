/*
 * The wire format of the UCX ring link, as pure functions: the control
 * messages (handshake, acknowledgement, abort, goodbye, heartbeat) and the
 * header of a data message. Little-endian throughout.
 *
 * Control message (STRIA__UCX_CTRL_HDR bytes, then the text):
 *   0 magic (u32)   4 version (u16)   6 type (u16)   8 job id (u64)
 *   16 ring id (u64)   24 rank (i32)   28 size (i32)   32 status (i32)
 *   36 slot (u32)   40 origin (i32)   44 text length (u16)   46 nonce (32)
 *   78 MAC (32)   110 text
 * Data header (STRIA__UCX_DATA_HDR bytes): 0 slot (u32), 4 zero, 8 tag (u64).
 */
#include "ucx_int.h"

#include <string.h>

size_t stria__ucx_ctrl_encode(const stria__ctrl_t *c, uint8_t *buf)
{
    size_t tl = strnlen(c->text, STRIA__UCX_TEXT_MAX);
    stria_put_le32(buf, STRIA__UCX_MAGIC);
    stria_put_le16(buf + 4, STRIA__UCX_VERSION);
    stria_put_le16(buf + 6, c->type);
    stria_put_le64(buf + 8, c->job_id);
    stria_put_le64(buf + 16, c->ring_id);
    stria_put_le32(buf + 24, (uint32_t)c->rank);
    stria_put_le32(buf + 28, (uint32_t)c->size);
    stria_put_le32(buf + 32, (uint32_t)c->status);
    stria_put_le32(buf + 36, c->slot);
    stria_put_le32(buf + 40, (uint32_t)c->origin);
    stria_put_le16(buf + 44, (uint16_t)tl);
    memcpy(buf + 46, c->nonce, STRIA_AUTH_NONCE_BYTES);
    memcpy(buf + 78, c->mac, STRIA_AUTH_MAC_BYTES);
    memcpy(buf + STRIA__UCX_CTRL_HDR, c->text, tl);
    return STRIA__UCX_CTRL_HDR + tl;
}

stria_status_t stria__ucx_ctrl_decode(const uint8_t *buf, size_t len, stria__ctrl_t *c)
{
    if (len < STRIA__UCX_CTRL_HDR)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message of %zu bytes is too short",
                               len);
    if (stria_get_le32(buf) != STRIA__UCX_MAGIC)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message with a bad magic number");
    if (stria_get_le16(buf + 4) != STRIA__UCX_VERSION)
        return stria_error_set(STRIA_ERR_PROTOCOL, "peer speaks link protocol version %u, not %u",
                               stria_get_le16(buf + 4), STRIA__UCX_VERSION);
    memset(c, 0, sizeof(*c));
    c->type = stria_get_le16(buf + 6);
    c->job_id = stria_get_le64(buf + 8);
    c->ring_id = stria_get_le64(buf + 16);
    c->rank = (int32_t)stria_get_le32(buf + 24);
    c->size = (int32_t)stria_get_le32(buf + 28);
    c->status = (int32_t)stria_get_le32(buf + 32);
    c->slot = stria_get_le32(buf + 36);
    c->origin = (int32_t)stria_get_le32(buf + 40);
    size_t tl = stria_get_le16(buf + 44);
    memcpy(c->nonce, buf + 46, STRIA_AUTH_NONCE_BYTES);
    memcpy(c->mac, buf + 78, STRIA_AUTH_MAC_BYTES);
    if (c->type < STRIA__CTRL_HELLO || c->type > STRIA__CTRL_PROOF)
        return stria_error_set(STRIA_ERR_PROTOCOL, "unknown control message type %u", c->type);
    if (tl > STRIA__UCX_TEXT_MAX || STRIA__UCX_CTRL_HDR + tl != len)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message length %zu does not match",
                               len);
    if (c->size < 1 || c->size > 65535 || c->rank < 0 || c->rank >= c->size)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message with rank %d of %d",
                               (int)c->rank, (int)c->size);
    memcpy(c->text, buf + STRIA__UCX_CTRL_HDR, tl);
    c->text[tl] = '\0';
    for (size_t i = 0; i < tl; i++)
        if ((unsigned char)c->text[i] < 0x20)
            c->text[i] = '?';
    return STRIA_OK;
}

void stria__ucx_data_hdr_encode(uint8_t hdr[STRIA__UCX_DATA_HDR], uint32_t slot, uint64_t tag)
{
    stria_put_le32(hdr, slot);
    stria_put_le32(hdr + 4, 0);
    stria_put_le64(hdr + 8, tag);
}

void stria__ucx_data_hdr_decode(const void *hdr, uint32_t *slot, uint64_t *tag)
{
    *slot = stria_get_le32(hdr);
    *tag = stria_get_le64((const uint8_t *)hdr + 8);
}

void stria__ucx_ring_mac(const uint8_t key[STRIA_AUTH_KEY_BYTES], bool acceptor, uint64_t job_id,
                         uint64_t ring_id, int32_t connector_rank, int32_t size,
                         const uint8_t *nonce_c, const uint8_t *nonce_s,
                         uint8_t out[STRIA_AUTH_MAC_BYTES])
{
    const char *label = acceptor ? "stria ring v1 acceptor" : "stria ring v1 connector";
    uint8_t fields[24];
    stria_put_le64(fields, job_id);
    stria_put_le64(fields + 8, ring_id);
    stria_put_le32(fields + 16, (uint32_t)connector_rank);
    stria_put_le32(fields + 20, (uint32_t)size);
    stria_auth_part_t parts[] = {
        {label, strlen(label) + 1},
        {fields, sizeof(fields)},
        {nonce_c, STRIA_AUTH_NONCE_BYTES},
        {nonce_s, STRIA_AUTH_NONCE_BYTES},
    };
    stria_auth_hmac(key, STRIA_AUTH_KEY_BYTES, parts, 4, out);
}
