/* Fuzz target: the UCX ring link's control-message decoder, its version
 * check and version 2 refusal, and the data header (transport/ucx_wire.c),
 * which read bytes from any peer that reaches a worker's ring port. A
 * message the decoder accepts re-encodes to the same bytes, text aside
 * (control characters in the text become '?'); a link message names a
 * valid rank of a valid ring, an endpoint message none. */
#include <string.h>

#include "fuzz_util.h"
#include "ucx_int.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    stria_log_set_level(STRIA_LOG_ERROR);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    stria__ctrl_t c, c2;
    uint8_t buf[STRIA__UCX_CTRL_HDR + STRIA__UCX_TEXT_MAX + 1];

    if (size >= STRIA__UCX_DATA_HDR) {
        uint32_t slot;
        uint64_t tag;
        uint8_t hdr[STRIA__UCX_DATA_HDR];
        stria__ucx_data_hdr_decode(data, &slot, &tag);
        stria__ucx_data_hdr_encode(hdr, slot, tag);
        if (memcmp(hdr, data, 4) != 0 || memcmp(hdr + 8, data + 8, 8) != 0)
            fuzz_fail("data header does not round-trip");
    }
    uint8_t refusal[STRIA__UCX_CTRL_MAX];
    size_t rn = stria__ucx_v2_refusal(data, size, "refused: version", refusal);
    if (rn > 0 && (stria__ucx_ctrl_version(data, size) != 2 || rn != 110 + 16 ||
                   stria__ucx_ctrl_version(refusal, rn) != 2 || stria_get_le16(refusal + 6) != 2 ||
                   memcmp(refusal + 8, data + 8, 16) != 0))
        fuzz_fail("a version 2 refusal of %zu bytes is not an acknowledgement of its hello", rn);
    if (stria__ucx_ctrl_decode(data, size, &c) != STRIA_OK)
        return 0;
    if (stria__ucx_ctrl_version(data, size) != STRIA__UCX_VERSION)
        fuzz_fail("accepted a message of version %d", stria__ucx_ctrl_version(data, size));
    bool link = c.type >= STRIA__CTRL_BIND;
    if (c.type < STRIA__CTRL_EP_HELLO || c.type > STRIA__CTRL_LAST)
        fuzz_fail("accepted type %u", c.type);
    if (link && (c.rank < 0 || c.rank >= c.size || c.size > 65535))
        fuzz_fail("accepted rank %d of %d", (int)c.rank, (int)c.size);
    if (!link && (c.rank != 0 || c.size != 0))
        fuzz_fail("accepted an endpoint message with rank %d of %d", (int)c.rank, (int)c.size);
    size_t tl = strlen(c.text);
    if (tl > STRIA__UCX_TEXT_MAX || STRIA__UCX_CTRL_HDR + tl != size)
        fuzz_fail("accepted text of %zu bytes in a %zu-byte message", tl, size);
    for (size_t i = 0; i < tl; i++)
        if ((unsigned char)c.text[i] < 0x20)
            fuzz_fail("control character left in the text at %zu", i);
    size_t n = stria__ucx_ctrl_encode(&c, buf);
    if (n != size || memcmp(buf, data, STRIA__UCX_CTRL_HDR) != 0)
        fuzz_fail("control message does not re-encode to its bytes");
    if (stria__ucx_ctrl_decode(buf, n, &c2) != STRIA_OK || memcmp(&c, &c2, sizeof(c)) != 0)
        fuzz_fail("re-encoded control message decodes differently");
    return 0;
}
