/*
 * The call record (stria_call_shape_t, common/stria_call.h) in the
 * protocol's forms: a session call's CallShape and a job's JobSpec (a job is
 * one call). Only what needs the generated protobuf-c types lives here; the
 * record, its rules, digest and binding are common's.
 */
#ifndef STRIA_SPEC_H
#define STRIA_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "stria.pb-c.h"
#include "stria_call.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The protocol's form: pb and win are filled (win used when the call has a
 * window); the documents are borrowed from c. */
void stria_call_shape_to_pb(const stria_call_shape_t *c, Stria__V1__CallShape *pb,
                            Stria__V1__JobSpec__Window *win);
/* The C record of a decoded message (documents borrowed from it). */
void stria_call_shape_from_pb(const Stria__V1__CallShape *pb, stria_call_shape_t *c);
/* A job is one call: the record of a JobSpec's batch, seq_len, causal,
 * scale, documents and window (documents borrowed from s; an owning copy
 * with stria_call_shape_copy()), and those fields of a JobSpec from the
 * record (documents borrowed from c; win used when the call has a window). */
void stria_call_shape_from_spec(const Stria__V1__JobSpec *s, stria_call_shape_t *c);
void stria_call_shape_to_spec(const stria_call_shape_t *c, Stria__V1__JobSpec *s,
                              Stria__V1__JobSpec__Window *win);
/* The place of a decoded request (stria_call_place_t, stria_call.h), and
 * the request's fields from a place. */
void stria_call_place_from_pb(const Stria__V1__SessionCallRequest *req, stria_call_place_t *p);
void stria_call_place_to_pb(const stria_call_place_t *p, Stria__V1__SessionCallRequest *req);

#ifdef __cplusplus
}
#endif

#endif /* STRIA_SPEC_H */
