/* packd for ONNX Runtime's C and C++ workers (libpackd_onnxruntime.so).
 *
 * Include ONNX Runtime's onnxruntime_c_api.h first, then this header, and create sessions
 * with packd_ort_create_session instead of OrtApi::CreateSession:
 *
 *     #include <onnxruntime_c_api.h>
 *     #include <packd_onnxruntime.h>
 *
 *     OrtSession *session = NULL;
 *     packd_ort_share *share = NULL;
 *     OrtStatus *st = packd_ort_create_session(ort, env, "model.onnx", options, ORT_ENABLE_ALL,
 *                                              &session, &share);
 *     ...
 *     ort->ReleaseSession(session);
 *     packd_ort_free(share);     // after the session: it holds packd's lease
 *
 * Link with -lpackd_onnxruntime (and ONNX Runtime). The first worker on the host has ONNX
 * Runtime write the model's optimized form, its weights and MLAS's prepacked weights into
 * memory packd publishes; every other worker's session maps packd's copy and prepacks nothing.
 * Anything packd cannot share (packd away, PACKD_ONNXRUNTIME=off, an ORT-format model, ...)
 * is created exactly as OrtApi::CreateSession would, and the reason is counted:
 * packd_onnxruntime_status() returns the status as JSON; PACKD_ONNXRUNTIME_STATUS=stderr (or a
 * path) writes it at exit. docs/INTEGRATION.md, "ONNX Runtime", tells how it works.
 */
#ifndef PACKD_ONNXRUNTIME_H
#define PACKD_ONNXRUNTIME_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One session's share of packd. */
typedef struct packd_ort_share packd_ort_share;

/* What a share is now (packd_ort_role). */
enum { PACKD_ORT_PRIVATE = 0, PACKD_ORT_BUILD = 1, PACKD_ORT_SERVED = 2 };

/* Asks packd for the optimized form of the model at model_path (or, when it is NULL, of the
 * len bytes at model) under options, the text of the session options that change the
 * optimized model (packd_ort_create_session writes it). Waits while another process builds
 * it. Never NULL but after an internal error. */
packd_ort_share *packd_ort_open(const char *model_path, const void *model, size_t len, const char *options);
/* PACKD_ORT_PRIVATE, PACKD_ORT_BUILD or PACKD_ORT_SERVED: the step a share is at while a
 * session is being created. Once the session is created (packd_ort_served, or
 * packd_ort_create_session returned) it is PRIVATE whatever happened: the status JSON
 * (packd_onnxruntime_status: "built", "served", "private" and "reasons") says how the
 * process's sessions got their weights. */
int packd_ort_role(packd_ort_share *share);
/* Copy a builder's optimized_model_filepath, or the model to load when served, into buf
 * (NUL-terminated, cut to len); return the whole length (0: not that role). */
size_t packd_ort_build_model_path(packd_ort_share *share, char *buf, size_t len);
size_t packd_ort_model_path(packd_ort_share *share, char *buf, size_t len);
/* The optimized model was written: packd seals and publishes it. Returns the role now. */
int packd_ort_finish_build(packd_ort_share *share);
/* The session over packd_ort_model_path was created: 1 when it maps packd's copy, 0 when it
 * must be released and created again as without packd. */
int packd_ort_served(packd_ort_share *share);
/* ONNX Runtime failed with error: a builder gives its role up (its waiters build). */
void packd_ort_abandon(packd_ort_share *share, const char *error);
/* A session packd takes no part in, for reason: counted and reported. */
packd_ort_share *packd_ort_skip(const char *model, const char *reason);
/* Ends the share (and packd's lease on the copy): after the session is released. */
void packd_ort_free(packd_ort_share *share);
/* The i-th session config entry whose value is part of the identity; NULL past the last. */
const char *packd_ort_keyed_entry(size_t i);
/* The i-th session config entry a builder's options get, its value in *value; NULL past the
 * last. */
const char *packd_ort_build_entry(size_t i, const char **value);
/* The status as JSON (NUL-terminated, cut to len); returns the whole length. */
size_t packd_onnxruntime_status(char *buf, size_t len);

#ifdef ORT_API_VERSION
#include <stdio.h>
#include <string.h>

/* Creates a session of the model at model_path as ort->CreateSession(env, model_path,
 * options, session) does, through packd. level is the graph optimization level options were
 * given (ORT_ENABLE_ALL if you set none): ONNX Runtime cannot tell it back, and it names the
 * optimized model, with every session config entry packd_ort_keyed_entry lists (read from
 * options). *share is always set: free it with packd_ort_free after releasing the session
 * (or at once when this fails). Whatever goes wrong on packd's side, the session is created
 * as ort->CreateSession would (the reason counted); the status returned is ONNX Runtime's
 * own (NULL on success).
 *
 * What the C API cannot tell back, and the helper therefore cannot check: do not use it for
 * sessions whose options add initializers (AddInitializer, AddExternalInitializers*), custom
 * operator libraries, free dimension overrides, execution providers, or their own
 * optimized_model_filepath; create those with ort->CreateSession. */
static inline OrtStatus *packd_ort_create_session(const OrtApi *ort, const OrtEnv *env, const char *model_path,
                                                  const OrtSessionOptions *options, int level, OrtSession **session,
                                                  packd_ort_share **share) {
  *session = NULL;
  size_t len = strlen(model_path);
  if (len >= 4 && strcmp(model_path + len - 4, ".ort") == 0) {
    *share = packd_ort_skip(model_path, "an ORT-format model (packd shares ONNX models)");
    return ort->CreateSession(env, model_path, options, session);
  }
  /* The identity's options: config values are 1024 bytes at most (ONNX Runtime's limit). */
  char text[40000];
  size_t used = (size_t)snprintf(text, sizeof text, "level=%d", level);
  const char *key;
  for (size_t i = 0; (key = packd_ort_keyed_entry(i)) != NULL; i++) {
    int has = 0;
    char value[1100];
    size_t n = sizeof value;
    OrtStatus *st = ort->HasSessionConfigEntry(options, key, &has);
    if (st == NULL && has) st = ort->GetSessionConfigEntry(options, key, value, &n);
    if (st != NULL) {
      ort->ReleaseStatus(st);
      *share = packd_ort_skip(model_path, "a session config entry could not be read back (GetSessionConfigEntry)");
      return ort->CreateSession(env, model_path, options, session);
    }
    if (has) used += (size_t)snprintf(text + used, sizeof text - used, "\n%s=%s", key, value);
    if (used >= sizeof text) {
      *share = packd_ort_skip(model_path, "the session options are too long to name");
      return ort->CreateSession(env, model_path, options, session);
    }
  }
  *share = packd_ort_open(model_path, NULL, 0, text);
  int role = packd_ort_role(*share);
  char path[4096];
  if (role == PACKD_ORT_BUILD) {
    OrtSessionOptions *ours = NULL;
    OrtSession *scratch = NULL;
    OrtStatus *st = ort->CloneSessionOptions(options, &ours);
    if (st == NULL && packd_ort_build_model_path(*share, path, sizeof path) < sizeof path) {
      st = ort->SetOptimizedModelFilePath(ours, path);
    } else if (st == NULL) {
      packd_ort_abandon(*share, "the build's path is longer than the helper's buffer");
    }
    const char *value;
    for (size_t i = 0; st == NULL && (key = packd_ort_build_entry(i, &value)) != NULL; i++) {
      st = ort->AddSessionConfigEntry(ours, key, value);
    }
    if (st == NULL) st = ort->SetSessionLogSeverityLevel(ours, 3); /* its CPU-specific warning */
    if (st == NULL && packd_ort_role(*share) == PACKD_ORT_BUILD) st = ort->CreateSession(env, model_path, ours, &scratch);
    if (ours != NULL) ort->ReleaseSessionOptions(ours);
    if (st != NULL) {
      packd_ort_abandon(*share, ort->GetErrorMessage(st));
      ort->ReleaseStatus(st);
    }
    if (scratch != NULL) {
      ort->ReleaseSession(scratch); /* its private weights and prepacks go */
      role = packd_ort_finish_build(*share);
    } else {
      role = PACKD_ORT_PRIVATE;
    }
  }
  if (role == PACKD_ORT_SERVED) {
    if (packd_ort_model_path(*share, path, sizeof path) >= sizeof path) {
      packd_ort_abandon(*share, "the served model's path is longer than the helper's buffer");
    } else {
      OrtStatus *st = ort->CreateSession(env, path, options, session);
      if (st != NULL) {
        packd_ort_abandon(*share, ort->GetErrorMessage(st));
        ort->ReleaseStatus(st);
        *session = NULL;
      } else if (packd_ort_served(*share)) {
        return NULL;
      } else {
        ort->ReleaseSession(*session);
        *session = NULL;
      }
    }
  }
  return ort->CreateSession(env, model_path, options, session);
}
#endif /* ORT_API_VERSION */

#ifdef __cplusplus
}
#endif

#endif /* PACKD_ONNXRUNTIME_H */
