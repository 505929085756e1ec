/*
 * The wire format of the UCX ring link, as pure functions: the control
 * messages (endpoint handshake, binds, abort, goodbye, heartbeat), the
 * header of a data message and the MACs. Little-endian throughout.
 *
 * Control message, version 3 (STRIA__UCX_CTRL_HDR bytes, then the text):
 *   0 magic (u32)   4 version (u16)   6 type (u16)   8 flags (u16)
 *   10 text length (u16)   12 status (i32)   16 job id (u64)   24 ring id (u64)
 *   32 rank (i32)   36 size (i32)   40 slot (u32)   44 dst (u32)
 *   48 origin (i32)   52 reporter (i32)   56 counter (u64)
 *   64 incarnation (u64)   72 nonce (32)   104 MAC (32)   136 text
 * Every version starts with magic, version and type, so that a peer of
 * another version is told apart (and refused) by its first message.
 * Data header (STRIA__UCX_DATA_HDR bytes): 0 slot (u32), 4 zero, 8 tag (u64).
 */
#include "ucx_int.h"

#include <stdio.h>
#include <string.h>

size_t stria__ucx_ctrl_encode(const stria__ctrl_t *c, uint8_t *buf)
{
    size_t tl = strnlen(c->text, STRIA__UCX_TEXT_MAX);
    stria_put_le32(buf, STRIA__UCX_MAGIC);
    stria_put_le16(buf + 4, STRIA__UCX_VERSION);
    stria_put_le16(buf + 6, c->type);
    stria_put_le16(buf + 8, c->flags);
    stria_put_le16(buf + 10, (uint16_t)tl);
    stria_put_le32(buf + 12, (uint32_t)c->status);
    stria_put_le64(buf + 16, c->job_id);
    stria_put_le64(buf + 24, c->ring_id);
    stria_put_le32(buf + 32, (uint32_t)c->rank);
    stria_put_le32(buf + 36, (uint32_t)c->size);
    stria_put_le32(buf + 40, c->slot);
    stria_put_le32(buf + 44, c->dst);
    stria_put_le32(buf + 48, (uint32_t)c->origin);
    stria_put_le32(buf + 52, (uint32_t)c->reporter);
    stria_put_le64(buf + 56, c->counter);
    stria_put_le64(buf + 64, c->incarnation);
    memcpy(buf + 72, c->nonce, STRIA_AUTH_NONCE_BYTES);
    memcpy(buf + 104, c->mac, STRIA_AUTH_MAC_BYTES);
    memcpy(buf + STRIA__UCX_CTRL_HDR, c->text, tl);
    return STRIA__UCX_CTRL_HDR + tl;
}

int stria__ucx_ctrl_version(const uint8_t *buf, size_t len)
{
    if (len < 8 || stria_get_le32(buf) != STRIA__UCX_MAGIC)
        return -1;
    return stria_get_le16(buf + 4);
}

/* Whether a type is one of a link's messages (the others are the endpoint
 * handshake's, which name no ring). */
static bool is_link_type(uint16_t type)
{
    return type >= STRIA__CTRL_BIND && type <= STRIA__CTRL_LAST;
}

stria_status_t stria__ucx_ctrl_decode(const uint8_t *buf, size_t len, stria__ctrl_t *c)
{
    if (len < STRIA__UCX_CTRL_HDR)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message of %zu bytes is too short",
                               len);
    if (stria_get_le32(buf) != STRIA__UCX_MAGIC)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message with a bad magic number");
    if (stria_get_le16(buf + 4) != STRIA__UCX_VERSION)
        return stria_error_set(STRIA_ERR_PROTOCOL,
                               "peer speaks link protocol version %u, this one version %u",
                               stria_get_le16(buf + 4), STRIA__UCX_VERSION);
    memset(c, 0, sizeof(*c));
    c->type = stria_get_le16(buf + 6);
    c->flags = stria_get_le16(buf + 8);
    size_t tl = stria_get_le16(buf + 10);
    c->status = (int32_t)stria_get_le32(buf + 12);
    c->job_id = stria_get_le64(buf + 16);
    c->ring_id = stria_get_le64(buf + 24);
    c->rank = (int32_t)stria_get_le32(buf + 32);
    c->size = (int32_t)stria_get_le32(buf + 36);
    c->slot = stria_get_le32(buf + 40);
    c->dst = stria_get_le32(buf + 44);
    c->origin = (int32_t)stria_get_le32(buf + 48);
    c->reporter = (int32_t)stria_get_le32(buf + 52);
    c->counter = stria_get_le64(buf + 56);
    c->incarnation = stria_get_le64(buf + 64);
    memcpy(c->nonce, buf + 72, STRIA_AUTH_NONCE_BYTES);
    memcpy(c->mac, buf + 104, STRIA_AUTH_MAC_BYTES);
    if (c->type < STRIA__CTRL_EP_HELLO || c->type > STRIA__CTRL_LAST)
        return stria_error_set(STRIA_ERR_PROTOCOL, "unknown control message type %u", c->type);
    if (c->flags & ~STRIA__CTRL_FLAG_KEYED)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message with unknown flags %#x",
                               c->flags);
    if (tl > STRIA__UCX_TEXT_MAX || STRIA__UCX_CTRL_HDR + tl != len)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message length %zu does not match",
                               len);
    if (is_link_type(c->type) ? c->size < 1 || c->size > 65535 || c->rank < 0 || c->rank >= c->size
                              : c->rank != 0 || c->size != 0)
        return stria_error_set(STRIA_ERR_PROTOCOL, "control message type %u with rank %d of %d",
                               c->type, (int)c->rank, (int)c->size);
    memcpy(c->text, buf + STRIA__UCX_CTRL_HDR, tl);
    c->text[tl] = '\0';
    for (size_t i = 0; i < tl; i++)
        if ((unsigned char)c->text[i] < 0x20)
            c->text[i] = '?';
    return STRIA_OK;
}

/* Version 2's control message: 0 magic, 4 version, 6 type (1 HELLO, 2 ACK),
 * 8 job, 16 ring, 24 rank, 28 size, 32 status, 36 slot, 40 origin,
 * 44 text length, 46 nonce, 78 MAC, 110 text. */
#define V2_HDR 110

size_t stria__ucx_v2_refusal(const uint8_t *buf, size_t len, const char *text, uint8_t *out)
{
    if (len < V2_HDR || stria__ucx_ctrl_version(buf, len) != 2 || stria_get_le16(buf + 6) != 1)
        return 0;
    int32_t rank = (int32_t)stria_get_le32(buf + 24), size = (int32_t)stria_get_le32(buf + 28);
    if (size < 1 || size > 65535 || rank < 0 || rank >= size)
        return 0;
    size_t tl = strnlen(text, STRIA__UCX_TEXT_MAX);
    memset(out, 0, V2_HDR);
    stria_put_le32(out, STRIA__UCX_MAGIC);
    stria_put_le16(out + 4, 2);
    stria_put_le16(out + 6, 2);   /* ACK */
    memcpy(out + 8, buf + 8, 16); /* its job and ring */
    stria_put_le32(out + 24, (uint32_t)((rank + 1) % size));
    stria_put_le32(out + 28, (uint32_t)size);
    stria_put_le32(out + 32, (uint32_t)STRIA_ERR_PROTOCOL);
    stria_put_le32(out + 40, (uint32_t)((rank + 1) % size));
    stria_put_le16(out + 44, (uint16_t)tl);
    memcpy(out + V2_HDR, text, tl);
    return V2_HDR + tl;
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

void stria__ucx_ep_mac(const uint8_t key[STRIA_AUTH_KEY_BYTES], bool acceptor,
                       const uint8_t *nonce_c, const uint8_t *nonce_s, uint64_t inc_c,
                       uint64_t inc_s, uint8_t out[STRIA_AUTH_MAC_BYTES])
{
    const char *label = acceptor ? "stria endpoint v3 acceptor" : "stria endpoint v3 connector";
    uint8_t fields[16];
    stria_put_le64(fields, inc_c);
    stria_put_le64(fields + 8, inc_s);
    stria_auth_part_t parts[] = {
        {label, strlen(label) + 1},
        {nonce_c, STRIA_AUTH_NONCE_BYTES},
        {nonce_s, STRIA_AUTH_NONCE_BYTES},
        {fields, sizeof(fields)},
    };
    stria_auth_hmac(key, STRIA_AUTH_KEY_BYTES, parts, 4, out);
}

void stria__ucx_bind_mac(const uint8_t key[STRIA_AUTH_KEY_BYTES], bool acceptor,
                         const stria__bind_fields_t *f, uint8_t out[STRIA_AUTH_MAC_BYTES])
{
    const char *label = acceptor ? "stria bind v3 acceptor" : "stria bind v3 connector";
    uint8_t fields[40];
    stria_put_le64(fields, f->counter);
    stria_put_le64(fields + 8, f->job_id);
    stria_put_le64(fields + 16, f->ring_id);
    stria_put_le32(fields + 24, (uint32_t)f->rank);
    stria_put_le32(fields + 28, (uint32_t)f->size);
    stria_put_le32(fields + 32, f->slot_c);
    stria_put_le32(fields + 36, f->slot_a);
    stria_auth_part_t parts[] = {
        {label, strlen(label) + 1},
        {f->nonce_c, STRIA_AUTH_NONCE_BYTES},
        {f->nonce_s, STRIA_AUTH_NONCE_BYTES},
        {fields, sizeof(fields)},
    };
    stria_auth_hmac(key, STRIA_AUTH_KEY_BYTES, parts, 4, out);
}
