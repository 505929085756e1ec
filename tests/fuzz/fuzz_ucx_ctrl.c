/* Fuzz target: the UCX ring link's control-message decoder and data header
 * (transport/ucx_wire.c), which read bytes from any peer that reaches a
 * worker's ring port. A message the decoder accepts re-encodes to the same
 * bytes, text aside (control characters in the text become '?'). */
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
    if (stria__ucx_ctrl_decode(data, size, &c) != STRIA_OK)
        return 0;
    if (c.rank < 0 || c.rank >= c.size || c.size > 65535)
        fuzz_fail("accepted rank %d of %d", (int)c.rank, (int)c.size);
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
